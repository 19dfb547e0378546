"""Response masks of any dtype as bool: the one conversion every mask-taking function uses.

The sampler returns ``SampleOutput.mask`` as float32 (1.0 / 0.0), rollouts store it as float32,
FIGA's pairs as int32 and the losses compute with bool. Every public function of
:mod:`jaxflow.rl` and :mod:`jaxflow.align` that takes a ``mask`` passes it through
:func:`as_bool_mask`, so bool and every integer or floating dtype are accepted and mean the
same thing: **nonzero = True** (the token counts), zero = False. A mask is never a weight: a
float mask of 0.5 counts its token fully, exactly like 1.0 (and a NaN entry counts too, as
NaN != 0); weight tokens with the losses' own weights (TIS / MIS, FIGA's alpha / beta),
not through the mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def as_bool_mask(mask, *, name: str = "mask", shape: tuple[int, ...] | None = None) -> jax.Array:
    """``mask != 0`` as a bool jax array (a bool mask is returned as a jax array unchanged).

    Args:
      mask: array-like of bool or any integer / floating dtype (numpy, jax, a traced value
        or a nested list); nonzero entries are True.
      name: the argument's name in error messages.
      shape: the shape the mask must have (e.g. logp's [B, T]); None checks nothing.

    Returns:
      bool array of the mask's shape.

    Raises:
      ValueError: a dtype that is neither bool nor numeric (strings, objects), or a shape
        other than ``shape``; the message names ``name``, the bad value and what is valid.
    """
    dtype = getattr(mask, "dtype", None)
    if dtype is None:
        try:
            dtype = np.asarray(mask).dtype
        except Exception as e:  # ragged lists and the like
            raise ValueError(f"{name} must be an array of bool or numbers, got "
                             f"{type(mask).__name__} ({e})") from None
        mask = np.asarray(mask)
    if not (dtype == np.bool_ or jnp.issubdtype(dtype, jnp.number)):
        raise ValueError(f"{name} must be bool or numeric (nonzero = True), got dtype {dtype}")
    if shape is not None and tuple(np.shape(mask)) != tuple(shape):
        raise ValueError(f"{name} shape {tuple(np.shape(mask))} does not match the expected "
                         f"shape {tuple(shape)}")
    if dtype == np.bool_:
        return jnp.asarray(mask)
    return jnp.asarray(mask) != 0
