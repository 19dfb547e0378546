# ruff: noqa: E402
# title: RL on your own model: a transformers checkpoint in, GRPO with LoRA, a checkpoint out
# %% [markdown]
# # RL on your own model
#
# We build a tiny Qwen3 with `transformers` (random weights, a character tokenizer built with
# `tokenizers`), write a jsonl file of addition prompts and a reward function in a file of our
# own, train the checkpoint with the `rl` experiment's settings from Python (GRPO, LoRA rank 8),
# then load the exported `hf/` directory in `transformers` and `peft` and compare its logits
# with jaxflow's. Needs the `parity` and `rl` extras; no download.

# %% [markdown]
# Two fake CPU devices (one trainer, one rollout), requested before any other JAX use.

# %%
import jax

jax.config.update("jax_num_cpu_devices", 2)

# %%
import json
import pathlib
import tempfile

import numpy as np
import torch
import transformers

from jaxflow.models.tiny_hf import char_tokenizer
from jaxflow.models.tokenizer_hf import HFTokenizer

work = pathlib.Path(tempfile.mkdtemp())
base = work / "base"
HFTokenizer(char_tokenizer(), eos_id=0, pad_id=0).save_pretrained(str(base))
cfg = transformers.Qwen3Config(
    vocab_size=104, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
    tie_word_embeddings=False, eos_token_id=0, bos_token_id=None, pad_token_id=0)
torch.manual_seed(0)
transformers.Qwen3ForCausalLM(cfg).save_pretrained(str(base))
print(sorted(p.name for p in base.iterdir()))

# %% [markdown]
# The data (a jsonl file with `prompt` and `answer` columns) and the reward, a batched function
# `fn(prompts, completions, **columns) -> list[float]` in our own file. A random policy never
# writes the right sum, so the reward also pays a little for digits: the group-normalised
# advantages then have something to push on.

# %%
rng = np.random.default_rng(0)
with open(work / "train.jsonl", "w") as f:
    for a, b in rng.integers(0, 10, (64, 2)).tolist():
        f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
(work / "my_reward.py").write_text('''
def score(prompts, completions, **columns):
    return [0.9 * (c.strip() == a) + 0.1 * sum(ch.isdigit() for ch in c) / max(len(c), 1)
            for c, a in zip(completions, columns["answer"])]
''')

# %% [markdown]
# The `rl` experiment's config with the overrides a command line would pass
# (`--set model.hf_path=... --set model.lora.rank=8 ...`), run by its driver.

# %%
from configs import rl as rl_config
from jaxflow.config import apply_overrides
from jaxflow.experiment import RunContext
from jaxflow.main import rl as rl_driver

config = apply_overrides(rl_config.get_config("default"), [
    f"model.hf_path={base}", f"data.train={work / 'train.jsonl'}", "data.eval_size=16",
    f"reward.fn={work / 'my_reward.py'}:score", "model.lora.rank=8", "export.hf=true",
    "rollouts=4", "rl.prompts_per_rollout=8", "rl.group_size=4", "rl.lag=1",
    "rl.max_new_tokens=4", "rl.sampler=static", "optim.lr=1e-2", "eval.prompts=16",
    "eval.samples=2", "eval.every=4", "checkpoint_every=4"])
run = RunContext(name="rl", variant="default", out_dir=work / "run")
summary = rl_driver.main(config, run)
run.close()
print({k: summary[k] for k in ("heldout_pass_at_1_initial", "heldout_pass_at_1_final", "task", "reward")})

# %% [markdown]
# What the run logged per rollout, with verl's names.

# %%
rows = [json.loads(line) for line in (work / "run" / "metrics.jsonl").read_text().splitlines()]
for r in rows:
    if "rollout" in r:
        print(r["rollout"], {k: round(r[k], 3) for k in ("critic/score/mean", "response_length/mean",
                                                         "response_length/clip_ratio")})

# %% [markdown]
# The exported checkpoint in `transformers` (merged weights) and in `peft` (the adapter on the
# base checkpoint), against jaxflow's logits of the same directory.

# %%
import peft

from jaxflow.models.hf_checkpoint import from_pretrained

hf = work / "run" / "hf"
ids = torch.tensor([[5, 11, 6, 83]])
with torch.no_grad():
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(hf), dtype=torch.float32)
    base_model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    base_logits = base_model(ids).logits.numpy()
    adapted = peft.PeftModel.from_pretrained(base_model, str(hf / "adapter"))
    theirs, peft_logits = merged(ids).logits.numpy(), adapted(ids).logits.numpy()
ours = np.asarray(from_pretrained(str(hf))(ids.numpy()))
print("jaxflow vs transformers", np.abs(ours - theirs).max())
print("peft adapter vs merged ", np.abs(peft_logits - theirs).max())
print("trained vs base        ", np.abs(theirs - base_logits).max())

# %%
assert np.abs(ours - theirs).max() <= 1e-5 and np.abs(peft_logits - theirs).max() <= 1e-5
assert np.abs(theirs - base_logits).max() > 1e-4
