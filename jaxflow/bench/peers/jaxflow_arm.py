"""jaxflow's arms of ``bench_peers``, run as ``python -m jaxflow.bench.peers.jaxflow_arm`` by the
main interpreter and spoken to over :mod:`jaxflow.bench.peers.arm_protocol` like a peer's.

``embedding``: :func:`jaxflow.embeddings.make_train_step` on :class:`jaxflow.embeddings.ShardedEmbeddings`
over one CPU device (the peers run one process too), sum-pooled row-wise tables, the case's
optimizer (``rowwise_adagrad`` / ``sgd``) on the touched rows, capacity the case's ``max_unique``
(the most distinct keys of any of its batches, so it cannot overflow), the tables initialised
from the case's array; one step = one batch of ``batch`` samples.

``generation``: :class:`jaxflow.rollout.RolloutEngine` (one slot per sequence, pages of the
case's ``page_size``, XLA attention, the case's ``engine`` options, ``loop_steps`` at most
``max_new``) on the case's checkpoint (``jaxflow.models.from_pretrained``), greedy, no stop
token, so every sequence is ``max_new`` tokens (long-tailed: the case's lengths,
:func:`forced_length_hook`; GRPO groups: G sequences per prompt sharing its prefilled pages,
sampled at temperature 1, one slot per sequence); one step = one ``generate`` of every prompt (a
fresh engine, its programs cached).
Before timing it writes the logits of the case's ``probe`` tokens to ``case["logits_out"]``
(the harness compares them with the peer's).

``grpo``: :class:`jaxflow.rl.grpo.GRPOTrainer` (its default static sampler, lag 1, no KL) on the
case's checkpoint, the case's prompts as a task (:class:`PromptsTask`, reward
:func:`even_token_reward`) through an id tokenizer whose stop id is never sampled, so every
response is ``max_new`` tokens; one step = one iteration (rollout, advantages, update, publish).
"""

from __future__ import annotations

import sys

__all__ = ["setup_embedding", "setup_generation", "forced_length_hook", "IdTokenizer", "PromptsTask",
           "even_token_reward", "setup_grpo", "setup", "main"]


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
    options = dict(case.get("engine", {}))
    if "loop_steps" in options:  # a loop of more steps than a sequence draws would only widen its outputs
        options["loop_steps"] = min(int(options["loop_steps"]), n)
    config = EngineConfig(slots=slots, page_size=case["page_size"],
                          num_pages=pool_pages(slots, p + n, case["page_size"]),
                          prefill_chunk=p, max_seq_len=p + n, attention="xla", **options)
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


class IdTokenizer:
    """Text of space-separated token ids <-> ids, no BOS, pad 0, stop id ``eos`` (the GRPO case
    passes ``vocab``, an id no model row emits, so every response is ``max_new`` tokens)."""

    def __init__(self, vocab: int, eos: int):
        self.vocab_size, self.eos_id, self.eos_ids, self.bos_id, self.pad_id = vocab, eos, (eos,), None, 0

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``."""
        return [int(t) for t in text.split()]

    def decode(self, ids) -> str:
        """The text of ``ids``."""
        return " ".join(str(int(i)) for i in ids)


class PromptsTask:
    """The GRPO case's prompts (text of ids) as a :class:`jaxflow.rl.tasks.Task`: every rollout
    draws the same ``prompts``; :func:`even_token_reward` scores a completion."""

    name = "bench_peers_prompts"

    def __init__(self, prompts: list[str], max_new: int):
        self._prompts, self.max_completion_len = prompts, max_new
        self.max_prompt_len = self.max_prompt_tokens = max(len(p.split()) for p in prompts)

    def prompts(self, rng, n: int) -> list[str]:
        """The case's prompts (``n`` of them, cycled)."""
        return [self._prompts[i % len(self._prompts)] for i in range(n)]

    def heldout_prompts(self, n: int, seed: int = 0) -> list[str]:
        """The same prompts (the case evaluates nothing)."""
        return self.prompts(None, n)

    def score(self, prompt: str, completion: str) -> float:
        """:func:`even_token_reward` of ``completion``."""
        return even_token_reward(completion)


