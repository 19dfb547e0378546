# ruff: noqa: E402
# title: FIGA on revision pairs
# %% [markdown]
# # FIGA on (original, revised) response pairs
#
# FIGA contrasts a model's own response with a minimally revised one: the tokens the revision
# changed or added get a likelihood weight, the original's wrong tokens (where the model still
# likes them) an unlikelihood weight, and everything else no weight. Here a tiny LM first learns
# to give wrong answers to additions, then FIGA on the revised pairs turns it around.

# %%
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxflow.align import (
    FigaConfig,
    addition_answers,
    figa_loss,
    figa_mark_batch,
    figa_marks,
    minimal_revision,
    sequence_logp,
    sft_loss,
)
from jaxflow.data import CharTokenizer
from jaxflow.models import Transformer, TransformerConfig, token_logprobs

# %% [markdown]
# Marks of one pair: the revision's changed tokens (and its end-of-sequence token) get +1, the
# original's replaced or deleted tokens -1.

# %%
tok = CharTokenizer()
original, revised = tok.encode("18", eos=True), tok.encode("17", eos=True)
print(original, revised, figa_marks(original, revised, eos_id=tok.eos_id))

# %% [markdown]
# Pairs: the model's (wrong) answers and their minimal revisions by an oracle
# (`addition_answers` gives the right answer; `minimal_revision` picks the correct candidate
# with the fewest token edits). Rows alternate revised, original; every row is
# `[BOS] prompt` + response, right-padded.

# %%
prompts = ["12+5=", "23+4=", "31+7=", "40+9="]
wrong = ["18", "26", "37", "59"]
originals = [tok.encode(w, eos=True) for w in wrong]
revisions = [minimal_revision(o, [tok.encode(a, eos=True) for a in addition_answers(p)])
             for o, p in zip(originals, prompts)]
pairs = figa_mark_batch(originals, revisions, eos_id=tok.eos_id, pad_id=tok.pad_id)
P = 1 + len(prompts[0])  # every prompt has the same length here
prompt_rows = np.repeat(np.array([tok.encode(p, bos=True) for p in prompts]), 2, axis=0)  # [2 x 4, P]


def interleave(rev, orig):
    out = np.empty((2 * len(rev), *rev.shape[1:]), rev.dtype)
    out[0::2], out[1::2] = rev, orig
    return out


seq = jnp.asarray(np.concatenate([prompt_rows, interleave(pairs.revised_tokens, pairs.original_tokens)], 1))
marks = jnp.asarray(interleave(pairs.revised_marks, pairs.original_marks))
mask = jnp.asarray(interleave(pairs.revised_mask, pairs.original_mask))  # int32: any numeric mask works
is_revised = jnp.tile(jnp.array([True, False]), len(prompts))
for row, m in zip(seq[:2], marks[:2]):
    print(tok.decode(row[1:P]), tok.decode(row[P:]), np.asarray(m))

# %% [markdown]
# A tiny LM; `token_logprobs(model, seq)[:, P:]` is each response token's log-prob given the
# prompt and the tokens before it. One jitted optax step `(params, opt_state, batch)` serves
# both objectives below; the batch is an argument of the step, not a constant inside it.

# %%
cfg = TransformerConfig(vocab_size=tok.vocab_size, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                        d_ff=64, max_seq_len=16)
graphdef, params = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
tx = optax.adam(1e-2)


batch = {"seq": seq, "marks": marks, "mask": mask, "revised": is_revised}


def response_logp(params, seq):
    return token_logprobs(nnx.merge(graphdef, params), seq)[:, P:]  # [rows, L]


def make_step(objective):
    @jax.jit
    def step(params, opt_state, batch):
        (loss, metrics), grads = jax.value_and_grad(objective, has_aux=True)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, metrics
    return step


def preference(params):
    """Per pair: sequence log-prob of the revision minus the original's."""
    s = sequence_logp(response_logp(params, seq), mask)
    return s[0::2] - s[1::2]

# %% [markdown]
# Stand-in for "the model's own samples": supervised training on the original (wrong) rows
# only, until the model prefers them.

# %%
sft_step = make_step(lambda p, b: sft_loss(response_logp(p, b["seq"]), b["mask"] * ~b["revised"][:, None]))
opt_state = tx.init(params)
for _ in range(40):
    params, opt_state, loss, _ = sft_step(params, opt_state, batch)
print("revised - original log-prob per pair:", np.round(preference(params), 2))
assert np.all(preference(params) < 0)

# %% [markdown]
# FIGA: likelihood on the revision's +1 tokens, unlikelihood (weight -beta) on the original's
# -1 tokens whose NLL is still <= 0.6, i.e. tokens the model still puts more than ~55% on.

# %%
figa_step = make_step(lambda p, b: figa_loss(response_logp(p, b["seq"]), b["marks"], b["mask"], b["revised"],
                                             config=FigaConfig()))
opt_state = tx.init(params)
for i in range(40):
    params, opt_state, loss, metrics = figa_step(params, opt_state, batch)
    if i == 0:
        first = {k: int(v) for k, v in metrics.items()}
    if i % 10 == 0:
        print(i, f"loss {float(loss):+.4f}", {k: int(v) for k, v in metrics.items()})

# %% [markdown]
# Checks: the first FIGA step used both signals (each revision's new digit and EOS; every wrong
# digit, which the model still liked), and the model now prefers every revision to its original.

# %%
print("revised - original log-prob per pair:", np.round(preference(params), 2))
assert first["positive_tokens"] == 8 and first["negative_tokens"] == first["negative_kept"] == 4, first
assert np.all(preference(params) > 0)
