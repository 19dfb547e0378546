"""Verifiable tasks: prompt sources, held-out splits, scoring, token helpers."""

import fractions

import numpy as np
import pytest

from jaxflow.data.arithmetic import AdditionTask, eval_prompts
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.rl.tasks import (
    AdditionRLTask,
    CountdownTask,
    Task,
    encode_prompts,
    evaluate_expression,
    make_task,
    score_completions,
)


def test_addition_matches_lm_pretrain_format_and_heldout_set():
    task = make_task("addition", max_digits=2)
    assert isinstance(task, Task)
    tok = CharTokenizer()
    held = task.heldout_prompts(32)
    prompts, _, answers = eval_prompts(AdditionTask(max_digits=2), tok, n=32)
    assert held == [tok.decode(p) for p in prompts]
    assert task.score(held[0], answers[0]) == 1.0
    assert task.score(held[0], answers[0] + "1") == 0.0
    train = set(task.prompts(np.random.default_rng(0), 2000))
    assert not train & set(task.heldout_prompts(500))
    assert all(p.endswith("=") and "+" in p for p in train)


def test_countdown_scoring_rules():
    task = CountdownTask()
    assert task.score("3,5,7:22=", "3*5+7") == 1.0
    assert task.score("3,5,7:22=", "(7+5)*3-14") == 0.0  # 14 is not given
    assert task.score("3,5,7:22=", "3*5+7+0") == 0.0     # 0 is not given
    assert task.score("3,5,7:8=", "3+5") == 1.0          # a subset is fine
    assert task.score("3,3,7:6=", "3+3") == 1.0          # a repeated number given twice
    assert task.score("3,5,7:6=", "3+3") == 0.0          # ... but not once
    assert task.score("3,5,7:22=", "3*5+") == 0.0        # malformed
    assert task.score("3,5,7:22=", "7/0") == 0.0         # division by zero
    assert task.score("3,5,7:2=", "(7+3)/5") == 1.0


def test_expression_evaluator_precedence_and_parentheses():
    assert evaluate_expression("2+3*4") == (fractions.Fraction(14), [2, 3, 4])
    assert evaluate_expression("(2+3)*4")[0] == 20
    assert evaluate_expression("8-3-2")[0] == 3
    assert evaluate_expression("7/2")[0] == fractions.Fraction(7, 2)
    for bad in ("", "2+", "(2", "2)", "a", "2**3"):
        with pytest.raises(ValueError):
            evaluate_expression(bad)


def test_countdown_prompts_are_encodable_and_split():
    task = CountdownTask()
    tok = CharTokenizer()
    train = task.prompts(np.random.default_rng(1), 300)
    held = task.heldout_prompts(50)
    assert held == task.heldout_prompts(50)
    assert not set(train) & set(held)
    tokens, lengths = encode_prompts(tok, train, task.max_prompt_len + 1)
    assert tokens.shape == (300, task.max_prompt_len + 1) and lengths.max() <= tokens.shape[1]
    for p in train[:50]:
        nums, target = p.rstrip("=").split(":")
        assert len(nums.split(",")) == 3 and 0 <= int(target) <= 99


def test_score_completions_needs_eos():
    tok = CharTokenizer()
    task = AdditionRLTask(max_digits=1)
    prompts = ["2+3=", "2+3=", "2+3="]
    rows = np.array([tok.encode("5", eos=True) + [0], tok.encode("5") + [0, 0],
                     tok.encode("6", eos=True) + [0]], np.int32)
    assert score_completions(task, tok, prompts, rows).tolist() == [1.0, 0.0, 0.0]


def test_unknown_task_names_the_valid_ones():
    with pytest.raises(ValueError, match="countdown"):
        make_task("sudoku")
