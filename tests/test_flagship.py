"""flagship: the sync ratio's accounting and config validation (the run itself is the main job)."""

from types import SimpleNamespace

import pytest

from configs.flagship import get_config
from jaxflow.config import apply_overrides
from jaxflow.main.flagship import pass_at_1_definition, sync_ratio_vs_dense


def _sync(*payloads, dense=1000):
    stats = [SimpleNamespace(stats=SimpleNamespace(dense_bytes=dense, payload_bytes=p))
             for p in payloads]
    return SimpleNamespace(records=stats)


def test_sync_ratio_counts_the_first_full_copy():
    # 3 publishes of 1000 dense bytes sent as 100, 50, 50, plus the initial full 1000-byte copy:
    # (1000 + 3 * 1000) / (1000 + 200)
    ratio, dense, sent = sync_ratio_vs_dense(_sync(100, 50, 50))
    assert (dense, sent) == (4000, 1200)
    assert ratio == pytest.approx(4000 / 1200)
    assert sync_ratio_vs_dense(_sync(1000, 1000))[0] == 1.0  # dense payloads: no saving
    assert sync_ratio_vs_dense(None)[1:] == (0, 0)


def test_quick_config_and_pass_at_1_definition():
    cfg = get_config("quick")
    assert cfg.rl.loss.correction == "sis" and cfg.rl.lag >= 2 and cfg.sync is not None
    assert cfg.devices >= 2 and not cfg.roles.colocate
    d = pass_at_1_definition(cfg)
    assert (d["temperature"], d["samples_per_prompt"], d["heldout_prompts"]) == (1.0, 4, 128)


def test_too_short_responses_are_an_error():
    with pytest.raises(ValueError, match="rl.max_new_tokens=20"):
        apply_overrides(get_config("quick"), ["rl.max_new_tokens=20"])
