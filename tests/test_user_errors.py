"""One user-error type and one boundary: every user error class is a ``UserError``; the runner
turns one raised anywhere (config build, inside an experiment) into exit 2 and one line; config
values with a known range are refused when the config is built (so ``--dry-run`` catches them);
text readers decode UTF-8 (a byte-order mark dropped) and name the file and line otherwise;
ids are checked for sign and range against the int32 rows they index."""

import os

import numpy as np
import pytest

from jaxflow import run as runner
from jaxflow.errors import DataError, FileFormatError, UserError, read_text, text_lines
from jaxflow.recsys.readers import read_atomic_file, read_criteo_tsv, read_movielens
from tests._cli import one_line_error


def test_every_user_error_class_is_a_user_error_and_keeps_its_builtin_base():
    from jaxflow.checkpoint import CheckpointError as RunCheckpointError
    from jaxflow.compile_only.target import TargetError
    from jaxflow.config import ConfigError
    from jaxflow.experiment import MissingExtraError
    from jaxflow.mesh import MeshError
    from jaxflow.models.architectures import CheckpointError as HFCheckpointError
    from jaxflow.prune.task_files import TaskFileError
    from jaxflow.run import UsageError

    for cls, builtin in ((ConfigError, ValueError), (MeshError, ValueError),
                         (RunCheckpointError, RuntimeError), (HFCheckpointError, ValueError),
                         (MissingExtraError, RuntimeError), (TaskFileError, ValueError),
                         (TargetError, ValueError), (FileFormatError, ValueError),
                         (DataError, ValueError), (UsageError, Exception)):
        assert issubclass(cls, UserError) and issubclass(cls, builtin), cls


# ---- config values with a known range, at config build time ---------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["--exp=lm_pretrain", "--set", "seed=12345678901234567890123"], "0..4294967295"),
    (["--exp=lm_pretrain", "--set", "seed=-1"], "unsigned 32-bit"),
    (["--exp=lm_pretrain", "--set", "data.max_digits=100"], "max_digits=100; valid: 1..9"),
    (["--exp=lm_pretrain", "--set", "data.heldout_mod=0"], "heldout_mod=0; valid: >= 2"),
    (["--exp=flowtrain", "--set", "data.heldout_mod=1"], "heldout_mod=1; valid: an int >= 2"),
    (["--exp=flexmarl", "--set", "max_digits=12"], "max_digits=12; valid: 1..9"),
    (["--exp=dlrm_train", "--set", "data.source=movielens"], "needs data.path=<file>"),
])
def test_out_of_range_config_values_are_caught_by_dry_run(capsys, argv, expected):
    err = one_line_error(capsys, [*argv, "--variant=quick", "--dry-run"])
    assert expected in err, err


# ---- text readers ---------------------------------------------------------------------------

def test_text_lines_drop_a_byte_order_mark_and_name_the_line_of_bad_bytes(tmp_path):
    good = tmp_path / "good.txt"
    good.write_bytes(b"\xef\xbb\xbfhello\nw\xc3\xb6rld\n")
    assert [line for _, line in text_lines(good)] == ["hello\n", "w\u00f6rld\n"]
    assert read_text(good) == "hello\nw\u00f6rld\n"
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\nlatin-1 \xe9t\xe9\n")
    with pytest.raises(FileFormatError, match=r"bad.txt' line 2 is not UTF-8 .*0xe9 at column 9"):
        list(text_lines(bad))
    with pytest.raises(FileFormatError, match="offset 11"):
        read_text(bad)
    with pytest.raises(FileFormatError, match="does not exist"):
        read_text(tmp_path / "missing.txt")


def test_movielens_reader_handles_bom_and_refuses_other_encodings(tmp_path):
    f = tmp_path / "ratings.dat"
    f.write_bytes(b"\xef\xbb\xbf1::10::4::100\n2::20::3::200\n")
    r = read_movielens(f)
    np.testing.assert_array_equal(r["user"], [1, 2])
    f.write_bytes(b"1::10::4::100\n2::20::3::200 \xff\n")
    with pytest.raises(FileFormatError, match=r"ratings.dat' line 2 is not UTF-8"):
        read_movielens(f)


