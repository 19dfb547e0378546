"""tunix's arm of ``bench_peers``' generation and GRPO cases, run as a script by the tunix venv's
interpreter (``peers.tunix_python``); it imports tunix, jax, flax, numpy and the standard
library only (its protocol from ``arm_protocol.py`` beside it), never jaxflow.

The case's Hugging Face checkpoint loaded by tunix's own loader
(``tunix.models.llama3.params.create_model_from_safe_tensors``; RoPE theta pinned to the case's
1e6, the value tunix 0.1.7's Llama3 uses whatever its config says), the logits of the case's
``probe`` tokens written to ``case["logits_out"]`` before timing, then tunix's ``Sampler``
(one compiled decode loop over a static KV cache of ``prompt_len + max_new``): greedy,
``max_new`` steps, the stop token forbidden so every sequence is ``max_new`` tokens; one step
= one sampler call on every prompt. Prompts reach the sampler as text of space-separated ids
through an identity tokenizer (no BOS, pad 0). Long-tailed lengths: :func:`forced_lengths_model`
ends each row where the case says (EOS forced, as jaxflow's arm does with a logits hook); the
sampler's one loop runs until every row has ended. GRPO groups: each prompt repeated G times
(adjacent copies), sampled at temperature 1 (top-p 1.0: tunix's sampling mode; greedy without it).
The GRPO iteration: tunix's ``GRPOLearner`` on the same checkpoint (:func:`setup_grpo`).
"""

from __future__ import annotations

import sys

__all__ = ["IdTokenizer", "forced_lengths_model", "load_model", "setup_generation", "even_token_reward",
           "setup_grpo", "setup", "main"]


class IdTokenizer:
    """Text of space-separated token ids <-> ids (tunix's Sampler takes strings)."""

    def __init__(self, eos: int):
        self.eos = eos

    def encode(self, text: str, **kwargs) -> list[int]:
        """The ids of ``text``."""
        return [int(t) for t in text.split()]

    def decode(self, ids, **kwargs) -> str:
        """The text of ``ids``."""
        return " ".join(str(int(i)) for i in ids)

    def bos_id(self) -> int:
        """0: no BOS is prepended."""
        return 0

    def eos_id(self) -> int:
        """The case's stop token."""
        return self.eos

    def pad_id(self) -> int:
        """0."""
        return 0


def forced_lengths_model(inner, lengths, prompt_len: int, eos: int):
    """``inner`` (tunix's Llama3) wrapped so that row b's token ``lengths[b] - 1`` is ``eos`` and
    no earlier one is (the long-tailed case; every prompt has ``prompt_len`` tokens, so the token
    a call predicts at position q is number ``q + 1 - prompt_len``). Rows keep the prompts' order."""
    import jax.numpy as jnp
    from flax import nnx

    class ForcedLengths(nnx.Module):
        def __init__(self):
            self.inner, self.lengths = inner, tuple(int(x) for x in lengths)  # a tuple: static

        @property
        def config(self):
            return self.inner.config

        @property
        def num_embed(self):
            return self.inner.num_embed

        def __call__(self, input_tokens, positions, cache, attention_mask):
            logits, cache = self.inner(input_tokens, positions, cache, attention_mask)
            token = positions + 1 - prompt_len  # [B, L]
            last = jnp.asarray(self.lengths, jnp.int32)[:, None] - 1
            return logits.at[..., eos].set(jnp.where(token == last, 1e9, -1e9)), cache

    return ForcedLengths()


def _array(spec):
    import numpy as np
    from arm_protocol import read_raw

    data, dtype, shape = read_raw(spec)
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


