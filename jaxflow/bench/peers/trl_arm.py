"""TRL's arm of ``bench_peers``' GRPO iteration case, run as a script by the TRL venv's
interpreter (``peers.trl_python``); it imports torch, transformers, tokenizers, datasets, trl and
the standard library only (its protocol from ``arm_protocol.py`` beside it), never jaxflow.

The case's Hugging Face checkpoint loaded by transformers (``LlamaForCausalLM``, f32 on the CPU;
it reads the checkpoint's RoPE theta), the logits of the case's ``probe`` tokens written to
``case["logits_out"]`` before timing, then TRL's ``GRPOTrainer``: G samples per prompt at
temperature 1 / top-p 1 by ``model.generate`` (at least ``max_new`` tokens: every response is
``max_new`` long, as in the other arms), the reward every arm computes (the fraction of even
token ids), group advantages, one AdamW step (the case's betas, weight decay, clipping and
constant learning rate), no KL (``beta`` 0). Prompts are text of space-separated ids through a
word-level tokenizer whose id of word ``"i"`` is ``i`` (no BOS, pad 0). ``train`` runs in a
thread; a callback holds each optimizer step until the harness asks for it, so one protocol step
= one GRPO iteration.
"""

from __future__ import annotations

import sys

__all__ = ["even_token_reward", "id_tokenizer", "setup", "main"]


def even_token_reward(completion_ids) -> float:
    """The fraction of even token ids in a completion; jaxflow's arm scores with the same rule."""
    ids = [int(t) for t in completion_ids]
    return sum(t % 2 == 0 for t in ids) / max(len(ids), 1)


def id_tokenizer(vocab: int, eos: int):
    """A transformers fast tokenizer mapping the word ``"i"`` to id ``i`` for i < ``vocab``,
    splitting on whitespace, no special tokens added; pad ``"0"``, EOS ``str(eos)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({str(i): i for i in range(vocab)}, unk_token="0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="0", eos_token=str(eos), unk_token="0")


def _array(spec):
    import numpy as np
    from arm_protocol import read_raw

    data, dtype, shape = read_raw(spec)
    return np.frombuffer(data, dtype=np.dtype(dtype).newbyteorder("<")).reshape(shape)


def setup(case: dict):
    """(step, info) of the GRPO iteration case; ValueError for another kind."""
    import queue
    import tempfile
    import threading

    import numpy as np
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import LlamaForCausalLM, TrainerCallback

    if case.get("kind") != "grpo":
        raise ValueError(f"case kind={case.get('kind')!r}; valid: grpo")
    torch.manual_seed(case.get("seed", 0))
    model = LlamaForCausalLM.from_pretrained(case["checkpoint"], torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.as_tensor(_array(case["arrays"]["probe"]).astype(np.int64))).logits
    logits.numpy().astype(np.float32).tofile(case["logits_out"])
    prompts = _array(case["arrays"]["prompts"])
    r, n, g, opt = prompts.shape[0], case["max_new"], case["group_size"], case["optimizer"]
    texts = [" ".join(str(int(x)) for x in row) for row in prompts]
    tokens = []

    def reward(prompts, completions, completion_ids, **kwargs):
        tokens.append(sum(len(c) for c in completion_ids))
        return [even_token_reward(c) for c in completion_ids]

    go, done = queue.Queue(), queue.Queue()

    class OneStepAtATime(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            go.get()

        def on_step_end(self, args, state, control, **kwargs):
            done.put(1)

    args = trl.GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_arm_"), use_cpu=True, report_to="none", save_strategy="no",
        logging_steps=10**9, max_steps=10**9, per_device_train_batch_size=r * g, gradient_accumulation_steps=1,
        num_generations=g, steps_per_generation=1, max_completion_length=n, temperature=1.0, top_p=1.0,
        generation_kwargs={"min_new_tokens": n}, beta=0.0, learning_rate=opt["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=opt["weight_decay"], adam_beta1=opt["b1"], adam_beta2=opt["b2"],
        max_grad_norm=opt["grad_clip"], shuffle_dataset=False, seed=case.get("seed", 0), dataloader_num_workers=0)
    trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args,
                              train_dataset=Dataset.from_dict({"prompt": texts * 64}),
                              processing_class=id_tokenizer(case["vocab"], case["eos"]),
                              callbacks=[OneStepAtATime()])
    errors = []

    def train():
        try:
            trainer.train()
        except BaseException as e:  # reported by the next step
            errors.append(e)
            done.put(0)

    threading.Thread(target=train, daemon=True).start()
    want = r * g * n

    def step():
        go.put(1)
        if not done.get(timeout=3600) or errors:
            raise RuntimeError(f"TRL's train loop ended: {errors[0] if errors else 'no error'}")
        if tokens[-1] != want:
            raise RuntimeError(f"the rollout sampled {tokens[-1]} tokens; the case asks {want}")
        return {"units": 1, "unit": "iterations", "tokens": tokens[-1]}

    for _ in range(max(case["warmup"], 1)):
        step()
    return step, {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__,
                  "torch_threads": torch.get_num_threads()}


def main() -> int:
    """Serves the protocol on stdin / stdout (run as a script: ``arm_protocol`` sits beside it)."""
    from arm_protocol import serve

    return serve(setup)


if __name__ == "__main__":
    sys.exit(main())
