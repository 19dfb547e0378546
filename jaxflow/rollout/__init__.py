"""jaxflow.rollout: a rollout engine for RL -- paged KV cache, continuous batching, shared group
prefixes, weights updated in place -- and its paged decode attention.

    from jaxflow.rollout import EngineConfig, RolloutEngine
    engine = RolloutEngine(model_cfg, params, EngineConfig(slots=32, page_size=16, num_pages=1024,
                           prefill_chunk=64), SamplingConfig(max_new_tokens=256, eos_id=eos))
    out = engine.generate(prompts, prompt_lengths, keys, group_size=8)   # rows i * 8 + g
    out.tokens, out.logprobs, out.mask, out.lengths, out.versions   # [R * G, N] host arrays

Modules, one idea each:

* ``pages``: the host page allocator (page 0 is the null page; reference counts; reservations,
  so an admitted request never finds the pool empty and nothing is preempted) and the pool's
  head width (``pool_head_dim``: 128 lanes where decode runs the TPU kernel, else head_dim).
* ``scheduler``: requests (a prompt and its G sequences), FIFO admission, chunked prefill of
  each prompt ONCE per group, slot assignment with copy-on-write of the prompt's partial last
  page (the full pages are shared by reference count), retirement at EOS / max_new_tokens.
* ``model_step``: the jitted programs (prefill chunk, decode of ``decode_steps`` steps, page
  copy), the static sampler's arithmetic over the paged pool; rows bucketed to powers of two
  (``bucket_rows``); on a mesh, pools sharded by K/V heads over "model".
* ``decode_loop``: the multi-step decode (``EngineConfig.loop_steps``): while no request waits
  for a slot, many decode steps in one compiled ``lax.while_loop`` (page tables as narrow as a
  single step's: an inner loop per width; pages allocated ahead and the unwritten ones given
  back), back on the host when ``loop_refill`` slots free while work waits; with
  ``loop_refill=1`` bit-identical to single steps.
* ``records``: what a request hands back (``RequestOutput`` / ``EngineOutput``) and the MoE
  routing record (``EngineConfig.record_routing``: each MoE layer's experts and gates per
  position, as the static sampler records them for R3).
* ``paged_attention``: decode attention over the pool by backend (XLA gather on CPU, the
  upstream Pallas kernels on TPU / GPU).
* ``prefill_attention``: the prefill chunk's attention over the pool by backend (XLA gather on
  CPU, the upstream ragged paged-attention kernel on TPU, ``gpu_prefill_kernel`` on GPU).
* ``gpu_prefill_kernel``: a Pallas (Triton) prefill kernel reading the pages through the table
  in the kernel, with each row's causal offset.
* ``programs``: the engine's prefill and decode programs with abstract arguments for
  ``--compile-only`` (``bench_rollout --variant=full``; the flagship with ``rl.sampler=engine``).
* ``bench_arms`` / ``bench``: bench_rollout's workloads (forced output lengths), its two arms
  (this engine, the static sampler) and its cases.
* ``engine``: :class:`RolloutEngine` (``generate``; streaming ``add_request`` / ``step`` /
  ``result``; ``update_weights`` / ``follow(replica)`` for SparseRL-Sync's bf16 replica, with a
  weights version recorded per token).

Exactness: sequence b's token t is drawn with ``fold_in(keys[b], t)`` exactly as
``make_sampler(per_row_keys=True)`` does; on CPU the tokens equal the static sampler's and the
log-probs agree to ~2e-6 (f32 matmuls on XLA:CPU depend on the batch shape they run in, which
moves the static sampler itself by as much); on equal shapes the prefill and decode step are
bit-identical to the static sampler's (``tests/test_rollout_engine.py``).

Logits hooks: ``apply`` gets each row's own step [B]; a hook state must be per row (leaves
[B, ...]), initialised from a sequence's prompt when it takes a slot.

Not supported yet: preemption (admission reserves each sequence's worst case instead), prefix
caching across requests, ``hook_args``.
"""
from jaxflow.rollout import decode_loop, prefill_attention, records
from jaxflow.rollout.engine import (
    EngineConfig,
    EngineOutput,
    EngineStats,
    RequestOutput,
    RolloutConfigError,
    RolloutEngine,
)

__all__ = ["EngineConfig", "EngineOutput", "EngineStats", "RequestOutput",
           "RolloutConfigError", "RolloutEngine", "decode_loop", "prefill_attention", "records"]
