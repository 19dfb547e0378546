"""The engine's multi-step decode: many decode steps in one compiled ``lax.while_loop``.

A decode call of :class:`jaxflow.rollout.RolloutEngine` with ``EngineConfig.loop_steps`` > 0
runs while no request waits for a slot (nothing queued, or no slot free) and returns to the host
only when it must: when fewer than ``min_live`` rows are still drawing (a slot freed while work
waits, or the call's row bucket would shrink), when every row has ended, or after
``loop_steps`` steps. Each step is the single-step decode's arithmetic on the single-step
decode's shapes, so the loop's draws equal ``decode_steps=1`` calls bit for bit:

* the body is :attr:`jaxflow.rollout.model_step.Steps.one_step`, the body of the engine's
  ``decode`` program (the same projections, paged attention, draw with ``fold_in(key, t)``);
* the page table a step attends over is as wide as a single step's would be: with
  ``narrow_tables`` the next power of two of the longest live row's pages (at most
  ``pages_per_seq``: one inner loop of steps on ``page_table[:, :w]`` per width w, each
  running while the steps need w, swept in order until the call ends); without,
  ``pages_per_seq``;
* the host allocates every page the loop may write before the call (each sequence's pages
  come out of its admission reservation, so they exist) and gives the unwritten ones back
  after it (:meth:`jaxflow.rollout.scheduler.Scheduler.finish_decode` with ``trim``).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from jaxflow.models.sampler import SamplingConfig, is_stop
from jaxflow.rollout.model_step import DecodeOut
from jaxflow.rollout.pages import bucket

__all__ = ["loop_min_live", "make_decode_loop", "step_widths"]


def step_widths(table_width: int, pages_per_seq: int, narrow: bool) -> tuple[int, ...]:
    """The page-table widths a step of a loop over a ``table_width``-wide table may attend
    with: every :func:`jaxflow.rollout.pages.bucket` of 1..``table_width`` pages (at most
    ``pages_per_seq``) with ``narrow`` tables, ascending; else ``(table_width,)``."""
    if not narrow:
        return (table_width,)
    return tuple(sorted({bucket(n, pages_per_seq) for n in range(1, table_width + 1)}))


@functools.lru_cache(maxsize=32)
def make_decode_loop(graphdef: nnx.GraphDef, one_step: Callable, sampling: SamplingConfig, *,
                     page_size: int, pages_per_seq: int, narrow: bool, max_steps: int,
                     mesh: Mesh | None = None) -> Callable:
    """The multi-step decode program (jitted; pools and hook state donated)::

        loop(state, pools, tokens [B], lengths [B], page_table [B, W], key_data [B, ...],
             t [B], remaining [B], min_live, hook_state=None)
          -> (pools, DecodeOut [max_steps, B, ...], hook_state)

    Arguments as ``Steps.decode`` (the table must cover every position the loop may write:
    ``min(max_steps, remaining)`` steps per row). It runs steps while at least ``min_live``
    (int32 scalar >= 1) rows are live and at most ``max_steps`` of them; the outputs of steps
    not run are not live (token ``pad_id``, log-prob 0). ``one_step``: ``Steps.one_step`` of
    :func:`jaxflow.rollout.model_step.make_steps` for the same graphdef and sampling."""

    def loop(state, pools, tokens, lengths, page_table, key_data, t, remaining, min_live,
             hook_state=None):
        model = nnx.merge(graphdef, state)
        keys = jax.random.wrap_key_data(key_data)
        widths = step_widths(page_table.shape[1], pages_per_seq, narrow)

        def width_index(lengths, live):  # the first width >= the longest live row's pages
            pages = jnp.where(live, (lengths + page_size - 1) // page_size, 1).max()
            return jnp.sum(jnp.asarray(widths, jnp.int32) < pages)

        def go_on(carry):
            i, live = carry[0], carry[6]
            return (i < max_steps) & (live.sum(dtype=jnp.int32) >= jnp.maximum(min_live, 1))

        def body(width, carry):
            i, pools, tokens, lengths, t, remaining, live, hook_state, outs = carry
            pools, out, hook_state = one_step(model, pools, tokens, lengths,
                                              page_table[:, :width], keys, t, live, hook_state)
            remaining = remaining - 1
            still = live & (remaining > 0)
            stop = is_stop(out.token, sampling)
            if stop is not None:
                still = still & ~stop
            outs = jax.tree.map(lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, i, 0),
                                outs, out)
            return (i + 1, pools, jnp.where(still, out.token, tokens), lengths + still,
                    t + still, remaining, still, hook_state, outs)

        def sweep(carry):  # an inner loop per width, each while a step needs that width
            for k, width in enumerate(widths):
                carry = jax.lax.while_loop(
                    lambda c, k=k: go_on(c) & (width_index(c[3], c[6]) == k),
                    functools.partial(body, width), carry)
            return carry

        live = remaining > 0
        shapes = jax.eval_shape(lambda: one_step(model, pools, tokens, lengths, page_table, keys,
                                                 t, live, hook_state))[1]
        fills = DecodeOut(sampling.pad_id, 0, 0, 0, False, 0, 0)
        outs = DecodeOut(*(jnp.full((max_steps,) + s.shape, f, s.dtype)
                           for s, f in zip(shapes, fills)))
        carry = (jnp.int32(0), pools, tokens, lengths, t, remaining, live, hook_state, outs)
        if len(widths) == 1:
            carry = jax.lax.while_loop(go_on, functools.partial(body, widths[0]), carry)
        else:  # no lax.switch: a conditional around the steps costs a pool copy per step
            carry = jax.lax.while_loop(go_on, sweep, carry)
        return carry[1], carry[8], carry[7]

    jitted = jax.jit(loop, donate_argnums=(1, 9))
    if mesh is None:
        return jitted
    from jaxflow.mesh import MeshJit

    return MeshJit(jitted, mesh)


def loop_min_live(scheduler, *, packed: bool, refill: int = 1) -> int | None:
    """The ``min_live`` of the next decode call if it may run the loop, else None (a request
    waits for a free slot: it is prefilling, or waits for pages, and single steps serve it).

    With work queued the loop returns as soon as ``refill`` rows have ended (1: their slots
    are refilled then, as after a single step). Otherwise ``packed`` rows (``bucket_rows``: the running sequences
    packed into B = the next power of two of them) return when the live rows fit B / 2 (a
    single step would run the smaller bucket then); rows by slot run until every row ends."""
    queued = bool(scheduler.waiting or scheduler.prefilling or scheduler.ready)
    free = scheduler.free_slots()
    if queued and free:
        return None
    running = len(scheduler.slots) - free
    if queued:
        return max(1, running - refill + 1)
    if packed:
        return scheduler.row_count(running, len(scheduler.slots)) // 2 + 1
    return 1
