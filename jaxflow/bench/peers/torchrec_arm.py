"""TorchRec's arms of ``bench_peers``' embedding case, run as a script by the TorchRec venv's
interpreter (``peers.torchrec_python``); it imports torch, torchrec and fbgemm_gpu and the
standard library only (its protocol from ``arm_protocol.py`` beside it), never jaxflow.

Case fields beyond :mod:`jaxflow.bench.peers.workloads`' embedding case: ``variant``
``"fused"`` (``FusedEmbeddingBagCollection``: FBGEMM's split table-batched embedding bags (TBE)
with the optimizer fused into the backward, ``EXACT_ROWWISE_ADAGRAD`` / ``EXACT_SGD``) or
``"unfused"`` (``EmbeddingBagCollection``, autograd to dense table gradients, then
``torchrec.optim.RowWiseAdagrad`` / ``torch.optim.SGD``). Same tables (initialised from the case's
array), ids, targets, loss ``sum((pooled - target)^2) / batch`` and optimizer formula as the
jaxflow arm; one step = one batch.
"""

from __future__ import annotations

import sys

__all__ = ["setup", "main"]


def _tensor(spec):
    import numpy as np
    import torch
    from arm_protocol import read_raw

    data, dtype, shape = read_raw(spec)
    return torch.from_numpy(np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape).copy())


def setup(case: dict):
    """(step, info) of the case's ``variant`` (see the module docstring); ValueError for an unknown
    kind, variant or optimizer."""
    import torch
    import torchrec
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    if case.get("kind") != "embedding":
        raise ValueError(f"case kind={case.get('kind')!r}; valid: embedding")
    variant, opt_name = case.get("variant"), case["optimizer"]
    if variant not in ("fused", "unfused"):
        raise ValueError(f"variant={variant!r}; valid: fused, unfused")
    if opt_name not in ("rowwise_adagrad", "sgd"):
        raise ValueError(f"optimizer={opt_name!r}; valid: rowwise_adagrad, sgd")
    n, rows, dim, b, bag = case["tables"], case["rows"], case["dim"], case["batch"], case["bag"]
    configs = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=dim, num_embeddings=rows,
                                  feature_names=[f"f{i}"], pooling=PoolingType.SUM) for i in range(n)]
    lr, eps = case["learning_rate"], case["eps"]
    if variant == "fused":
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection

        opt_type, kwargs = ((torchrec.optim.RowWiseAdagrad, {"lr": lr, "eps": eps}) if opt_name == "rowwise_adagrad"
                            else (torch.optim.SGD, {"lr": lr}))
        model = FusedEmbeddingBagCollection(configs, optimizer_type=opt_type, optimizer_kwargs=kwargs,
                                            device=torch.device("cpu"))
        optimizer = None
    else:
        model = torchrec.EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
        optimizer = (torchrec.optim.RowWiseAdagrad(model.parameters(), lr=lr, eps=eps)
                     if opt_name == "rowwise_adagrad" else torch.optim.SGD(model.parameters(), lr=lr))
    weights = [model.embedding_bags[f"t{i}"].weight for i in range(n)]  # the fused module's are views of TBE's
    init = _tensor(case["arrays"]["tables"])
    with torch.no_grad():
        for i, w in enumerate(weights):
            w.copy_(init[i])
    keys = [f"f{i}" for i in range(n)]
    batches = []
    for k in range(case["num_batches"]):
        ids = _tensor(case["arrays"][f"ids_{k}"]).to(torch.int64)  # [tables, batch, bag]
        targets = _tensor(case["arrays"][f"targets_{k}"])  # [tables, batch, dim]
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=ids.reshape(-1),
                                                  lengths=torch.full((n * b,), bag, dtype=torch.int32))
        batches.append((kjt, targets.permute(1, 0, 2).reshape(b, n * dim).contiguous()))
    box = {"i": 0}

    def step():
        kjt, target = batches[box["i"] % len(batches)]
        box["i"] += 1
        pooled = model(kjt).values()  # [batch, tables * dim], the keys' order
        loss = torch.sum(torch.square(pooled - target)) / b
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()  # fused: FBGEMM updates the touched rows inside the backward
        if optimizer is not None:
            optimizer.step()
        return {"units": b, "unit": "samples", "loss": float(loss.detach())}

    first = step()
    for _ in range(max(case["warmup"] - 1, 0)):
        step()
    import fbgemm_gpu

    return step, {"first_loss": first["loss"], "torch": torch.__version__, "threads": torch.get_num_threads(),
                  "torchrec": getattr(torchrec, "__version__", "?"),
                  "fbgemm_gpu": getattr(fbgemm_gpu, "__version__", "?"), "variant": variant}


def main() -> int:
    """Serves the protocol on stdin / stdout (run as a script: ``arm_protocol`` sits beside it)."""
    from arm_protocol import serve

    return serve(setup)


if __name__ == "__main__":
    sys.exit(main())