@pytest.mark.parametrize("line, expected", [
    (b"-3::10::4::100\n", r"user id -3 \(rating 2\) is out of range; valid: 0..2147483647"),
    (b"1::2147483653::4::100\n", r"item id 2147483653 \(rating 2\) is out of range"),
    (b"1::10::4\n", r"ratings.dat:2: 3 fields"),
    (b"1::ten::4::100\n", r"ratings.dat:2: cannot parse"),
])
def test_movielens_ids_are_checked_for_sign_and_int32_range(tmp_path, line, expected):
    f = tmp_path / "ratings.dat"
    f.write_bytes(b"5::6::4::100\n" + line)
    with pytest.raises((DataError, FileFormatError), match=expected):
        read_movielens(f)


def test_criteo_and_atomic_readers_name_the_file(tmp_path):
    f = tmp_path / "day.tsv"
    f.write_bytes(b"1" + b"\t" * 14 + b"\t".join([b"ab"] * 26) + b"\n" + b"x" * 3 + b"\n")
    with pytest.raises(FileFormatError, match=r"day.tsv:2: 1 tab-separated fields"):
        read_criteo_tsv(f, (10,) * 26)
    f.write_bytes(b"z" + b"\t" * 14 + b"\t".join([b"ab"] * 26) + b"\n")
    with pytest.raises(FileFormatError, match=r"day.tsv:1: cannot parse"):
        read_criteo_tsv(f, (10,) * 26)
    inter = tmp_path / "ml.inter"
    inter.write_bytes(b"\xef\xbb\xbfuser_id:token\titem_id:token\n1\t2\n")
    assert read_atomic_file(inter) == {"user_id": ["1"], "item_id": ["2"]}
    inter.write_bytes(b"user_id:token\titem_id:token\n1\t\xe9\n")
    with pytest.raises(FileFormatError, match="is not utf-8-sig text"):
        read_atomic_file(inter)


def test_task_files_with_a_bom_load_and_latin_1_is_named(tmp_path):
    from jaxflow.prune.task_files import TaskFileError, load_task_files

    f = tmp_path / "facts.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "2+2=", "answer": "4"}\n')
    assert load_task_files([str(f)])["facts"][0].answer == "4"
    f.write_bytes('{"prompt": "caf\u00e9", "answer": "x"}\n'.encode("latin-1"))
    with pytest.raises(TaskFileError, match=r"facts.jsonl' line 1 is not UTF-8"):
        load_task_files([str(f)])


# ---- the boundary: a user error inside an experiment ----------------------------------------

def test_a_ratings_file_error_inside_dlrm_train_is_exit_2_and_rolls_back(capsys, tmp_path):
    ratings = tmp_path / "ratings.dat"
    ratings.write_text("1::10::4::100\n2::20::3\n")  # the second rating lacks its timestamp
    out = tmp_path / "run"
    err = one_line_error(capsys, ["--exp=dlrm_train", "--variant=quick", f"--out={out}",
                                  "--set", "data.source=movielens", "--set",
                                  f"data.path={ratings}"])
    assert "ratings.dat:2: 3 fields" in err, err
    assert not out.exists()  # the fresh run's config.json went with it


def test_an_unexpected_error_inside_an_experiment_still_raises(tmp_path, monkeypatch):
    """Only user errors become exit 2: a bug stays a traceback (the boundary hides nothing)."""
    from jaxflow.config import ExperimentSpec

    def entry(config, run):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(ExperimentSpec, "entry_fn", lambda self: entry)
    with pytest.raises(ZeroDivisionError):
        runner.main(["--exp=lm_pretrain", "--variant=quick", f"--out={tmp_path / 'run'}"])
    assert os.path.isdir(tmp_path / "run")  # kept for the post-mortem
