"""jaxflow's arms of ``bench_peers``, run as ``python -m jaxflow.bench.peers.jaxflow_arm`` by the
main interpreter and spoken to over :mod:`jaxflow.bench.peers.arm_protocol` like a peer's.

``embedding``: :func:`jaxflow.embeddings.make_train_step` on :class:`jaxflow.embeddings.ShardedEmbeddings`
over one CPU device (the peers run one process too), sum-pooled row-wise tables, the case's
optimizer (``rowwise_adagrad`` / ``sgd``) on the touched rows, capacity the case's ``max_unique``
(the most distinct keys of any of its batches, so it cannot overflow), the tables initialised
from the case's array; one step = one batch of ``batch`` samples.

``generation``: :class:`jaxflow.rollout.RolloutEngine` (one slot per sequence, pages of the
case's ``page_size``, XLA attention, the case's ``engine`` options) on the case's checkpoint
(``jaxflow.models.from_pretrained``), greedy, no stop token, so every sequence is ``max_new``
tokens (long-tailed: the case's lengths, :func:`forced_length_hook`; GRPO groups: G sequences
per prompt sharing its prefilled pages, sampled at temperature 1, one slot per sequence); one
step = one ``generate`` of every prompt (a fresh engine, its programs cached).
Before timing it writes the logits of the case's ``probe`` tokens to ``case["logits_out"]``
(the harness compares them with the peer's).
"""

from __future__ import annotations

import sys

__all__ = ["setup_embedding", "setup_generation", "forced_length_hook", "setup", "main"]


def setup_embedding(case: dict):
    """(step, info) of the embedding case (see the module docstring); ``info["first_loss"]`` is
    the loss of the first warm-up step, before any update."""
    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jaxflow.bench.peers.workloads import read_array
    from jaxflow.embeddings import ShardedEmbeddings, TableSpec, check_stats, make_sparse_optimizer, make_train_step
    from jaxflow.embeddings.bench import regression_loss

    n, b = case["tables"], case["batch"]
    names = [f"t{i}" for i in range(n)]
    specs = [TableSpec(name, case["rows"], case["dim"], "row_wise", "sum") for name in names]
    mesh = Mesh(np.asarray(jax.devices("cpu")[:1]), ("data",))
    kwargs = {"eps": case["eps"]} if case["optimizer"] == "rowwise_adagrad" else {}
    opt = make_sparse_optimizer(case["optimizer"], case["learning_rate"], **kwargs)
    emb = ShardedEmbeddings(specs, mesh, opt, capacity=int(case["max_unique"]),
                            bucket_capacity=int(case["max_unique"]))

    def loss_fn(params, outputs, targets):
        return regression_loss(outputs, targets) / b, {}

    step_fn = make_train_step(emb, loss_fn)
    init = read_array(case["arrays"]["tables"])
    state = {"emb": emb.from_dense({name: init[i] for i, name in enumerate(names)}), "dense": {}}
    batches = []
    for k in range(case["num_batches"]):
        ids = read_array(case["arrays"][f"ids_{k}"])
        targets = read_array(case["arrays"][f"targets_{k}"])
        batches.append(jax.device_put(({name: ids[i] for i, name in enumerate(names)},
                                       {name: targets[i] for i, name in enumerate(names)})))
    box = {"state": state, "i": 0}

    def step():
        ids, targets = batches[box["i"] % len(batches)]
        box["state"], metrics = step_fn(box["state"], ids, targets)
        box["i"] += 1
        loss = float(metrics["loss"])  # waits for the step
        return {"units": b, "unit": "samples", "loss": loss, "metrics": metrics}

    first = step()
    check_stats(first.pop("metrics"), emb.capacity)
    for _ in range(max(case["warmup"] - 1, 0)):
        step()

    def timed_step():
        out = step()
        out.pop("metrics")
        return out

    return timed_step, {"first_loss": first["loss"], "capacity": emb.capacity, "devices": 1,
                        "jax": jax.__version__}


def forced_length_hook(eos: int):
    """A :class:`jaxflow.models.sampler.LogitsHook` ending each row at the length its prompt's first
    token gives (the long-tailed case): ``eos`` is forced at token ``length - 1`` and forbidden before."""
    import jax.numpy as jnp

    from jaxflow.models.sampler import LogitsHook

    def init(prompts, prompt_valid, vocab_size, args):
        return prompts[:, 0].astype(jnp.int32)

    def apply(logits, length, step, args):
        return logits.at[:, eos].set(jnp.where(step == length - 1, 1e9, -1e9))

    return LogitsHook(apply=apply, init=init)


def setup_generation(case: dict):
    """(step, info) of the generation case (see the module docstring)."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxflow.bench.peers.workloads import read_array
    from jaxflow.models import from_pretrained
    from jaxflow.models.sampler import SamplingConfig
    from jaxflow.rollout import EngineConfig, RolloutEngine
    from jaxflow.rollout.pages import pool_pages

    model = from_pretrained(case["checkpoint"], dtype="float32")
    probe = read_array(case["arrays"]["probe"])
    np.asarray(model(jax.numpy.asarray(probe)), np.float32).tofile(case["logits_out"])
    graphdef, state = nnx.split(model)
    prompts = read_array(case["arrays"]["prompts"])
    r, p, n = prompts.shape[0], prompts.shape[1], case["max_new"]
    slots = r * int(case.get("group_size", 1))
    config = EngineConfig(slots=slots, page_size=case["page_size"],
                          num_pages=pool_pages(slots, p + n, case["page_size"]),
                          prefill_chunk=p, max_seq_len=p + n, attention="xla", **case.get("engine", {}))
    forced, g = case.get("lengths"), int(case.get("group_size", 1))
    sampling = SamplingConfig(max_new_tokens=n, temperature=1.0 if case.get("sampled") else 0.0,
                              eos_id=case["eos"] if forced else None)
    hook = forced_length_hook(case["eos"]) if forced else None
    lengths = np.full((r,), p, np.int32)
    keys = jax.random.split(jax.random.key(0), r * g)
    want = sum(forced) if forced else r * g * n

    def step():
        engine = RolloutEngine(graphdef, state, config, sampling, logits_hook=hook)
        out = engine.generate(prompts, lengths, keys, group_size=g)
        tokens = int(np.asarray(out.mask).sum())
        return {"units": tokens, "unit": "tokens", "first_tokens": np.asarray(out.tokens)[0, :4].tolist()}

    first = step()
    if first["units"] != want:
        raise RuntimeError(f"generated {first['units']} tokens; the case asks {want}")
    for _ in range(max(case["warmup"] - 1, 0)):
        step()
    return step, {"devices": 1, "jax": jax.__version__, "first_tokens": first["first_tokens"]}


def setup(case: dict):
    """The case's (step, info) by its ``kind``; ValueError naming the valid kinds."""
    kinds = {"embedding": setup_embedding, "generation": setup_generation}
    if case.get("kind") not in kinds:
        raise ValueError(f"case kind={case.get('kind')!r}; valid: {', '.join(kinds)}")
    return kinds[case["kind"]](case)


def main() -> int:
    """Serves the protocol on stdin / stdout."""
    from jaxflow.bench.peers.arm_protocol import serve

    return serve(setup)


if __name__ == "__main__":
    sys.exit(main())
