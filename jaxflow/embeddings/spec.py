"""Table specs and their placement plan: where every row of every table lives.

Tables of one embedding dim are packed into one *group* array, FBGEMM-TBE style, so a lookup
needs one dedup, one All2All of ids and one All2All of rows per group rather than per table.

Sharded group (row-wise and table-wise tables of dim D) on a mesh axis of P shards::

    global array [P * S, D], sharded over the axis; shard p holds rows [p*S, (p+1)*S):
      [ row-wise table a: rows of a owned by p (R_a = ceil(V_a / P)) | row-wise table b ... |
        table-wise tables placed on p (the same region size on every shard, padded) ]

Row-wise id i of table a lives on shard ``i // R_a`` at local row ``off_a + i % R_a``;
table-wise id i of table t on its owner at ``off_t + i``. A group row's *key* is its global row
``owner * S + local``. Replicated group: ``[sum V, D]`` on every device, key ``off_t + i``.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np


class Placement(str, enum.Enum):
    """How a table is sharded: ``row_wise`` (rows over the devices), ``table_wise`` (whole tables per device) or
    ``replicated``."""
    ROW_WISE = "row_wise"
    TABLE_WISE = "table_wise"
    REPLICATED = "replicated"


class Pooling(str, enum.Enum):
    """How a bag of ids becomes one vector: ``sum``, ``mean``, or ``none`` (an unpooled sequence feature [B, L, D])."""
    SUM = "sum"
    MEAN = "mean"
    NONE = "none"  # unpooled sequence feature: [B, L, D]


class IdPolicy(str, enum.Enum):
    """What an id outside ``[0, vocab)`` means: ``error`` (padding is -1) or ``hash_modulo`` (id % vocab)."""
    ERROR = "error"  # an id outside [0, vocab) is an error (padding is -1)
    HASH_MODULO = "hash_modulo"  # any id >= 0 maps to id % vocab


def _enum(cls, value, what):
    try:
        return cls(value)
    except ValueError:
        raise ValueError(f"{what}={value!r}; valid: {', '.join(m.value for m in cls)}") from None


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table (one feature reads it).

    Attributes:
      name: table and feature name.
      vocab_size, dim: rows and columns.
      placement: "row_wise" | "table_wise" | "replicated".
      pooling: "sum" | "mean" over each bag, or "none" (unpooled sequence).
      id_policy: "error" | "hash_modulo" for ids >= vocab_size (-1 is always padding).
      owner: shard of a table-wise table (default: round-robin over table-wise tables).
    """

    name: str
    vocab_size: int
    dim: int
    placement: str = "row_wise"
    pooling: str = "sum"
    id_policy: str = "error"
    owner: int | None = None

    def __post_init__(self):
        if self.vocab_size < 1 or self.dim < 1:
            raise ValueError(f"table {self.name!r}: vocab_size={self.vocab_size}, dim={self.dim}; "
                             "both must be >= 1")
        object.__setattr__(self, "placement", _enum(Placement, self.placement, "placement").value)
        object.__setattr__(self, "pooling", _enum(Pooling, self.pooling, "pooling").value)
        object.__setattr__(self, "id_policy", _enum(IdPolicy, self.id_policy, "id_policy").value)


