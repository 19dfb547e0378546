"""The work every arm of a ``bench_peers`` case does, written once as raw array files so that
each arm (jaxflow's and the peers', in their own interpreters) reads the same numbers.

Embedding case: ``tables`` tables of ``rows`` x ``dim`` (sum-pooled bags of exactly ``bag`` ids
per sample and table), ``num_batches`` batches of ``batch`` samples cycled through, loss
``sum_t sum((pooled_t - target_t)^2) / batch`` (``jaxflow.embeddings.bench.regression_loss``),
row-wise Adagrad or SGD on the touched rows. Arrays: ``ids_<k>`` int32[tables, batch, bag]
(Zipf-distributed, as recommendation ids are), ``targets_<k>`` f32[tables, batch, dim],
``tables`` f32[tables, rows, dim] (the initial weights, N(0, 0.01)).

Generation case: a random Llama checkpoint in Hugging Face's format (both arms load it with their
own loaders; RoPE theta 1e6, the value tunix 0.1.7's Llama3 always uses), ``sequences`` prompts
of exactly ``prompt_len`` tokens (ids in [1, vocab - 1): 0 is the pad and the last id the
stop token no arm may emit), ``max_new`` greedy tokens each, every sequence the same length;
``probe`` int32[2, prompt_len]: the tokens whose logits each arm writes before timing.
GRPO groups (``group_size`` G > 1): ``sequences / G`` distinct prompts, each sampled G times at
temperature 1 (``sampled``), the stop token forbidden so every sequence is ``max_new`` tokens.
"""

from __future__ import annotations

import os

import numpy as np

__all__ = ["write_array", "read_array", "embedding_case", "unique_ids_bound", "generation_case", "long_tail_lengths"]

EMBEDDING_OPTIMIZERS = ("rowwise_adagrad", "sgd")


def write_array(directory: str, name: str, array: np.ndarray) -> dict:
    """Writes ``array`` as a raw little-endian file ``<directory>/<name>.bin``; returns the
    ``{"path", "dtype", "shape"}`` spec an arm reads it with."""
    array = np.ascontiguousarray(array)
    path = os.path.join(directory, f"{name}.bin")
    array.astype(array.dtype.newbyteorder("<"), copy=False).tofile(path)
    return {"path": path, "dtype": array.dtype.name, "shape": list(array.shape)}


def read_array(spec: dict) -> np.ndarray:
    """The array of a spec written by :func:`write_array`."""
    return np.fromfile(spec["path"], dtype=np.dtype(spec["dtype"]).newbyteorder("<")).reshape(spec["shape"])


def unique_ids_bound(ids: np.ndarray) -> int:
    """The most distinct (table, id) keys any one batch of ``ids`` int32[tables, batch, bag] has."""
    return int(sum(np.unique(t).size for t in ids))


def embedding_case(directory: str, *, tables: int, rows: int, dim: int, batch: int, bag: int,
                   optimizer: str, learning_rate: float, num_batches: int, warmup: int, seed: int = 0,
                   zipf_a: float = 1.1, eps: float = 1e-8) -> dict:
    """Writes the embedding case's arrays under ``directory`` and returns its JSON case (shapes,
    optimizer, array specs, ``max_unique``: the most distinct keys of any batch, the jaxflow arm's
    exact capacity). The other optimizer's case is ``dict(case, optimizer=...)`` on the same files."""
    if optimizer not in EMBEDDING_OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}; valid: {', '.join(EMBEDDING_OPTIMIZERS)}")
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    arrays, max_unique = {}, 0
    for k in range(num_batches):
        # Zipf ranks mapped through a fixed random permutation per table: hot rows are spread out
        ranks = (rng.zipf(zipf_a, size=(tables, batch, bag)) - 1) % rows
        perm = np.stack([np.random.default_rng([seed, t]).permutation(rows) for t in range(tables)])
        ids = np.take_along_axis(perm, ranks.reshape(tables, -1), axis=1).reshape(tables, batch, bag)
        ids = ids.astype(np.int32)
        max_unique = max(max_unique, unique_ids_bound(ids))
        arrays[f"ids_{k}"] = write_array(directory, f"ids_{k}", ids)
        arrays[f"targets_{k}"] = write_array(directory, f"targets_{k}",
                                             rng.standard_normal((tables, batch, dim), dtype=np.float32))
    init = np.random.default_rng([seed, 0x7AB1E]).normal(0.0, 0.01, (tables, rows, dim)).astype(np.float32)
    arrays["tables"] = write_array(directory, "tables", init)
    return {"kind": "embedding", "tables": tables, "rows": rows, "dim": dim, "batch": batch, "bag": bag,
            "optimizer": optimizer, "learning_rate": learning_rate, "eps": eps, "num_batches": num_batches,
            "warmup": warmup, "max_unique": max_unique, "arrays": arrays}


