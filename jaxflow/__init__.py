"""jaxflow: pure-functional, mesh-sharded JAX implementations of large-scale training systems.

Subpackages (one idea each):
  jaxflow.models      decoder-only LM (flax nnx) and its KV-cache sampler
  jaxflow.data        built-in generators (arithmetic corpus, character tokenizer)
  jaxflow.mesh        meshes, role sub-meshes, logical-axis sharding rules
  jaxflow.rl          policy losses (GRPO/DAPO/GSPO/CISPO with SIS/TIS/MIS), log-prob paths
  jaxflow.sync        SparseRL-Sync weight-delta codecs
  jaxflow.run         the experiment runner CLI (python -m jaxflow.run)
"""

__version__ = "0.1.0"
