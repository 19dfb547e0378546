"""One process of the 2-process from_pretrained test (run by test_models_hf_multiprocess)."""
import json
import sys

import jax
import numpy as np

from jaxflow.distributed import initialize, set_cpu_device_count


def main(path: str, coordinator: str, process_id: int, out: str) -> None:
    set_cpu_device_count(4)
    initialize(coordinator, 2, process_id)
    from flax import nnx
    from jax.sharding import Mesh

    from jaxflow.models import load_hf_params, save_pretrained
    from jaxflow.models.architectures import config_from_hf
    from jaxflow.models.hf_checkpoint import _abstract_model, read_config

    # rows = processes (jax.devices() lists process 0's devices first): "fsdp" splits the
    # parameters across the two processes, "model" within each
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "model"))
    config = config_from_hf(read_config(path))
    params, stats = load_hf_params(path, config, mesh=mesh)
    _, graphdef, state = _abstract_model(config)
    tokens = jax.numpy.asarray(np.arange(16).reshape(2, 8) % config.vocab_size, jax.numpy.int32)

    @jax.jit
    def forward(params, tokens):
        s = jax.tree.map(lambda x: x, state)
        nnx.replace_by_pure_dict(s, params)
        return nnx.merge(graphdef, s)(tokens)

    from jax.experimental import multihost_utils

    logits = multihost_utils.process_allgather(forward(params, tokens), tiled=True)
    # every process joins the gather of the sharded params; process 0 writes
    model_state = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(model_state, params)
    save_pretrained(nnx.merge(graphdef, model_state), out)
    print(json.dumps({"process": jax.process_index(), "bytes_read": stats.bytes_read,
                      "logits": np.asarray(logits).tolist()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4])
