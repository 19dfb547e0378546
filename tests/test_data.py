"""Character tokenizer and the packed arithmetic corpus."""

import numpy as np
import pytest

from jaxflow.data import AdditionTask, CharTokenizer, eval_prompts, packed_batch


def test_tokenizer_round_trip_and_errors():
    tok = CharTokenizer()
    ids = tok.encode("12+34=46", bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert tok.decode(ids) == "12+34=46"
    with pytest.raises(ValueError, match="'x' is not in the tokenizer alphabet"):
        tok.encode("1x")


def test_packed_batch_is_deterministic_and_well_formed():
    tok, task = CharTokenizer(), AdditionTask(max_digits=3)
    b1 = packed_batch(task, tok, seed=3, step=7, batch_size=4, seq_len=48)
    b2 = packed_batch(task, tok, seed=3, step=7, batch_size=4, seq_len=48)
    b3 = packed_batch(task, tok, seed=3, step=8, batch_size=4, seq_len=48)
    assert all(np.array_equal(getattr(b1, f), getattr(b2, f)) for f in vars(b1))
    assert not np.array_equal(b1.tokens, b3.tokens)
    for row in range(4):
        for seg in range(1, b1.segment_ids[row].max() + 1):
            sel = b1.segment_ids[row] == seg
            inp, tgt = b1.tokens[row][sel], b1.targets[row][sel]
            assert np.array_equal(inp[1:], tgt[:-1])  # targets are inputs shifted by one
            assert np.array_equal(b1.positions[row][sel], np.arange(sel.sum()))
            text = tok.decode(list(inp) + [tgt[-1]])
            prompt, answer = text.split("=")
            assert task.score(prompt + "=", answer) == 1.0
            # loss only on the answer digits and the EOS
            assert b1.loss_mask[row][sel].sum() == len(answer) + 1
    assert (b1.loss_mask[b1.segment_ids == 0] == 0).all()


def test_heldout_pairs_never_appear_in_training():
    tok, task = CharTokenizer(), AdditionTask(max_digits=2, heldout_mod=5)
    _, _, _ = eval_prompts(task, tok, n=8)
    rng = np.random.default_rng(0)
    a, b = task.sample(rng, 5000)
    assert not task._is_heldout(a, b).any()
    ha, hb = task.sample(rng, 500, heldout=True)
    assert task._is_heldout(ha, hb).all()
    assert task.score("12+5=", "17") == 1.0 and task.score("12+5=", "18") == 0.0