def even_token_reward(completion: str) -> float:
    """The fraction of even token ids in a completion (text of ids): the GRPO case's reward in
    every arm (cheap, deterministic, different across a group)."""
    ids = completion.split()
    return sum(int(t) % 2 == 0 for t in ids) / max(len(ids), 1)


def setup_grpo(case: dict):
    """(step, info) of the GRPO iteration case: :class:`jaxflow.rl.grpo.GRPOTrainer` (rollout of
    G samples per prompt at temperature 1, group advantages, one AdamW update, publish) on the
    case's checkpoint; one step = one iteration (``trainer.step``)."""
    import dataclasses

    import jax
    import numpy as np
    from jax.sharding import Mesh

    from jaxflow.bench.peers.workloads import read_array
    from jaxflow.models import from_pretrained
    from jaxflow.models.architectures import config_from_hf, read_config
    from jaxflow.models.hf_checkpoint import load_hf_params
    from jaxflow.rl.grpo import GRPOConfig, GRPOTrainer
    from jaxflow.train.lm_state import OptimConfig

    probe = read_array(case["arrays"]["probe"])
    np.asarray(from_pretrained(case["checkpoint"], dtype="float32")(jax.numpy.asarray(probe)),
               np.float32).tofile(case["logits_out"])
    # the rollout's prompt rows are one token wider than the prompts (a BOS slot, padded here: no BOS)
    model_cfg = dataclasses.replace(config_from_hf(read_config(case["checkpoint"]), dtype="float32"),
                                    max_seq_len=case["prompt_len"] + case["max_new"] + 1)
    mesh = Mesh(np.asarray(jax.devices("cpu")[:1]), ("data",))
    prompts = [" ".join(str(int(x)) for x in row) for row in read_array(case["arrays"]["prompts"])]
    opt = case["optimizer"]
    trainer = GRPOTrainer(model_cfg, GRPOConfig(prompts_per_rollout=len(prompts), group_size=case["group_size"],
                                                max_new_tokens=case["max_new"], temperature=1.0),
                          OptimConfig(lr=opt["lr"], warmup_steps=0, weight_decay=opt["weight_decay"], b1=opt["b1"],
                                      b2=opt["b2"], grad_clip=opt["grad_clip"]),
                          PromptsTask(prompts, case["max_new"]), IdTokenizer(case["vocab"], case["vocab"]),
                          {"trainer": mesh, "rollout": mesh}, seed=case.get("seed", 0), total_rollouts=10**6)
    params, _ = load_hf_params(case["checkpoint"], model_cfg, mesh=mesh)
    box = {"state": trainer.init_state(params)}
    want = len(prompts) * case["group_size"] * case["max_new"]

    def step():
        box["state"], row = trainer.step(box["state"])
        tokens = int(round(row["response_length/mean"] * len(prompts) * case["group_size"]))
        if tokens != want:
            raise RuntimeError(f"the rollout sampled {tokens} tokens; the case asks {want}")
        return {"units": 1, "unit": "iterations", "tokens": tokens}

    for _ in range(max(case["warmup"], 1)):
        step()
    return step, {"devices": 1, "jax": jax.__version__}


def setup(case: dict):
    """The case's (step, info) by its ``kind``; ValueError naming the valid kinds."""
    kinds = {"embedding": setup_embedding, "generation": setup_generation, "grpo": setup_grpo}
    if case.get("kind") not in kinds:
        raise ValueError(f"case kind={case.get('kind')!r}; valid: {', '.join(kinds)}")
    return kinds[case["kind"]](case)


def main() -> int:
    """Serves the protocol on stdin / stdout."""
    from jaxflow.bench.peers.arm_protocol import serve

    return serve(setup)


if __name__ == "__main__":
    sys.exit(main())