def load_model(case: dict):
    """(tunix's Llama3 of the case's checkpoint, its one-device ("fsdp", "tp") mesh); writes the
    logits of the case's ``probe`` tokens to ``case["logits_out"]``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tunix.models.llama3 import model as model_lib
    from tunix.models.llama3 import params as params_lib

    config = model_lib.ModelConfig(num_layers=case["layers"], vocab_size=case["vocab"], embed_dim=case["d_model"],
                                   hidden_dim=case["d_ff"], num_heads=case["heads"], head_dim=case["head_dim"],
                                   num_kv_heads=case["kv_heads"], rope_theta=int(case["rope_theta"]),
                                   norm_eps=case["norm_eps"])
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]).reshape(1, 1), ("fsdp", "tp"))
    with jax.set_mesh(mesh):
        model = params_lib.create_model_from_safe_tensors(case["checkpoint"], config, mesh, dtype=jnp.float32)
    probe = _array(case["arrays"]["probe"])
    b, t = probe.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    logits, _ = model(jnp.asarray(probe), positions, None, mask)
    np.asarray(logits, np.float32).tofile(case["logits_out"])
    return model, mesh


def setup_generation(case: dict):
    """(step, info) of the generation cases (module docstring)."""
    import jax
    from tunix.generate import sampler as sampler_lib

    model, _ = load_model(case)
    prompts = _array(case["arrays"]["prompts"])
    r, p, n = prompts.shape[0], prompts.shape[1], case["max_new"]
    forced = case.get("lengths")
    sampled = forced_lengths_model(model, forced, p, case["eos"]) if forced else model
    sampler = sampler_lib.Sampler(sampled, IdTokenizer(case["eos"]),
                                  sampler_lib.CacheConfig(cache_size=p + n, num_layers=case["layers"],
                                                          num_kv_heads=case["kv_heads"], head_dim=case["head_dim"]))
    g = int(case.get("group_size", 1))
    # GRPO groups: each prompt repeated G times, its copies adjacent (as tunix's GRPO learner repeats them)
    texts = [" ".join(str(int(x)) for x in row) for row in prompts for _ in range(g)]
    sampling = {"temperature": 1.0, "top_p": 1.0, "seed": 0} if case.get("sampled") else {"temperature": 0.0}

    want = list(forced) if forced else [n] * (r * g)

    def step():
        out = sampler(texts, max_generation_steps=n, max_prompt_length=p, eos_tokens=[case["eos"]],
                      forbidden_tokens=None if forced else [case["eos"]], **sampling)
        got = [len(x) for x in out.tokens]
        if forced:  # the sampler's tokens stop before EOS; the useful tokens count it, as jaxflow's mask does
            got = [g + 1 if g < w else g for g, w in zip(got, want)]
        if got != want:
            raise RuntimeError(f"sampled lengths {got[:8]}...; the case asks {want[:8]}...")
        return {"units": sum(got), "unit": "tokens", "first_tokens": [int(x) for x in out.tokens[0][:4]]}

    first = step()
    for _ in range(max(case["warmup"] - 1, 0)):
        step()
    import tunix  # noqa: F401

    return step, {"jax": jax.__version__, "first_tokens": first["first_tokens"]}


def even_token_reward(completion: str) -> float:
    """The fraction of even token ids in a completion (text of ids); jaxflow's arm scores with
    the same function."""
    ids = completion.split()
    return sum(int(t) % 2 == 0 for t in ids) / max(len(ids), 1)


def setup_grpo(case: dict):
    """(step, info) of the GRPO iteration case: tunix's ``GRPOLearner`` (vanilla rollout = its
    ``Sampler`` on the actor's own weights, G samples per prompt at temperature 1 / top-p 1,
    rewards, group advantages, one AdamW update of the actor; ``beta`` 0: no reference model,
    ``num_iterations`` 1: no separate old-policy pass). ``train`` runs in a thread over a dataset
    fed one batch (the case's prompts) per step; a step returns when that global step has run
    (``_run_global_step``: rollout and update; the actor is the rollout model, so there is no
    weight sync to wait for). The stop id is ``vocab`` (never sampled): every response is
    ``max_new`` tokens, as in jaxflow's arm."""
    import queue
    import threading

    import jax
    import numpy as np
    import optax
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    model, mesh = load_model(case)
    prompts = _array(case["arrays"]["prompts"])
    p, n, g, opt = prompts.shape[1], case["max_new"], case["group_size"], case["optimizer"]
    roles = rl_cluster_lib.Role
    optimizer = optax.chain(optax.clip_by_global_norm(opt["grad_clip"]),
                            optax.adamw(opt["lr"], b1=opt["b1"], b2=opt["b2"], weight_decay=opt["weight_decay"]))
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={roles.ACTOR: mesh, roles.REFERENCE: mesh, roles.ROLLOUT: mesh}, rollout_engine="vanilla",
        training_config=rl_cluster_lib.RLTrainingConfig(actor_optimizer=optimizer, eval_every_n_steps=10**9,
                                                        max_steps=10**9),
        rollout_config=base_rollout.RolloutConfig(max_tokens_to_generate=n, max_prompt_length=p,
                                                  kv_cache_size=p + n, temperature=1.0, top_p=1.0,
                                                  eos_tokens=[case["vocab"]]))
    cluster = rl_cluster_lib.RLCluster(actor=model, reference=None, tokenizer=IdTokenizer(case["vocab"]),
                                       cluster_config=cluster_config)
    tokens = []

    def reward(prompts, completions, **kwargs):
        tokens.append(sum(len(c.split()) for c in completions))
        return [even_token_reward(c) for c in completions]

    learner = grpo_learner.GRPOLearner(
        cluster, grpo_learner.GRPOConfig(num_generations=g, num_iterations=1, beta=0.0, epsilon=0.2), reward_fns=reward)
    batches, done = queue.Queue(), queue.Queue()
    run_global_step = learner._run_global_step  # the one hook on an iteration's end tunix offers

    def counted(*args, **kwargs):
        try:
            run_global_step(*args, **kwargs)
        finally:
            done.put(1)

    learner._run_global_step = counted

    def dataset():
        while (batch := batches.get()) is not None:
            yield batch

    errors = []

    def train():
        try:
            learner.train(dataset())
        except BaseException as e:  # reported by the next step
            errors.append(e)
            done.put(0)

    threading.Thread(target=train, daemon=True).start()
    texts = np.asarray([" ".join(str(int(x)) for x in row) for row in prompts])  # tunix repeats arrays G times
    want = len(texts) * g * n

    def step():
        batches.put({"prompts": texts})
        if not done.get(timeout=3600) or errors:
            raise RuntimeError(f"tunix's train loop ended: {errors[0] if errors else 'no error'}")
        if tokens[-1] != want:
            raise RuntimeError(f"the rollout sampled {tokens[-1]} tokens; the case asks {want}")
        return {"units": 1, "unit": "iterations", "tokens": tokens[-1]}

    for _ in range(max(case["warmup"], 1)):
        step()
    return step, {"jax": jax.__version__}


def setup(case: dict):
    """The case's (step, info) by its ``kind``; ValueError naming the valid kinds."""
    kinds = {"generation": setup_generation, "grpo": setup_grpo}
    if case.get("kind") not in kinds:
        raise ValueError(f"case kind={case.get('kind')!r}; valid: {', '.join(kinds)}")
    return kinds[case["kind"]](case)


def main() -> int:
    """Serves the protocol on stdin / stdout (run as a script: ``arm_protocol`` sits beside it)."""
    from arm_protocol import serve

    return serve(setup)


if __name__ == "__main__":
    sys.exit(main())
