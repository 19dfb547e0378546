"""Pallas kernels for jaxflow's hot loops.

Each kernel lives in its own file with a public jitted wrapper (shape validation ->
jax.custom_vjp -> pl.pallas_call) and a pure-jnp `*_reference` that defines its semantics.
On CPU kernels only run with interpret=True; the default CPU path uses the XLA reference.

Kernels:
  fused_logprobs        fused LM-head log-probs without materialising [N, V] logits (+ backward:
                        fused_logprobs_bwd; block sizes and VMEM limits: fused_logprobs_blocks)
  sync_diff_compact     SparseRL-Sync encode: bit-compare, count and compact changed bf16 elements
  sync_scatter_apply    SparseRL-Sync receive: scatter-apply synced bf16 bit patterns
  sync_tiles            the tile layout and block sizes both sync kernels share
  embedding_bag         gather table rows and sum / average them per bag

Infrastructure:
  dispatch              kernel-or-XLA decisions (``auto`` backends) made where a failure can be caught
  targets               abstract TPU v5e / v5p / v6e and H100 / H200 chips (the compile gate)
  lowering              lowering and per-program footprints for TPU and GPU on any host
  catalog               every kernel at test and production sizes, per platform, as abstract calls

``__all__`` names these modules; ``import pallas_kernels`` imports none of them.
"""

__all__ = [
    "fused_logprobs", "fused_logprobs_bwd", "fused_logprobs_blocks", "sync_diff_compact",
    "sync_scatter_apply", "sync_tiles", "embedding_bag", "dispatch", "targets", "lowering", "catalog",
]
