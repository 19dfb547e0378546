"""jaxflow.rl.rewards: the built-in rewards score known answers, user functions load from a module
or a file, and score_rewards turns every bad reward into one line naming the row."""
import sys
import threading
import time
import warnings

import numpy as np
import pytest

from jaxflow.data.sources import reasoning_gym_rows
from jaxflow.errors import MissingExtraError, UserError
from jaxflow.rl import rewards
from jaxflow.rl.rewards import RewardError, make_reward, score_rewards


def _one_line(e):
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    return str(e.value)


def test_math_verify_in_and_outside_the_main_thread():
    fn = make_reward("math_verify")
    prompts = ["half?", "half?", "72?", "x?"]
    completions = ["so the answer is \\boxed{1/2}", "\\boxed{0.4}", "The total is 72.", "no idea"]
    columns = {"answer": ["0.5", "0.5", ["72"], "\\frac{3}{4}"]}
    expected = [1.0, 0.0, 1.0, 0.0]
    assert score_rewards(fn, prompts, completions, columns).tolist() == expected
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("r", fn(prompts, completions, **columns)))
    worker.start()
    worker.join()
    assert out["r"] == expected  # math-verify's own SIGALRM timeouts would raise in a thread


def test_math_verify_deadline_scores_zero(monkeypatch):
    import math_verify.parser

    def slow_extraction(*args, **kwargs):
        end = time.monotonic() + 5.0
        while time.monotonic() < end:
            pass
        return []

    monkeypatch.setattr(rewards, "MATH_VERIFY_DEADLINE_S", 0.05)
    # Inside math-verify's own `except Exception`: the deadline must get through it.
    monkeypatch.setattr(math_verify.parser, "extract_target_from_pred", slow_extraction)
    start = time.monotonic()
    assert make_reward("math_verify")(["p"], ["\\boxed{1}"], answer=["1"]) == [0.0]
    assert time.monotonic() - start < 2.0


def test_without_the_rl_extra_one_line_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify -> ImportError
    with pytest.raises(MissingExtraError) as e:
        make_reward("math_verify")(["p"], ["1"], answer=["1"])
    assert _one_line(e).startswith("reward='math_verify' needs the 'math_verify' package") and \
        e.value.args[0].endswith('pip install -e ".[rl]"')


def test_exact_match_and_regex():
    cols = {"answer": ["12", ["a", "b"], "7"]}
    assert make_reward("exact_match")(["p"] * 3, [" 12\n", "b", "8"], **cols) == [1.0, 1.0, 0.0]
    assert make_reward("regex:^\\d+$")(["p"] * 3, ["12", "x12", "7"]) == [1.0, 0.0, 1.0]
    # With a group: the last match's first group against the answer.
    fn = make_reward(r"regex:answer: *(\S+)")
    assert fn(["p"] * 3, ["answer: 3 ... answer: 12", "answer: a", "answer: 6"], **cols) == [1.0, 1.0, 0.0]
    with pytest.raises(RewardError, match=r"needs an 'answer' column; columns given: \['level'\]"):
        score_rewards(make_reward("exact_match"), ["p"], ["x"], {"level": ["easy"]})
    with pytest.raises(RewardError) as e:
        make_reward("regex:(unclosed")
    assert "reward 'regex:(unclosed': the pattern does not compile" in _one_line(e)


def test_reasoning_gym_scores_its_own_answers():
    rows = reasoning_gym_rows("chain_sum", size=3, seed=0)
    prompts = [r["prompt"] for r in rows]
    columns = {k: [r[k] for r in rows] for k in rows[0] if k != "prompt"}
    fn = make_reward("reasoning_gym")
    right = [r["answer"] for r in rows]
    assert score_rewards(fn, prompts, right, columns).tolist() == [1.0, 1.0, 1.0]
    tagged = [f"thinking...<answer>{a}</answer>" for a in right]
    assert score_rewards(fn, prompts, tagged, columns).tolist() == [1.0, 1.0, 1.0]
    assert score_rewards(fn, prompts, ["none"] * 3, columns).tolist() == [0.0, 0.0, 0.0]
    # Rows exported elsewhere: the scorer found through metadata.source_dataset.
    exported = {"answer": columns["answer"], "metadata": columns["metadata"]}
    assert score_rewards(fn, prompts, right, exported).tolist() == [1.0, 1.0, 1.0]


def test_user_functions_from_a_module_and_a_file(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def length(prompts, completions, **columns):\n"
        "    return [len(c) / 10 for c in completions]\n"
        "def by_level(prompts, completions, level, **columns):\n"
        "    return [float(lv == 'easy') for lv in level]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = make_reward("my_rewards:by_level")
    assert score_rewards(fn, ["a", "b"], ["x", "y"], {"level": ["easy", "hard"]}).tolist() == [1.0, 0.0]
    fn = make_reward(f"{tmp_path}/my_rewards.py:length")
    np.testing.assert_array_equal(score_rewards(fn, ["a"], ["12345"], {}), np.float32([0.5]))
    for spec, message in [
        ("nonsense", "reward spec 'nonsense' is not one of: math_verify, reasoning_gym, exact_match"),
        ("no_such_module_xyz:f", "cannot import module 'no_such_module_xyz' (ModuleNotFoundError"),
        ("my_rewards:missing", "'my_rewards' has no function 'missing'; functions there: by_level, length"),
        (f"{tmp_path}/nope.py:f", "nope.py' does not exist"),
        ("", "reward spec '' is empty"),
    ]:
        with pytest.raises(RewardError) as e:
            make_reward(spec)
        assert message in _one_line(e), spec


def test_score_rewards_refuses_bad_rewards_with_the_row():
    prompts = ["first prompt", "second prompt " + "x" * 100, "third"]
    completions = ["a", "b", "c"]

    def raises_on_second(prompts, completions, **columns):
        return [1 / (not p.startswith("second")) for p in prompts]

    raises_on_second.reward_name = "mine"
    with pytest.raises(RewardError) as e:
        score_rewards(raises_on_second, prompts, completions)
    assert _one_line(e).startswith("reward 'mine' raised ZeroDivisionError: division by zero at row 1 "
                                   "(prompt 'second prompt xxx")
    with pytest.raises(RewardError, match="returned 2 values for 3 rows; expected 3"):
        score_rewards(lambda p, c, **k: [1.0, 0.0], prompts, completions)
    with pytest.raises(RewardError) as e:
        score_rewards(lambda p, c, **k: [0.0, 0.0, float("nan")], prompts, completions)
    assert "returned nan at row 2 (prompt 'third'); rewards must be finite" in _one_line(e)
    with pytest.raises(RewardError, match="returned None at row 0"):
        score_rewards(lambda p, c, **k: [None, 0.0, 0.0], prompts, completions)
    with pytest.raises(RewardError, match="3 prompts but 2 completions"):
        score_rewards(lambda p, c, **k: [0.0] * 3, prompts, completions[:2])


def test_out_of_range_warns_once_per_reward(monkeypatch):
    monkeypatch.setattr(rewards, "_RANGE_WARNED", set())

    def five(prompts, completions, **columns):
        return [5.0] * len(prompts)

    with pytest.warns(UserWarning, match=r"reward 'five' returned 5 at row 0, outside \[0, 1\]"):
        assert score_rewards(five, ["p"], ["c"]).tolist() == [5.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        score_rewards(five, ["p"], ["c"])  # warned once: silent now
        five_ok = lambda p, c, **k: [5.0]  # noqa: E731
        five_ok.reward_range = (0.0, 10.0)
        score_rewards(five_ok, ["p"], ["c"])  # inside its declared range
