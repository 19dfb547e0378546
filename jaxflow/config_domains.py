"""The domain of every numeric config field, declared on its class and checked when it is built.

A config dataclass declares the values each int / float field (and each element of a tuple of
them) may take, with the :func:`domains` class decorator:

    @domains(steps=COUNT, lr=POSITIVE, warmup=COUNT0, keep=UNIT, seed=SEED)
    @dataclasses.dataclass(frozen=True)
    class TrainConfig:
        ...

Every instance checks them after the class's own ``__post_init__`` (whose messages, for the
values it checks itself, come first), so ``--set`` and ``--dry-run`` refuse an out-of-domain value
with one line (``steps=0; valid: an integer >= 1 and <= 2147483647``) before anything runs.
``None`` is always valid for an optional field. Integers have an upper bound too: JAX's default
integer is 32-bit, so a count is at most :data:`INT32_MAX` unless its field declares more.
:func:`declared_domains` returns a class's table (the config-domain tests read it).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, Callable, Literal, TypeVar

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class Domain:
    """A set of valid values: integers (``kind="int"``) or finite reals in ``[low, high]``
    (either end open); ``inf_off``: also ``inf``, where the field documents it as "off"."""

    kind: Literal["int", "real"]
    low: float = -math.inf
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False
    inf_off: bool = False

    def contains(self, value: Any) -> bool:
        """Whether ``value`` (a scalar; bools are not numbers here) is in the domain."""
        if isinstance(value, bool):
            return False
        if self.kind == "int":
            if not isinstance(value, numbers.Integral):
                return False
        elif not isinstance(value, numbers.Real) or math.isnan(value):
            return False
        elif math.isinf(value):
            return self.inf_off and value > 0
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return bool(above and below)

    def describe(self) -> str:
        """The domain as the end of a ``valid: ...`` message."""
        if self.inf_off:
            return dataclasses.replace(self, inf_off=False).describe() + " (or inf: off)"
        low_op, high_op = (">" if self.low_open else ">="), ("<" if self.high_open else "<=")
        if self.kind == "int":
            parts = [f"{low_op} {_num(self.low)}"] if math.isfinite(self.low) else []
            parts += [f"{high_op} {_num(self.high)}"] if math.isfinite(self.high) else []
            return "an integer " + " and ".join(parts) if parts else "an integer"
        if math.isfinite(self.low) and math.isfinite(self.high):
            return (f"a number in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if math.isfinite(self.low):
            return f"a finite number {low_op} {_num(self.low)}"
        if math.isfinite(self.high):
            return f"a finite number {high_op} {_num(self.high)}"
        return "a finite number"


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 2**64 else repr(x)


def Int(low: int = 1, high: int = INT32_MAX) -> Domain:  # noqa: N802 (reads like a type)
    """Integers in ``[low, high]``."""
    return Domain("int", low, high)


def Real(low: float = -math.inf, high: float = math.inf, *, low_open: bool = False,  # noqa: N802
         high_open: bool = False, inf_off: bool = False) -> Domain:
    """Finite numbers in ``[low, high]`` (``(low`` / ``high)`` when open); with ``inf_off``
    also ``inf`` (a bound or cap that ``inf`` turns off)."""
    return Domain("real", low, high, low_open, high_open, inf_off)


COUNT = Int(1)  #: sizes, counts, steps, intervals
COUNT0 = Int(0)  #: the same where 0 means none / off
SEED = Int(0, 2**32 - 1)  #: jax.random.key / numpy SeedSequence words
POSITIVE = Real(0.0, low_open=True)  #: rates, temperatures, epsilons, scales
NON_NEGATIVE = Real(0.0)  #: coefficients and weights where 0 turns a term off
FINITE = Real()  #: any finite number
UNIT = Real(0.0, 1.0)  #: probabilities and fractions
OPEN_UNIT = Real(0.0, 1.0, low_open=True, high_open=True)  #: (0, 1)
WIDTH_OR_OFF = Real(0.0, inf_off=True)  #: clip widths >= 0 (inf: that side unclipped)
CAP_OR_OFF = Real(0.0, low_open=True, inf_off=True)  #: caps > 0 (inf: uncapped)
ABOVE_ONE = Real(1.0, low_open=True)  #: factors and caps that must exceed 1


def domains(**declared: Domain) -> Callable[[type[_T]], type[_T]]:
    """Class decorator (above ``@dataclasses.dataclass``): declares ``field=Domain`` for the
    class's numeric fields and checks them on every instance after its own ``__post_init__``
    (``__init__`` is wrapped, so ``dataclasses.replace`` checks them too).
    A name that is not a field is a TypeError at import time."""

    def wrap(cls: type[_T]) -> type[_T]:
        if not dataclasses.is_dataclass(cls):
            raise TypeError(f"@domains goes above @dataclasses.dataclass ({cls.__qualname__})")
        unknown = sorted(set(declared) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise TypeError(f"@domains on {cls.__qualname__}: not fields: {', '.join(unknown)}")
        table = {**declared_domains(cls), **declared}
        init = cls.__init__

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            try:
                init(self, *args, **kwargs)  # with the class's own __post_init__ checks
            except (ValueError, TypeError):
                raise
            except Exception:  # those checks tripped over a value outside its domain
                check_domains(self)
                raise
            check_domains(self)

        cls.__init__ = __init__
        cls.__config_domains__ = table
        return cls

    return wrap


def declared_domains(cls: type) -> dict[str, Domain]:
    """``{field: Domain}`` declared on ``cls`` (and its bases) with :func:`domains`."""
    return dict(getattr(cls, "__config_domains__", {}))


def check_domains(obj: Any) -> None:
    """Raises ValueError naming the first field of ``obj`` outside its declared domain (a tuple:
    every element in it; None: always valid)."""
    for name, domain in declared_domains(type(obj)).items():
        value = getattr(obj, name)
        if value is None:
            continue
        if isinstance(value, tuple):
            bad = [v for v in value if not domain.contains(v)]
            if bad:
                raise ValueError(f"{name}={value!r} holds {bad[0]!r}; valid: each {domain.describe()}")
        elif not domain.contains(value):
            raise ValueError(f"{name}={value!r}; valid: {domain.describe()}")
