"""jaxflow.rl.dataset_task: a Task over data rows - the seeded epoch stream resumes mid-epoch, the
reward gets each issued row's columns, chat-message prompts go through the template."""
import numpy as np
import pytest

from jaxflow.data.chat_template import ChatTemplate
from jaxflow.data.tokenizer import CharTokenizer
from jaxflow.errors import UserError
from jaxflow.rl.dataset_task import DatasetTask
from jaxflow.rl.tasks import Task

ROWS = [{"prompt": f"{i}+{i}=", "answer": str(2 * i), "level": i % 2} for i in range(5)]
TEMPLATE = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                        "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_epoch_stream_resumes_mid_epoch_and_scores():
    task = DatasetTask(ROWS, "exact_match", heldout=ROWS[:2], tokenizer=CharTokenizer())
    assert isinstance(task, Task)
    stream = task.prompts_at(0, 13, seed=7)
    assert task.prompts_at(0, 6, seed=7) + task.prompts_at(6, 7, seed=7) == stream  # resume at 6
    for epoch in range(2):  # every epoch is a permutation of the rows
        assert sorted(stream[5 * epoch:5 * epoch + 5]) == sorted(r["prompt"] for r in ROWS)
    assert stream == [ROWS[np.random.default_rng([7, p // 5]).permutation(5)[p % 5]]["prompt"] for p in range(13)]
    assert task.prompts_at(0, 5, seed=8) != stream[:5]
    rewards = task.score_batch(stream[:3], [str(2 * int(p.split("+")[0])) for p in stream[:3]],
                               np.zeros(3, bool))
    assert rewards.dtype == np.float32 and rewards.tolist() == [1.0, 1.0, 1.0]
    assert task.score("3+3=", " 6 ") == 1.0 and task.score("3+3=", "7") == 0.0
    drawn = task.prompts(np.random.default_rng(0), 4)
    assert len(drawn) == 4 and set(drawn) <= {r["prompt"] for r in ROWS}
    assert task.max_prompt_len == 4 and task.max_prompt_tokens == 4
    assert task.heldout_prompts(5) == task.heldout_prompts(5) and sorted(task.heldout_prompts(5)) == ["0+0=", "1+1="]
    with pytest.raises(UserError, match="never issued the prompt '9\\+9='"):
        task.score("9+9=", "18")


def test_columns_reach_the_reward_and_messages_use_the_template():
    rows = [{"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": f"q{i}"}],
             "reward_model": {"ground_truth": f"a{i}"}, "data_source": "mine", "extra": i} for i in range(3)]
    seen = {}

    def reward(prompts, completions, **columns):
        seen.update(columns)
        return [float(c == a) for c, a in zip(completions, columns["answer"])]

    task = DatasetTask(rows, reward, template=TEMPLATE)
    assert task.answer_key == "reward_model.ground_truth"
    prompts = task.prompts_at(0, 3, seed=0)
    assert sorted(prompts) == [f"<system>S<user>q{i}<assistant>" for i in range(3)]
    order = [int(p[-12]) for p in prompts]
    assert task.score_batch(prompts, [f"a{i}" for i in order], np.zeros(3, bool)).tolist() == [1.0] * 3
    assert seen["extra"] == order and seen["data_source"] == ["mine"] * 3
    assert seen["reward_model"] == [{"ground_truth": f"a{i}"} for i in order] and "prompt" not in seen
    with pytest.raises(UserError, match="row 0: the prompt is a list of chat messages and no chat template"):
        DatasetTask(rows, reward)
    string_task = DatasetTask(ROWS, "exact_match", template=TEMPLATE, system="Be brief")
    assert string_task.prompts_at(0, 1, seed=0)[0].startswith("<system>Be brief<user>")
    # A template that writes BOS (Llama-3): the trainer prepends the BOS id, so the text drops it.
    with_bos = ChatTemplate("{{ bos_token }}{{ messages[0].content }}", {"bos_token": "<s>"})
    assert DatasetTask(ROWS[:1], "exact_match", template=with_bos).prompts_at(0, 1, seed=0) == ["0+0="]
    kept = DatasetTask(ROWS[:1], "exact_match", template=with_bos, drop_template_bos=False)
    assert kept.prompts_at(0, 1, seed=0) == ["<s>0+0="]


def test_duplicate_prompts_latest_issuance_wins():
    rows = [{"prompt": "q", "answer": "1"}, {"prompt": "q", "answer": "2"}]
    task = DatasetTask(rows, "exact_match", heldout=[{"prompt": "q", "answer": "3"}])
    assert task.score("q", "3") == 1.0  # before any issuance: the last row of rows + heldout
    task.prompts_at(0, 2, seed=1)
    last = rows[int(np.random.default_rng([1, 0]).permutation(2)[1])]["answer"]
    assert task.score("q", last) == 1.0 and task.score("q", "3") == 0.0
    task.heldout_prompts(1)
    assert task.score("q", "3") == 1.0


def test_bad_rows_are_one_line():
    with pytest.raises(UserError, match="no training rows"):
        DatasetTask([], "exact_match")
    with pytest.raises(UserError, match=r"row 1 has no column 'prompt'; columns present: \['answer', 'question'\]"):
        DatasetTask([ROWS[0], {"question": "x", "answer": "1"}], "exact_match")
    with pytest.raises(UserError, match="row 0: prompt 3 is a int; valid: a string or a list"):
        DatasetTask([{"prompt": 3, "answer": "1"}], "exact_match")
    with pytest.raises(UserError, match="has no held-out rows; pass heldout="):
        DatasetTask(ROWS, "exact_match").heldout_prompts(2)
    with pytest.raises(UserError, match="not one of: math_verify"):
        DatasetTask(ROWS, "no-such-reward")
    with pytest.raises(UserError, match="reward 3 is neither a spec string nor a function"):
        DatasetTask(ROWS, 3)