@dataclasses.dataclass(frozen=True)
class TableLayout:
    """Where one table's rows are: its group, local offset, rows per shard, owner."""

    spec: TableSpec
    group: str
    offset: int  # row-wise: in every shard; table-wise: in the owner's shard; replicated: global
    rows_per_shard: int  # row-wise R; table-wise / replicated: vocab_size
    owner: int  # table-wise owner; -1 otherwise

    def global_rows(self, num_shards: int, shard_rows: int) -> np.ndarray:
        """Group-array row of each table row 0..V-1 (int64)."""
        ids = np.arange(self.spec.vocab_size, dtype=np.int64)
        p = self.spec.placement
        if p == Placement.ROW_WISE.value:
            return (ids // self.rows_per_shard) * shard_rows + self.offset + ids % self.rows_per_shard
        if p == Placement.TABLE_WISE.value:
            return self.owner * shard_rows + self.offset + ids
        return self.offset + ids


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    name: str
    dim: int
    replicated: bool
    shard_rows: int  # S (sharded) or total rows (replicated)
    tables: tuple[str, ...]

    def global_shape(self, num_shards: int) -> tuple[int, int]:
        rows = self.shard_rows if self.replicated else num_shards * self.shard_rows
        return (rows, self.dim)


@dataclasses.dataclass(frozen=True)
class EmbeddingPlan:
    """Placement of ``specs`` over ``num_shards`` shards of mesh axis ``axis``."""

    specs: tuple[TableSpec, ...]
    num_shards: int
    axis: str
    layouts: tuple[TableLayout, ...]
    groups: tuple[GroupLayout, ...]

    def table(self, name: str) -> TableLayout:
        """The layout of table ``name``; KeyError names the tables."""
        for t in self.layouts:
            if t.spec.name == name:
                return t
        raise KeyError(f"no table {name!r}; tables: {[t.spec.name for t in self.layouts]}")

    def group(self, name: str) -> GroupLayout:
        """The layout of group ``name``; KeyError names the groups."""
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no group {name!r}; groups: {[g.name for g in self.groups]}")

    def group_tables(self, group: str) -> tuple[TableLayout, ...]:
        """The layouts of the tables packed into ``group``."""
        return tuple(self.table(n) for n in self.group(group).tables)

    def global_rows(self, name: str) -> np.ndarray:
        """Where table ``name``'s rows live in its group's packed array: int[vocab] row indices."""
        t = self.table(name)
        return t.global_rows(self.num_shards, self.group(t.group).shard_rows)


def plan_tables(specs, num_shards: int, axis: str = "data") -> EmbeddingPlan:
    """Packs tables into per-dim groups and assigns rows to shards (see module docstring)."""
    specs = tuple(specs)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate table names in {names}")
    if num_shards < 1:
        raise ValueError(f"num_shards={num_shards}; need >= 1")
    layouts: list[TableLayout] = []
    groups: list[GroupLayout] = []
    rr = 0
    for replicated in (False, True):
        dims = sorted({s.dim for s in specs if (s.placement == Placement.REPLICATED.value) == replicated})
        for dim in dims:
            members = [s for s in specs if s.dim == dim
                       and (s.placement == Placement.REPLICATED.value) == replicated]
            gname = f"{'replicated' if replicated else 'sharded'}_d{dim}"
            if replicated:
                off = 0
                for s in members:
                    layouts.append(TableLayout(s, gname, off, s.vocab_size, -1))
                    off += s.vocab_size
                groups.append(GroupLayout(gname, dim, True, off, tuple(s.name for s in members)))
                continue
            off = 0
            for s in members:
                if s.placement == Placement.ROW_WISE.value:
                    r = -(-s.vocab_size // num_shards)
                    layouts.append(TableLayout(s, gname, off, r, -1))
                    off += r
            used = [0] * num_shards
            for s in members:
                if s.placement == Placement.TABLE_WISE.value:
                    owner = s.owner if s.owner is not None else rr % num_shards
                    rr += s.owner is None
                    if not 0 <= owner < num_shards:
                        raise ValueError(f"table {s.name!r}: owner={owner}; valid: 0..{num_shards - 1}")
                    layouts.append(TableLayout(s, gname, off + used[owner], s.vocab_size, owner))
                    used[owner] += s.vocab_size
            shard_rows = off + max(used)
            if num_shards * shard_rows >= 2**31:
                raise ValueError(f"group {gname}: {num_shards} x {shard_rows} rows overflow int32 keys")
            groups.append(GroupLayout(gname, dim, False, shard_rows, tuple(s.name for s in members)))
    order = {n: i for i, n in enumerate(names)}
    layouts.sort(key=lambda t: order[t.spec.name])
    return EmbeddingPlan(specs, num_shards, axis, tuple(layouts), tuple(groups))