def long_tail_lengths(sequences: int, max_new: int, seed: int, median_frac: float = 0.25,
                      sigma: float = 1.0) -> np.ndarray:
    """int32[sequences] output lengths in [1, max_new]: lognormal, median ``median_frac * max_new``,
    log-std ``sigma``, the mass above the cap at the cap (as ``bench_rollout``'s long tail)."""
    rng = np.random.default_rng([seed, 0x7A11])
    raw = rng.lognormal(np.log(median_frac * max_new), sigma, sequences)
    return np.clip(np.rint(raw), 1, max_new).astype(np.int32)


def generation_case(directory: str, *, vocab: int, d_model: int, layers: int, heads: int, kv_heads: int,
                    d_ff: int, sequences: int, prompt_len: int, max_new: int, page_size: int, warmup: int,
                    seed: int = 0, long_tail: bool = False, group_size: int = 1) -> dict:
    """Writes the generation case's checkpoint and arrays under ``directory`` and returns its JSON
    case (the model's shape, ``checkpoint``, ``prompts`` int32[sequences, prompt_len], ``probe``,
    ``max_new``, ``page_size``, ``eos``: the stop id). Equal lengths: ``lengths`` is None and no
    arm may emit ``eos``, so every sequence is ``max_new`` tokens. ``long_tail``: ``lengths``
    (:func:`long_tail_lengths`) and each prompt's first token is its sequence's length, from
    which every arm forces ``eos`` as token ``length - 1`` and forbids it before (so every arm
    generates the same lengths, EOS included); ValueError when ``vocab <= max_new + 1``.
    ``group_size`` G > 1 (GRPO groups, equal lengths only): ``prompts`` int32[sequences / G,
    prompt_len], each sampled G times at temperature 1 (``sampled``: True); ValueError when G
    does not divide ``sequences``."""
    if group_size < 1 or sequences % group_size or (group_size > 1 and long_tail):
        raise ValueError(f"group_size={group_size} with sequences={sequences}, long_tail={long_tail}; valid: "
                         "G >= 1 dividing sequences, and G = 1 with long tails")
    if long_tail and vocab <= max_new + 1:
        raise ValueError(f"vocab={vocab} with max_new={max_new}: a long-tailed case writes each length as a "
                         f"token id; valid: vocab > max_new + 1")
    from jaxflow.models.hf_save import write_random_checkpoint
    from jaxflow.models.transformer_config import TransformerConfig

    os.makedirs(directory, exist_ok=True)
    config = TransformerConfig(vocab_size=vocab, d_model=d_model, n_layers=layers, n_heads=heads,
                               n_kv_heads=kv_heads, d_ff=d_ff, max_seq_len=prompt_len + max_new,
                               rope_theta=1e6, norm_eps=1e-5, architecture="llama")
    checkpoint = os.path.join(directory, "checkpoint")
    write_random_checkpoint(config, checkpoint, seed=seed)
    rng = np.random.default_rng([seed, 0x6E4])
    prompts = rng.integers(1, vocab - 1, (sequences // group_size, prompt_len), dtype=np.int32)
    probe = rng.integers(1, vocab - 1, (2, prompt_len), dtype=np.int32)
    lengths = long_tail_lengths(sequences, max_new, seed) if long_tail else None
    if lengths is not None:
        prompts[:, 0] = lengths
    return {"kind": "generation", "checkpoint": checkpoint, "vocab": vocab, "d_model": d_model, "layers": layers,
            "heads": heads, "kv_heads": kv_heads, "head_dim": d_model // heads, "d_ff": d_ff, "rope_theta": 1e6,
            "norm_eps": 1e-5, "sequences": sequences, "prompt_len": prompt_len, "max_new": max_new,
            "page_size": page_size, "eos": vocab - 1, "warmup": warmup, "group_size": group_size,
            "sampled": group_size > 1,
            "lengths": None if lengths is None else lengths.tolist(),
            "arrays": {"prompts": write_array(directory, "prompts", prompts),
                       "probe": write_array(directory, "probe", probe)}}
