"""Packer properties, over-budget errors, the pool under threads, the allocator's optimum."""

import random
import threading
import time

import numpy as np
import pytest

from jaxflow.flow.allocator import ParallelConfig, allocate, candidates
from jaxflow.flow.batching import PackingConfig, layout_rows, pooled_image_base
from jaxflow.flow.digits_data import DigitsConfig, step_samples
from jaxflow.flow.packing import ALGORITHMS, CostModel, OverBudgetError, pack, refine_lengths, split_over_budget
from jaxflow.flow.pool import EmbeddingPool


def _long_tailed(n, seed):
    rng = np.random.default_rng(seed)
    return np.minimum(8 + rng.pareto(1.5, n) * 30, 300).astype(int)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_sample_once_budget_respected_and_balanced_beats_first_fit(seed):
    lengths = _long_tailed(200, seed)
    costs = CostModel.for_width(64)(lengths)
    out = {a: pack(lengths, costs, 512, algorithm=a, bin_multiple=8) for a in ALGORITHMS}
    for algo, p in out.items():
        items = sorted(i for b in p.bins for i in b)
        assert items == list(range(len(lengths))), algo
        assert all(lengths[b].sum() <= 512 for b in p.bins if b), algo
        assert len(p.bins) % 8 == 0, algo
    assert out["lpt"].imbalance <= out["first_fit"].imbalance
    assert out["karmarkar_karp"].imbalance <= out["first_fit"].imbalance
    assert out["lpt"].imbalance < 1.1


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("algorithm", ["lpt", "karmarkar_karp"])
def test_length_refinement_keeps_items_budget_bins_and_cost_cap(seed, algorithm):
    lengths = _long_tailed(120, seed)
    costs = CostModel.for_width(64)(lengths)
    plain = pack(lengths, costs, 512, algorithm=algorithm, bin_multiple=8)
    refined = pack(lengths, costs, 512, algorithm=algorithm, bin_multiple=8, refine=True,
                   max_imbalance=1.05)
    assert sorted(i for b in refined.bins for i in b) == list(range(len(lengths)))
    assert len(refined.bins) == len(plain.bins)
    assert refined.bin_lengths.max() <= 512
    assert refined.bin_lengths.max() <= plain.bin_lengths.max()  # never longer rows
    assert refined.imbalance <= max(1.05, plain.imbalance) + 1e-9


def test_length_refinement_moves_and_respects_the_cost_cap_by_hand():
    # bins {6, 6} and {2}: moving a 6 across gives rows of 6 and 8 (max 12 -> 8) when costs allow
    got = refine_lengths([[0, 1], [2]], [1.0, 1.0, 1.0], [6, 6, 2], budget=16)
    assert sorted(map(sorted, got)) == [[0, 2], [1]] or sorted(map(sorted, got)) == [[0], [1, 2]]
    assert max(sum([6, 6, 2][i] for i in b) for b in got) == 8
    # the 2-token item is costly: every shortening move or swap would push a bin's cost over
    # max(1.05, 10 / 6) * mean = 10, so nothing changes
    got = refine_lengths([[0, 1], [2]], [1.0, 1.0, 10.0], [6, 6, 2], budget=16)
    assert [sorted(b) for b in got] == [[0, 1], [2]]


def test_over_budget_sample_is_an_error_naming_it_or_split_explicitly():
    with pytest.raises(OverBudgetError, match="sample 1 has 700 tokens > token budget 512"):
        pack([10, 700, 20], [1.0, 2.0, 3.0], 512)
    pieces = split_over_budget([10, 700], 512)
    assert pieces == [(0, 0, 10), (1, 0, 512), (1, 512, 700)]
    samples = step_samples(DigitsConfig(), seed=0, step=0, batch_size=16)
    budget = max(s.length for s in samples) - 3
    base, _ = pooled_image_base(samples)
    with pytest.raises(OverBudgetError):
        layout_rows(samples, "packed", base, packing=PackingConfig(token_budget=budget),
                    cost=CostModel(), row_multiple=2)
    split = layout_rows(samples, "packed", base,
                        packing=PackingConfig(token_budget=budget, over_budget="split"),
                        cost=CostModel(), row_multiple=2)
    assert split.rows["segment_ids"].astype(bool).sum() == sum(s.length for s in samples)
    assert (split.rows["loss_mask"].sum() == sum(s.loss_mask.sum() for s in samples))


