"""Each system as 2 real processes x 4 devices == 1 process x 8 devices (the same global mesh),
on tiny shapes. Bit-identical where the figure is; where a cross-process all-reduce (gloo) sums
in another order than the in-process one, within float32 rounding (stated per figure)."""

import pytest

from tests._multiprocess import single_and_two_processes


def _rows(rows, key):
    return [(r["step"], r[key]) for r in rows if key in r]


@pytest.mark.multiprocess
def test_dlrm_train_two_processes_equal_one(tmp_path):
    args = ["--exp=dlrm_train", "--variant=quick", "--set", "train.steps=4",
            "--set", "train.log_every=2", "--set", "train.checkpoint_every=2",
            "--set", "train.eval_batches=1", "--set", "train.batch_size=128"]
    (s1, m1), (s2, m2) = single_and_two_processes(args, tmp_path)
    assert _rows(m1, "train_loss") == _rows(m2, "train_loss") != []  # bit-identical
    assert s1["auc"] == s2["auc"] and s1["oracle_auc"] == s2["oracle_auc"]
    # eval log-loss: the same ranking (AUC equal) and probabilities within f32 rounding
    assert s2["logloss"] == pytest.approx(s1["logloss"], rel=1e-6)
    assert s1["placements"] == s2["placements"]
