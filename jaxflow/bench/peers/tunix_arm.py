"""tunix's arm of ``bench_peers``' generation case, run as a script by the tunix venv's
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
"""

from __future__ import annotations

import sys

__all__ = ["IdTokenizer", "forced_lengths_model", "setup", "main"]


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


def setup(case: dict):
    """(step, info) of the generation case; ValueError for another kind."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from tunix.generate import sampler as sampler_lib
    from tunix.models.llama3 import model as model_lib
    from tunix.models.llama3 import params as params_lib

    if case.get("kind") != "generation":
        raise ValueError(f"case kind={case.get('kind')!r}; valid: generation")
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


def main() -> int:
    """Serves the protocol on stdin / stdout (run as a script: ``arm_protocol`` sits beside it)."""
    from arm_protocol import serve

    return serve(setup)


if __name__ == "__main__":
    sys.exit(main())
