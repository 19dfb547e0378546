"""Worked addition: generator, split, lengths and the verifier (jaxflow.data.worked_addition)."""

import numpy as np
import pytest

from jaxflow.data.arithmetic import eval_prompts, packed_batch
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.data.worked_addition import WorkedAdditionTask, check_working, column_working
from jaxflow.rl.tasks import Task, make_task


def test_column_working_by_hand():
    assert column_working(374, 258, 3) == "4+8=12,7+5+1=13,3+2+1=6:632"
    assert column_working(999, 999, 3) == "9+9=18,9+9+1=19,9+9+1=19:1998"
    assert column_working(100, 200, 3) == "0+0=0,0+0+0=0,1+2+0=3:300"
    assert column_working(57, 68, 2) == "7+8=15,5+6+1=12:125"


@pytest.mark.parametrize("completion, reason", [
    ("4+8=12,7+5+1=13,3+2+1=6:632", None),
    ("4+8=12,7+5+1=13,3+2+1=6:633", "answer '633'"),          # right working, wrong sum
    ("4+8=12,7+5+0=12,3+2+1=6:632", "column 1: '7+5+0"),      # wrong carry, right sum
    ("4+8=12,7+5+1=12,3+2+1=6:632", "column 1: sum '12'"),
    ("8+4=12,7+5+1=13,3+2+1=6:632", "column 0"),              # operands swapped
    ("4+8=12,7+5+1=13:632", "2 columns"),
    ("4+8=12,7+5+1=13,3+2+1=6,632", "no ':'"),
    ("632", "no ':'"),
])
def test_check_working_names_the_first_error(completion, reason):
    got = check_working(374, 258, 3, completion)
    if reason is None:
        assert got is None
    else:
        assert got is not None and got.startswith(reason), got


def test_score_is_the_verifier():
    task = make_task("worked_addition")
    assert isinstance(task, Task) and isinstance(task, WorkedAdditionTask)
    assert task.score("374+258=", "4+8=12,7+5+1=13,3+2+1=6:632") == 1.0
    assert task.score("374+258=", " 4+8=12,7+5+1=13,3+2+1=6:632 ") == 1.0  # strip
    assert task.score("374+258=", "4+8=12,7+5+1=13,3+2+1=6:633") == 0.0
    assert task.score("garbage", "4+8=12,7+5+1=13,3+2+1=6:632") == 0.0
    rng = np.random.default_rng(0)
    for prompt in task.prompts(rng, 50):  # the generator's answer passes its own verifier
        a, b = map(int, prompt.rstrip("=").split("+"))
        assert task.score(prompt, task.answer(a, b)) == 1.0
        assert task.score(prompt, task.answer(a, (b + 1) % 1000 or 100)) == 0.0


def test_generator_digits_split_and_lengths():
    task = WorkedAdditionTask(digits=3, heldout_mod=20)
    a, b = task.sample(np.random.default_rng(1), 2000)
    assert a.min() >= 100 and a.max() <= 999 and b.min() >= 100 and b.max() <= 999
    assert not task._is_heldout(a, b).any()
    ha, hb = task.sample(np.random.default_rng(2), 500, heldout=True)
    assert task._is_heldout(ha, hb).all()
    # about 1 in heldout_mod pairs is held out
    u, v = np.random.default_rng(3).integers(100, 1000, size=(2, 20000))
    assert 0.04 < task._is_heldout(u, v).mean() < 0.06
    lengths = [len(task.answer(x, y)) for x, y in zip(a, b)]
    assert min(lengths) >= 25 and max(lengths) <= task.max_answer_len == 29
    assert len(task.answer(999, 999)) == task.max_answer_len
    # the RL held-out prompts are the pretraining evaluator's
    tok = CharTokenizer()
    _, _, answers = eval_prompts(task, tok, n=8)
    prompts = task.heldout_prompts(8)
    assert [task.answer(*map(int, p.rstrip("=").split("+"))) for p in prompts] == answers


def test_packed_batch_takes_it():
    task, tok = WorkedAdditionTask(digits=2), CharTokenizer()
    batch = packed_batch(task, tok, seed=0, step=0, batch_size=2, seq_len=48)
    row = batch.tokens[0][batch.segment_ids[0] == 1]
    text = tok.decode(row)
    prompt, working = text.split("=", 1)
    a, b = map(int, prompt.split("+"))
    assert working == column_working(a, b, 2)
    assert batch.loss_mask[0].sum() == len(working) + 1  # the working, the sum and EOS


def test_bad_config_is_an_error():
    with pytest.raises(ValueError, match="digits=0"):
        WorkedAdditionTask(digits=0)
    with pytest.raises(ValueError, match="heldout_mod=1"):
        WorkedAdditionTask(heldout_mod=1)
