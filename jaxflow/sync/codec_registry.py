"""The codec registry: every payload codec's name, the one check of a name, and what each sends.

Codecs (:data:`CODECS`; the payload header's ``codec`` field names the one it was encoded with):

  dense    every bf16 leaf whole (2 bytes per element): the full-sync baseline; a full payload
           applies from any version.
  coo      changed bf16 elements as int32 position + bf16 value (6 bytes), the paper's format.
  gap      gaps in the narrowest unsigned width with uint32 escapes + bf16 values.
  entropy  Rice-coded gaps + sign/magnitude-coded ulp differences (``jaxflow.sync.entropy``).
  auto     per leaf: entropy-coded sparse, or when a leaf is heavily changed a bitmask section,
           or raw dense when that is smaller still.

Every place that takes a codec name (the encoder, the sender, ``SyncConfig``, a payload's
header, the ``sparse_sync`` config) checks it with :func:`check_codec`.
"""

from __future__ import annotations

CODECS = ("dense", "coo", "gap", "entropy", "auto")
#: Codecs whose sections carry the changed elements' new bf16 bit patterns; the others carry
#: the differences from the old values.
NEW_VALUE_CODECS = ("coo", "gap")


def check_codec(codec: str, *, field: str | None = None,
                error: type[Exception] = ValueError) -> str:
    """``codec`` when it is one of :data:`CODECS`; otherwise raises ``error`` in one line naming
    it and the valid codecs: "unknown codec 'zip'; valid: ...", or with ``field`` (a config
    key) "sync.codec='zip'; valid: ..." (plus how to turn weight sync off for 'none')."""
    if codec in CODECS:
        return codec
    if field is None:
        raise error(f"unknown codec {codec!r}; valid: {CODECS}")
    hint = " (no weight sync: set sync=none)" if codec == "none" else ""
    raise error(f"{field}={codec!r}; valid: {CODECS}{hint}")


def sends_new_values(codec: str) -> bool:
    """Whether ``codec``'s sparse sections carry the new bit patterns (coo, gap) rather than
    differences from the old values (entropy, auto; dense sends leaves whole)."""
    return check_codec(codec) in NEW_VALUE_CODECS


__all__ = ["CODECS", "NEW_VALUE_CODECS", "check_codec", "sends_new_values"]