def test_packed_rows_hold_every_token_and_image_slot_once():
    samples = step_samples(DigitsConfig(), seed=1, step=0, batch_size=24)
    base, offsets = pooled_image_base(samples)
    lay = layout_rows(samples, "packed", base, packing=PackingConfig(), cost=CostModel(),
                      row_multiple=4)
    idx = lay.rows["embed_index"]
    assert sorted(idx[idx >= 0].tolist()) == list(range(offsets[-1]))
    assert lay.rows["loss_mask"].sum() == sum(s.loss_mask.sum() for s in samples)
    assert lay.padding_waste < 0.25


@pytest.mark.parametrize("producer_delay,consumer_delay", [(0.0, 0.002), (0.002, 0.0)])
def test_pool_never_loses_or_duplicates_with_slow_or_fast_consumer(producer_delay,
                                                                   consumer_delay):
    pool = EmbeddingPool(capacity=5)
    keys = list(range(120))
    got, errors = [], []

    def produce():
        try:
            for k in keys:
                if producer_delay:
                    time.sleep(random.random() * producer_delay)
                pool.put(k, ("emb", k))
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=produce)
    t.start()
    rng = random.Random(0)
    for start in range(0, len(keys), 10):
        batch = keys[start:start + 10]
        rng.shuffle(batch)  # the consumer asks in its own order
        if consumer_delay:
            time.sleep(rng.random() * consumer_delay * 10)
        out = pool.take_many(batch, timeout=30)
        got += [(k, v) for k, v in out.items()]
    t.join(timeout=30)
    assert not errors
    assert sorted(k for k, _ in got) == keys
    assert all(v == ("emb", k) for k, v in got)
    assert len(pool) == 0 and pool.max_occupancy <= 5
    with pytest.raises(KeyError, match="already put"):
        pool.put(3, "again")


def test_allocator_finds_known_optimum_on_synthetic_profile():
    # Encoder 100 samples/s per device, backbone 25 (4x heavier), 10 devices: the balanced
    # split is 2 encoder + 8 backbone (200 vs 200 samples/s); tensor parallel costs 10%.
    enc, bb = candidates(10, range(1, 10), backbone_model_degrees=(1, 2))
    enc_prof = {c: 100.0 * c.devices for c in enc}
    bb_prof = {c: 25.0 * c.devices * (0.9 if c.model > 1 else 1.0) for c in bb}
    best = allocate(enc_prof, bb_prof, 10)
    assert best.encoder == ParallelConfig(2, 1) and best.backbone == ParallelConfig(8, 1)
    assert best.predicted_samples_per_s == 200.0
    # Brute force over every pair agrees.
    brute = max(min(enc_prof[e], bb_prof[b]) for e in enc for b in bb
                if e.devices + b.devices <= 10)
    assert brute == best.predicted_samples_per_s
    with pytest.raises(ValueError, match="fits 3 devices"):
        allocate({ParallelConfig(2): 1.0}, {ParallelConfig(2): 1.0}, 3)


def test_flowtrain_config_overrides_and_variants():
    from configs import flowtrain
    from jaxflow.config import ConfigError, apply_overrides

    cfg = apply_overrides(flowtrain.get_config("quick"), ["flow.run_ahead=1"])
    assert cfg.flow.run_ahead == 1 and cfg.mesh.shape == (-1,) and cfg.devices is None
    with pytest.raises((ConfigError, ValueError), match="block_steps"):
        apply_overrides(flowtrain.get_config("quick"), ["flow.run_ahead=2"])
    with pytest.raises(ValueError, match="unknown variant"):
        flowtrain.get_config("huge")
    with pytest.raises((ConfigError, ValueError)):
        apply_overrides(flowtrain.get_config("quick"), ["flow.run_ahead=-1"])
