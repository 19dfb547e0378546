"""jaxflow.data.sources: the same rows from .jsonl / .json / .csv / .parquet / a save_to_disk
directory, verl's nested layout, reasoning-gym rows, and one-line errors naming file, line, key."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxflow.data.sources import (
    DataSourceError,
    find_answer_key,
    get_column,
    heldout_split,
    load_rows,
    reasoning_gym_rows,
)
from jaxflow.errors import UserError

ROWS = [{"prompt": "1+1=", "answer": "2", "level": "easy"},
        {"prompt": "say \"hi\",\nplease", "answer": "hi", "level": "hard"}]


def _one_line(e):
    assert isinstance(e.value, UserError) and "\n" not in str(e.value)
    return str(e.value)


def test_every_format_gives_the_same_rows(tmp_path):
    import datasets

    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    (tmp_path / "d.json").write_text(json.dumps(ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "d.parquet")
    with open(tmp_path / "d.csv", "w", newline="") as f:
        import csv

        writer = csv.DictWriter(f, fieldnames=list(ROWS[0]))
        writer.writeheader()
        writer.writerows(ROWS)
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "ds"))
    for name in ("d.jsonl", "d.json", "d.parquet", "d.csv", "ds"):
        assert load_rows(tmp_path / name, answer_key="answer") == ROWS, name
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS)}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataSourceError, match=r"holds the splits \['train'\]; point at one of them"):
        load_rows(tmp_path / "dd")
    assert load_rows(tmp_path / "dd" / "train") == ROWS


def test_verl_layout_nested_answer_and_message_prompts(tmp_path):
    rows = [{"data_source": "gsm8k", "prompt": [{"role": "user", "content": "2*3?"}],
             "reward_model": {"style": "rule", "ground_truth": "6"}, "extra_info": {"index": 0}}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "verl.parquet")
    loaded = load_rows(tmp_path / "verl.parquet", answer_key="reward_model.ground_truth")
    assert loaded == rows
    assert find_answer_key(loaded) == "reward_model.ground_truth"
    assert find_answer_key(ROWS) == "answer"
    assert get_column(loaded[0], "reward_model.ground_truth") == "6"
    with pytest.raises(KeyError):
        get_column(loaded[0], "reward_model.missing")


def test_errors_name_file_line_key_and_columns(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": \n')
    with pytest.raises(DataSourceError) as e:
        load_rows(bad)
    assert _one_line(e).startswith(f"{bad}:2: not valid JSON")
    (tmp_path / "list.jsonl").write_text('{"prompt": "a"}\n[1, 2]\n')
    with pytest.raises(DataSourceError, match=r"list.jsonl:2: a JSON list, not an object"):
        load_rows(tmp_path / "list.jsonl")
    with pytest.raises(DataSourceError, match="does not exist"):
        load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "d.txt").write_text("x")
    with pytest.raises(DataSourceError, match=r"unknown suffix '.txt'; valid: .jsonl, .json, .parquet, .csv"):
        load_rows(tmp_path / "d.txt")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(DataSourceError, match="bad.parquet' is not a readable parquet file: ArrowInvalid"):
        load_rows(tmp_path / "bad.parquet")
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(DataSourceError, match="has no rows"):
        load_rows(tmp_path / "empty.csv")
    (tmp_path / "d.json").write_text(json.dumps({"prompt": ["a"]}))
    with pytest.raises(DataSourceError, match="holds a JSON dict; valid: a list of objects"):
        load_rows(tmp_path / "d.json")
    (tmp_path / "q.jsonl").write_text('{"question": "a", "solution": "1"}\n')
    with pytest.raises(DataSourceError) as e:
        load_rows(tmp_path / "q.jsonl")
    assert "row 0 has no column 'prompt'; columns present: ['question', 'solution']" in _one_line(e)
    with pytest.raises(DataSourceError, match="no column 'answer'; columns present: \\['question', 'solution'\\]"):
        load_rows(tmp_path / "q.jsonl", prompt_key="question", answer_key="answer")
    assert load_rows(tmp_path / "q.jsonl", prompt_key="question", answer_key="solution") == [
        {"question": "a", "solution": "1"}]


def test_heldout_split_is_seeded_and_disjoint():
    rows = [{"prompt": str(i)} for i in range(10)]
    train, held = heldout_split(rows, 3, seed=5)
    assert len(held) == 3 and len(train) == 7
    assert sorted(r["prompt"] for r in train + held) == sorted(r["prompt"] for r in rows)
    assert heldout_split(rows, 3, seed=5) == (train, held) != heldout_split(rows, 3, seed=6)
    with pytest.raises(UserError, match=r"held-out size 10 is not in \[1, 9\] for 10 rows"):
        heldout_split(rows, 10)


def test_reasoning_gym_rows():
    rows = reasoning_gym_rows("chain_sum", size=4, seed=3)
    assert len(rows) == 4 and rows == reasoning_gym_rows("chain_sum", size=4, seed=3)
    assert rows[0]["prompt"] == rows[0]["question"] and rows[0]["prompt"].endswith("=")
    assert json.loads(rows[0]["metadata"])["source_dataset"] == "chain_sum"
    assert {r["_rg_index"] for r in rows} == {0, 1, 2, 3}
    assert rows != reasoning_gym_rows("chain_sum", size=4, seed=4)
    with pytest.raises(DataSourceError) as e:
        reasoning_gym_rows("chain_summ", size=4, seed=0)
    assert "no dataset 'chain_summ'; valid names include ab, acre" in _one_line(e)
    with pytest.raises(DataSourceError, match="size 0 is not an integer >= 1"):
        reasoning_gym_rows("chain_sum", size=0, seed=0)
