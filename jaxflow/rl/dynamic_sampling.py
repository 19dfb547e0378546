"""DAPO's dynamic sampling (arXiv 2503.14476, section 3.2; verl's ``algorithm.filter_groups``).

A group whose G responses all have the same metric (all right or all wrong) has advantage 0
everywhere and gives no gradient. Dynamic sampling drops such groups and samples further
generation batches until enough groups with signal fill the rollout, then keeps the first
``num_groups`` of them (verl: ``batch[:train_batch_size * n]``). With a limit
(``max_num_gen_batches > 0``) running out of generation batches is an error, as in verl.

Host-side numpy on :class:`jaxflow.rl.rollout.RolloutBatch` rows (the G responses of a prompt
contiguous); the GRPO trainer supplies ``generate``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from jaxflow.rl.rollout import RolloutBatch


def groups_with_signal(values: np.ndarray, group_size: int) -> np.ndarray:
    """[B / group_size] bool: the groups whose ``values`` [B] are not all equal (population
    std > 0, as verl; a group of one always counts)."""
    values = np.asarray(values)
    if values.ndim != 1 or values.shape[0] % group_size:
        raise ValueError(f"values shape {values.shape} must be [B] with B a multiple of "
                         f"group_size={group_size}")
    groups = values.reshape(-1, group_size)
    return (np.std(groups, axis=1) > 0) | (group_size == 1)


def select_groups(batch: RolloutBatch, groups: np.ndarray, group_size: int) -> RolloutBatch:
    """The rows of the given group indices [k], in that order."""
    rows = (np.asarray(groups, np.int64)[:, None] * group_size
            + np.arange(group_size)[None]).reshape(-1)
    return RolloutBatch(*(np.asarray(x)[rows] for x in batch))


def concat_batches(batches: list[RolloutBatch]) -> RolloutBatch:
    return RolloutBatch(*(np.concatenate(xs, axis=0) for xs in zip(*batches)))


def fill_groups(generate: Callable[[int], tuple[RolloutBatch, np.ndarray]], *, num_groups: int,
                group_size: int, max_num_gen_batches: int) -> tuple[RolloutBatch, dict]:
    """Generation batches ``generate(0), generate(1), ...`` until ``num_groups`` groups with
    signal are collected; returns their first ``num_groups`` groups and statistics.

    Args:
      generate: ``i -> (batch, metric [B])`` for generation batch i (a whole number of groups).
      num_groups: groups the rollout needs (prompts per rollout).
      group_size: G.
      max_num_gen_batches: give up after this many generation batches (<= 0: no limit).

    Returns:
      ``(batch of num_groups * group_size rows, stats)`` with stats ``num_gen_batches``,
      ``groups_generated`` and ``groups_with_signal`` (counted over every generation batch).

    Raises:
      ValueError: the limit was reached with fewer than ``num_groups`` groups with signal.
    """
    kept: list[RolloutBatch] = []
    n_kept = n_generated = i = 0
    while n_kept < num_groups:
        if 0 < max_num_gen_batches <= i:
            raise ValueError(
                f"dynamic sampling (filter_groups) found {n_kept} of the {num_groups} groups a "
                f"rollout needs with non-identical rewards in {i} generation batches "
                f"(max_num_gen_batches={max_num_gen_batches}); raise max_num_gen_batches "
                "(0 = no limit), or check the task: most groups are all right or all wrong")
        batch, metric = generate(i)
        signal = np.flatnonzero(groups_with_signal(metric, group_size))
        n_generated += len(metric) // group_size
        if len(signal):
            kept.append(select_groups(batch, signal, group_size))
        n_kept += len(signal)
        i += 1
    batch = concat_batches(kept)
    batch = RolloutBatch(*(x[: num_groups * group_size] for x in batch))
    return batch, {"num_gen_batches": i, "groups_generated": n_generated,
                   "groups_with_signal": n_kept}
