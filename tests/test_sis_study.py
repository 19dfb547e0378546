"""sis_study: the paired-difference intervals on hand cases, and the study's grid as specified."""

import math

import numpy as np
import pytest

from jaxflow.rl.offpolicy_cells import grid_cells
from jaxflow.rl.offpolicy_report import paired_differences
from jaxflow.stats import normalized_auc, paired_interval


def test_paired_t_interval_hand_case():
    # d = [1, 2, 3, 4]: mean 2.5, sd sqrt(5/3) = 1.29099, t_{0.975, 3} = 3.18245 (t table)
    iv = paired_interval([1.5, 2.0, 3.25, 4.0], [0.5, 0.0, 0.25, 0.0])
    assert iv.n == 4 and iv.mean == pytest.approx(2.5)
    assert iv.sd == pytest.approx(math.sqrt(5 / 3))
    assert iv.half_width == pytest.approx(3.18245 * math.sqrt(5 / 3) / 2, rel=1e-5)
    assert 1.0 <= iv.boot_low < 2.5 < iv.boot_high <= 4.0  # bootstrap means lie in [min, max]
    assert iv.format() == "+2.500 +- 2.054 (n=4)"


def test_paired_interval_pairs_cancel_shared_seed_noise():
    rng = np.random.default_rng(0)
    seed_effect = rng.normal(0, 0.2, size=12)  # large, shared by both arms of a seed
    control = 0.5 + seed_effect
    treated = control + 0.05 + rng.normal(0, 0.01, size=12)
    iv = paired_interval(treated, control)
    assert iv.half_width < 0.01 < np.std(control)  # the pairing removes the seed spread
    assert iv.mean - iv.half_width < 0.05 + 0.01 and iv.mean + iv.half_width > 0.05 - 0.01


def test_paired_interval_edge_cases_and_errors():
    one = paired_interval([0.7], [0.5])
    assert one.mean == pytest.approx(0.2) and math.isnan(one.half_width) and one.n == 1
    with pytest.raises(ValueError, match="equal-length"):
        paired_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="level=1.5"):
        paired_interval([1.0, 2.0], [1.0, 1.0], level=1.5)


def test_normalized_auc_hand_cases():
    assert normalized_auc([(0, 0.0), (10, 1.0)]) == pytest.approx(0.5)
    # (5 * 0.5 + 10 * 0.7) / 15
    assert normalized_auc([(15, 0.8), (0, 0.4), (5, 0.6)]) == pytest.approx(9.5 / 15)
    assert normalized_auc([(3, 0.25)]) == 0.25


def _record(corr, seed, final, curve, algo="grpo", lag=8):
    return {"algo": algo, "correction": corr, "mismatch": "none", "lag": lag, "staleness": 0,
            "seed": seed, "final_accuracy": final, "curve": curve}


def test_paired_differences_pair_by_seed():
    recs = [_record("none", 0, 0.80, [(0, 0.4), (10, 0.80)]),
            _record("none", 1, 0.60, [(0, 0.4), (10, 0.60)]),
            _record("sis", 1, 0.70, [(0, 0.4), (10, 0.70)]),  # seed order differs on purpose
            _record("sis", 0, 0.84, [(0, 0.4), (10, 0.84)]),
            _record("sis", 2, 0.99, [(0, 0.4), (10, 0.99)]),  # no control with seed 2: unused
            _record("none", 0, 0.5, [(0, 0.4), (10, 0.5)], lag=1)]  # no sis at lag 1: no row
    (row,) = paired_differences(recs)
    assert (row["correction"], row["control"], row["lag"], row["pairs"]) == ("sis", "none", 8, 2)
    assert row["final_diff"] == pytest.approx(0.07)  # mean of +0.04 and +0.10
    # sd of (0.04, 0.10) = 0.0424264; t_{0.975, 1} = 12.7062
    assert row["final_half_width"] == pytest.approx(12.7062 * 0.0424264 / math.sqrt(2), rel=1e-4)
    assert row["auc_diff"] == pytest.approx(0.035)  # trapezoid: half of each final gap


def test_study_grid_is_the_specified_one():
    from configs import flagship
    from configs.sis_study import get_config
    from jaxflow.data.worked_addition import WorkedAdditionTask
    from jaxflow.rl.policy_loss import ALGOS

    default = get_config("default")
    assert isinstance(default.pretrain.data.make_corpus(), WorkedAdditionTask)
    assert default.pretrain == flagship.WARM_START and default.optim == flagship.Config().optim
    assert default.rl == flagship.Config().rl and default.sync is None
    cells = grid_cells(default.grid)
    keys = {(c.algo, c.correction, c.lag): set() for c in cells}
    for c in cells:
        keys[(c.algo, c.correction, c.lag)].add(c.seed)
    assert {c.mismatch for c in cells} == {"none"} and {c.staleness for c in cells} == {0}
    assert set(keys) == {(a, c, n) for a in ("grpo", "dapo") for c in ("none", "sis")
                         for n in (1, 8, 16)}
    lag8 = {len(s) for k, s in keys.items() if k[2] == 8}
    side = {len(s) for k, s in keys.items() if k[2] != 8}
    assert lag8 == {default.grid.seeds} and side == {default.grid.extra_lag_seeds}
    assert default.grid.extra_lag_seeds < default.grid.seeds

    full = get_config("full")
    fcells = grid_cells(full.grid)
    assert {c.algo for c in fcells} == set(ALGOS)
    mismatched = {(c.mismatch, c.correction) for c in fcells if c.mismatch != "none"}
    for m in ("bf16", "noise0.1", "noise0.3"):
        assert {(m, c) for c in ("none", "tis", "mis", "rs", "sis+tis", "sis")} <= mismatched

    quick = get_config("quick")
    assert len(grid_cells(quick.grid)) <= 4 and quick.train.rollouts <= 10
