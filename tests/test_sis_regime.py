"""sis_regime: the regime test and the choice of comparison settings on hand-made records, the
grid as specified, and the 'accept rate SIS would have' diagnostic against SIS's own coin."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from configs.sis_regime import Config, RegimeGrid, get_config
from jaxflow.rl import sis_regime as regime
from jaxflow.rl.rollout import parse_mismatch


def _rec(cell, final, **extra):
    return {"label": cell.label, **cell._asdict(), "final_accuracy": final,
            "curve": [(0, 0.5), (30, final)], "auc": (0.5 + final) / 2, **extra}


def _records(config, finals: dict) -> dict[str, dict]:
    """finals: {(family, value): [final pass@1 per seed]} -> records by label."""
    out = {}
    for (fam, val), accs in finals.items():
        for seed, acc in enumerate(accs):
            cell = regime.regime_cell(config, fam, val, algo="grpo", correction="none", seed=seed)
            out[cell.label] = _rec(cell, acc, clip_fraction=0.01, d_original=0.02,
                                   sis_accept_expected=0.9)
    return out


def test_grid_covers_the_specified_knobs():
    config = get_config("default")
    grid = config.grid
    settings = regime.regime_settings(grid)
    assert settings[0] == ("lag", 1)
    assert {v for f, v in settings if f == "lag"} == {1, 2, 4, 8, 16, 32, 64}
    assert {tuple(v) for f, v in settings if f == "lr"} == {(s, n) for s in (3.0, 10.0)
                                                             for n in (1, 8)}
    assert max(v for f, v in settings if f == "staleness") == 8
    assert all(parse_mismatch(v)[0].startswith("bf16") for f, v in settings if f == "mismatch")
    # >= 16 rows per mini-batch: 16 x N rows beyond N = 16 (16 prompts x G 16 = 256 rows)
    assert [regime.lag_prompts(config, n) for n in (1, 16, 32, 64)] == [0, 0, 32, 64]
    for cell in regime.phase1_cells(config):
        rows = (cell.prompts or config.rl.prompts_per_rollout) * config.rl.group_size
        assert rows // cell.lag >= grid.min_minibatch_rows and cell.correction == "none"
    assert len(regime.phase1_cells(config)) == len(settings) * grid.seeds
    assert config.rl.sis_diagnostics
    quick = get_config("quick")
    assert len(regime.phase1_cells(quick)) <= 8 and quick.train.rollouts <= 10
    assert get_config("task2").pretrain.data.make_corpus().max_completion_len >= 40


def test_regime_needs_the_gap_and_an_interval_excluding_zero():
    config = get_config("default")
    finals = {("lag", 1): [0.90, 0.88, 0.89, 0.91],
              ("lag", 8): [0.85, 0.84, 0.86, 0.83],          # -0.05: not enough
              ("lag", 32): [0.70, 0.75, 0.72, 0.74],         # -0.17, tight: in
              ("staleness", 4): [0.60, 0.90, 0.55, 0.91],    # -0.16 but interval spans 0
              ("staleness", 8): [0.40, 0.45, 0.50, 0.42],    # in
              ("mismatch", "bf16"): [0.89, 0.88, 0.90, 0.90]}
    rows = {r["setting"]: r for r in regime.regime_rows(config, _records(config, finals))}
    assert set(rows) == {"N=1", "N=8", "N=32", "k=4", "k=8", "bf16"}  # missing cells skipped
    assert rows["N=32"]["diff"] == pytest.approx(np.mean([-0.20, -0.13, -0.17, -0.17]))
    assert [s for s, r in rows.items() if r["in_regime"]] == ["N=32", "k=8"]
    assert rows["k=4"]["diff"] < -0.10 and rows["k=4"]["diff"] + rows["k=4"]["half_width"] > 0
    config = dataclasses.replace(config, grid=dataclasses.replace(config.grid, compare_lag=0))
    chosen = regime.choose_settings(config, list(rows.values()))
    assert chosen["staleness"]["value"] == 8 and chosen["staleness"]["in_regime"]
    assert chosen["lag"]["value"] == 32
    # no mismatch setting reaches the regime: the most degraded one, marked as outside it
    assert chosen["mismatch"] == {"value": "bf16", "in_regime": False,
                                  "why": "no setting in the regime: the largest knob value"}
    assert "lr" not in chosen  # no lr rows at all
    fixed = dataclasses.replace(config, grid=dataclasses.replace(
        config.grid, compare_staleness=4, compare_mismatch="off", compare_lag=-1))
    chosen = regime.choose_settings(fixed, list(rows.values()))
    assert chosen == {"staleness": {"value": 4, "why": "configured", "in_regime": False}}


def test_lr_setting_counts_only_where_the_lag_is_what_hurts():
    config = get_config("default")
    base = [0.90, 0.88, 0.89, 0.91]
    finals = {("lag", 1): base,
              ("lr", (3.0, 1)): [0.89, 0.87, 0.88, 0.90],   # x3 alone: fine
              ("lr", (10.0, 1)): [0.2, 0.3, 0.1, 0.2],      # x10 alone blows up
              ("lr", (3.0, 8)): [0.6, 0.55, 0.58, 0.57],    # x3 with lag 8: in, lag's fault
              ("lr", (10.0, 8)): [0.0, 0.0, 0.01, 0.0]}     # in, but x10 alone is too
    rows = regime.regime_rows(config, _records(config, finals))
    chosen = regime.choose_settings(config, rows)
    assert chosen["lr"] == {"value": [3.0, 8], "in_regime": True,
                            "why": "smallest knob value in the regime"}
    cells = regime.phase2_cells(config, {"lr": chosen["lr"]})
    lr = [c for c in cells if c.lr_scale != 1.0]
    assert {(c.lag, c.lr_scale, c.correction) for c in lr} == {(8, 3.0, "none"), (8, 3.0, "sis")}
    # the phase-1 cells of that setting are among them (same labels: reused, not rerun)
    assert {c.label for c in regime.phase1_cells(config) if c.lr_scale == 3.0 and c.lag == 8
            } <= {c.label for c in lr}
    late = dataclasses.replace(config, grid=dataclasses.replace(config.grid, compare_lr="off"))
    assert "lr" not in regime.choose_settings(late, rows)


def test_phase2_cells_compare_only_none_and_sis_under_pure_lag():
    config = get_config("default")
    grid = config.grid
    chosen = {"staleness": {"value": 8}, "mismatch": {"value": "bf16+noise1"},
              "lag": {"value": 32}}
    cells = regime.phase2_cells(config, chosen)
    lag = [c for c in cells if c.lag == 32]
    assert {c.correction for c in lag} == {"none", "sis"} and {c.prompts for c in lag} == {32}
    stale = [c for c in cells if c.staleness == 8]
    assert {c.correction for c in stale} == set(grid.compare_corrections)
    assert {c.lag for c in stale} == {grid.compare_inner_lag}
    assert {c.seed for c in stale} == set(range(grid.compare_seeds)) and grid.compare_seeds >= 8
    assert {c.algo for c in cells if c.mismatch == "none"} == {"grpo", "dapo"}
    assert {c.algo for c in cells if c.mismatch != "none"} == set(grid.compare_mismatch_algos)
    base = [c for c in cells if c.lag == 1 and c.staleness == 0 and c.mismatch == "none"]
    assert {c.correction for c in base} == {"none"} and len(base) == 2 * grid.compare_seeds


def test_control_degradation_and_overheads_pair_by_seed():
    config = get_config("default")
    recs = []
    for seed, (b, n, s) in enumerate([(0.9, 0.7, 0.75), (0.8, 0.7, 0.8), (0.85, 0.6, 0.7)]):
        for fam, val, corr, acc, secs in (("lag", 1, "none", b, 1.0),
                                          ("staleness", 8, "none", n, 2.0),
                                          ("staleness", 8, "sis", s, 2.2)):
            cell = regime.regime_cell(config, fam, val, algo="grpo", correction=corr, seed=seed,
                                inner_lag=4)
            recs.append(_rec(cell, acc, rollout_seconds_median=secs))
    (deg,) = regime.control_degradation(recs)
    assert (deg["staleness"], deg["lag"], deg["pairs"]) == (8, 4, 3)
    assert deg["diff"] == pytest.approx(np.mean([-0.2, -0.1, -0.25]))
    (over,) = regime.overheads(recs)
    assert over["correction"] == "sis" and over["time_ratio_median"] == pytest.approx(1.1)


def test_bad_grids_name_the_value():
    with pytest.raises(ValueError, match="must contain 1"):
        RegimeGrid(lags=(2, 4))
    with pytest.raises(ValueError, match="need 'none'"):
        RegimeGrid(compare_corrections=("sis", "tis"))
    with pytest.raises(ValueError, match="unknown mismatch 'fp8'"):
        RegimeGrid(mismatches=("fp8",))
    with pytest.raises(ValueError, match="compare_seeds=2 < grid.seeds=4"):
        RegimeGrid(compare_seeds=2)
    with pytest.raises(ValueError, match="lag 3"):
        Config(grid=RegimeGrid(lags=(1, 3)))
    assert parse_mismatch("bf16+noise0.5") == ("bf16+noise", 0.5)
    with pytest.raises(ValueError, match="bf16\\+noise<std>"):
        parse_mismatch("bf16+noise0")


def _minibatch_and_stats(seed=0, b=8, p=5, n=4, topk=4):
    from jaxflow.mesh import role_meshes
    from jaxflow.models.transformer import TransformerConfig
    from jaxflow.rl.grpo import GRPOConfig
    from jaxflow.rl.grpo_step import MiniBatch, old_stats
    from jaxflow.rl.policy_loss import PolicyLossConfig
    from jaxflow.train.lm_state import init_params, lm_functions

    model = TransformerConfig(vocab_size=23, d_model=32, n_layers=1, n_heads=2, n_kv_heads=2,
                              d_ff=64, max_seq_len=16)
    cfg = GRPOConfig(prompts_per_rollout=2, group_size=4, max_new_tokens=n, sis_topk=topk,
                     loss=PolicyLossConfig(correction="sis"), sis_diagnostics=True)
    fns = lm_functions(model, role_meshes({"trainer": 1})["trainer"])
    params = init_params(fns, model, jax.random.key(seed))
    rng = np.random.default_rng(seed)
    mask = (np.arange(n)[None] < rng.integers(1, n + 1, size=(b, 1))).astype(np.float32)
    mb = MiniBatch(prompts=jnp.asarray(rng.integers(3, 23, size=(b, p)), jnp.int32),
                   prompt_lengths=jnp.asarray(rng.integers(2, p + 1, size=b), jnp.int32),
                   tokens=jnp.asarray(rng.integers(3, 23, size=(b, n)), jnp.int32),
                   mask=jnp.asarray(mask), behaviour_logp=jnp.zeros((b, n), jnp.float32),
                   advantages=jnp.asarray(rng.normal(size=b), jnp.float32))
    old = jax.jit(functools.partial(old_stats, fns, config=cfg))(params, None, mb)
    return fns, cfg, params, mb, old


def test_expected_accept_rate_is_the_mean_of_sis_coin():
    # min(1, w / M) per token (the diagnostic) equals SIS's own accept test averaged over a
    # grid of uniforms u_j = (j + 1/2) / J (exact up to 1/J per token)
    from jaxflow.rl.grpo_step import _expected_sis_accept, response_hidden
    from jaxflow.rl.logprobs import fused_logprobs
    from jaxflow.rl.masks import as_bool_mask
    from jaxflow.rl.policy_loss import policy_loss

    fns, cfg, params, mb, old = _minibatch_and_stats()
    new = jax.tree.map(lambda x: x * 1.2, params)  # a policy that moved
    hidden, head = response_hidden(fns, new, mb.prompts, mb.prompt_lengths, mb.tokens)
    given = as_bool_mask(mb.mask)
    expected = float(_expected_sis_accept(hidden, head, mb, old, cfg, given))
    out = fused_logprobs(hidden, head, mb.tokens, old.topk_indices, temperature=1.0)
    grid = 200

    def rate(u):
        return policy_loss(out.target_logp, old.logp, mb.advantages, mb.mask, config=cfg.loss,
                           old_topk_logp=old.topk_logp, new_topk_logp=out.topk_logp,
                           uniforms=jnp.full(mb.tokens.shape, u))[1]["accept_rate"]

    rates = jax.jit(jax.vmap(rate))((jnp.arange(grid) + 0.5) / grid)
    assert 0.2 < expected < 0.99  # the policies differ and SIS would reject some tokens
    assert abs(np.mean(rates) - expected) <= 1.0 / grid


def test_the_diagnostic_does_not_change_the_gradient():
    from jaxflow.rl.grpo import grpo_loss

    fns, cfg, params, mb, old = _minibatch_and_stats(seed=1)
    new = jax.tree.map(lambda x: x * 1.2, params)
    plain = dataclasses.replace(cfg, sis_diagnostics=False)

    def grad(c):
        return jax.jit(jax.grad(lambda p: grpo_loss(p, mb, old, fns=fns, config=c,
                                                    key=jax.random.key(0))[0]))(new)

    for a, b in zip(jax.tree.leaves(grad(cfg)), jax.tree.leaves(grad(plain))):
        np.testing.assert_array_equal(a, b)
