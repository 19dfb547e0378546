"""flagship: the sync ratio's accounting and config validation (the run itself is the main job)."""

from types import SimpleNamespace

import pytest

from configs.flagship import get_config
from jaxflow.config import apply_overrides
from jaxflow.rl.flagship_study import HEADLINE_KEYS, pass_at_1_definition, summarize_seeds, sync_ratio_vs_dense
from jaxflow.study import seed_interval


def _sync(*payloads, dense=1000):
    """SyncRecord stand-ins, one per publish."""
    return [SimpleNamespace(stats=SimpleNamespace(dense_bytes=dense, payload_bytes=p))
            for p in payloads]


def test_sync_ratio_counts_the_first_full_copy():
    # 3 publishes of 1000 dense bytes sent as 100, 50, 50, plus the initial full 1000-byte copy:
    # (1000 + 3 * 1000) / (1000 + 200)
    ratio, dense, sent = sync_ratio_vs_dense(_sync(100, 50, 50))
    assert (dense, sent) == (4000, 1200)
    assert ratio == pytest.approx(4000 / 1200)
    assert sync_ratio_vs_dense(_sync(1000, 1000))[0] == 1.0  # dense payloads: no saving
    assert sync_ratio_vs_dense(None)[1:] == (0, 0)
    assert sync_ratio_vs_dense([])[1:] == (0, 0)  # sync on, nothing published yet


def test_quick_config_and_pass_at_1_definition():
    cfg = get_config("quick")
    assert cfg.rl.loss.correction == "sis" and cfg.rl.lag >= 2 and cfg.sync is not None
    assert cfg.devices >= 2 and not cfg.roles.colocate
    d = pass_at_1_definition(cfg)
    assert (d["temperature"], d["samples_per_prompt"], d["heldout_prompts"]) == (1.0, 4, 128)


def test_seed_interval_is_the_t_interval_of_the_mean():
    # 0.4, 0.5, 0.6: mean 0.5, sd 0.1, t_{0.975, 2} = 4.302653 -> half width 0.1 * t / sqrt(3)
    iv = seed_interval([0.4, 0.5, 0.6])
    assert iv["n"] == 3 and iv["mean"] == pytest.approx(0.5) and iv["sd"] == pytest.approx(0.1)
    assert iv["half_width"] == pytest.approx(0.1 * 4.302653 / 3 ** 0.5, rel=1e-6)
    assert (iv["low"], iv["high"]) == pytest.approx((0.5 - iv["half_width"],
                                                     0.5 + iv["half_width"]))
    one = seed_interval([0.457])
    assert one["mean"] == 0.457 and one["half_width"] is None and one["low"] is None
    with pytest.raises(ValueError, match="at least one"):
        seed_interval([])


def test_summary_over_seeds():
    runs = [{"heldout_pass_at_1_initial": a, "heldout_pass_at_1_final": b,
             "heldout_pass_at_1_gain": b - a, "sync_ratio_vs_dense": r}
            for a, b, r in [(0.45, 0.88, 6.0), (0.47, 0.90, 6.1), (0.46, 0.86, 6.2)]]
    head = summarize_seeds(runs)
    assert head["seeds"] == 3 and set(head["seed_interval"]) == set(HEADLINE_KEYS)
    assert head["heldout_pass_at_1_gain"] == pytest.approx((0.43 + 0.43 + 0.40) / 3)
    assert head["sync_ratio_vs_dense"] == pytest.approx(6.1)
    assert head["seed_interval"]["heldout_pass_at_1_final"]["half_width"] > 0
    # sync=none: no ratio and no interval for it; one seed: the values, no interval, said so
    nosync = summarize_seeds([dict(runs[0], sync_ratio_vs_dense=None)])
    assert nosync["sync_ratio_vs_dense"] is None
    assert "sync_ratio_vs_dense" not in nosync["seed_interval"]
    assert nosync["heldout_pass_at_1_final"] == 0.88 and "one seed" in nosync["seed_note"]
    assert nosync["seed_interval"]["heldout_pass_at_1_final"]["half_width"] is None


def test_variants_seeds():
    assert get_config("quick").seeds == 1  # CI's first command: one seed, ~1.5 min
    assert get_config("default").seeds >= 3
    with pytest.raises(ValueError, match="seeds=0"):
        apply_overrides(get_config("quick"), ["seeds=0"])


def test_too_short_responses_are_an_error():
    with pytest.raises(ValueError, match="rl.max_new_tokens=20"):
        apply_overrides(get_config("quick"), ["rl.max_new_tokens=20"])
