"""What the engine hands back per request: :class:`RequestOutput` / :class:`EngineOutput`, and the
MoE routing record (R3) the host collects for them (:class:`RoutingRecord`).

R3 (routing replay for MoE RL) replays, in the trainer's forward, the experts the rollout engine
chose. With ``EngineConfig.record_routing`` the engine's programs return each MoE layer's
experts and gates at every position they feed (:func:`jaxflow.rollout.model_step.make_steps`):
the prefill at the prompt's first ``L - 1`` positions, once per group, and each decode step at
the position it feeds (step t feeds the prompt's last token for t = 0, token t - 1 after). This
module puts them where the static sampler's record has them
(:class:`jaxflow.models.sampler.SampleOutput`): position p of ``prompt ++ tokens``, so a
sequence of prompt length L that drew m tokens holds positions 0 .. L + m - 2 (the positions
the trainer's forward feeds real tokens); later positions hold 0 (nothing was fed there).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from jaxflow.config import ConfigError
from jaxflow.models.moe import expert_index_dtype

__all__ = ["EngineOutput", "RequestOutput", "RoutingRecord"]


class RequestOutput(NamedTuple):
    """One request's G sequences (host arrays), N = the request's max_new_tokens.

    tokens [G, N] int32 (pad_id after EOS); logprobs [G, N] f32 of the distribution sampled from
    (0 where masked); mask [G, N] f32 (1 up to and including EOS); lengths [G] int32;
    versions [G, N] int32 (the weights version that drew each token, -1 where masked);
    topk_logprobs [G, N, K] f32 and topk_indices [G, N, K] int32 (the model's top-K under
    log_softmax of the raw logits, temperature 1; 0 where masked); routing_experts
    [G, S, L, k] (:func:`jaxflow.models.moe.expert_index_dtype`) and routing_gates [G, S, L, k]
    f32, S = max_seq_len - 1: each MoE layer's experts and gates at each position of
    ``prompt ++ tokens`` (``EngineConfig.record_routing``, :class:`RoutingRecord`; else
    [G, 0, 0, 0]).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    mask: np.ndarray
    lengths: np.ndarray
    versions: np.ndarray
    topk_logprobs: np.ndarray
    topk_indices: np.ndarray
    routing_experts: np.ndarray
    routing_gates: np.ndarray


class EngineOutput(RequestOutput):
    """:meth:`jaxflow.rollout.RolloutEngine.generate`'s rows: request i's sequence g at row
    i * G + g (fields as :class:`RequestOutput`, leading axis R * G; N = max_new_tokens)."""


class RoutingRecord:
    """Host collector of the engine's routing record (module docstring); with ``on`` False
    every method is a no-op and :meth:`arrays` gives empty records.

    Args:
      model: the engine's TransformerConfig (its MoE layers, top-k, expert count).
      max_seq_len: the engine's longest sequence; records are ``max_seq_len - 1`` positions.
      on: ``EngineConfig.record_routing``; True needs an MoE model.
    """

    def __init__(self, model, max_seq_len: int, *, on: bool):
        self.on = bool(on)
        self.layers = sum(model.is_moe_layer(i) for i in range(model.n_layers))
        if self.on and not self.layers:
            raise ConfigError("EngineConfig.record_routing=True needs an MoE model (n_experts > 0); "
                              f"this one has n_experts={model.n_experts} and no MoE layer")
        self.k = model.n_experts_per_token if self.on else 0
        self.dtype = expert_index_dtype(max(model.n_experts, 1))
        self.width = max_seq_len - 1 if self.on else 0
        self._prefix: dict[int, tuple[np.ndarray, np.ndarray]] = {}   # rid -> [L - 1, layers, k] x 2
        self._steps: dict[tuple[int, int], list] = {}                 # (rid, member) -> [(e, g)]

    def prefilled(self, result, requests, start: np.ndarray, n_valid: np.ndarray):
        """Takes a prefill call's result (pools, or with the record on (pools, (experts, gates)
        [R, C, L, k])) for ``requests`` (row i: request i's tokens ``start[i] ..
        start[i] + n_valid[i] - 1``); returns the pools."""
        if not self.on:
            return result
        pools, (experts, gates) = result
        experts, gates = np.asarray(experts), np.asarray(gates)
        for i, req in enumerate(requests):
            if req.rid not in self._prefix:
                n = req.prefix_len
                self._prefix[req.rid] = (np.zeros((n, self.layers, self.k), self.dtype),
                                         np.zeros((n, self.layers, self.k), np.float32))
            lo, n = int(start[i]), int(n_valid[i])
            for dst, src in zip(self._prefix[req.rid], (experts, gates)):
                dst[lo:lo + n] = src[i, :n]
        return pools

    def decoded(self, rows, out) -> None:
        """Keeps a decode call's record (host DecodeOut, fields [n, B, ...]; row i's sequence
        ``rows[i]``, None for padding): each row's live steps, in order."""
        if not self.on:
            return
        counts = out.live.sum(axis=0)
        for i, seq in enumerate(rows):
            c = 0 if seq is None else int(counts[i])
            if c:
                steps = self._steps.setdefault((seq.request.rid, seq.member), [])
                steps.extend(zip(out.routing_experts[:c, i], out.routing_gates[:c, i]))

    def arrays(self, req) -> tuple[np.ndarray, np.ndarray]:
        """A completed request's record, removed from the collector: (experts [G, S, L, k],
        gates [G, S, L, k] f32), S = max_seq_len - 1 (off: [G, 0, 0, 0] each)."""
        g = len(req.sequences)
        experts = np.zeros((g, self.width, self.layers if self.on else 0, self.k), self.dtype)
        gates = np.zeros(experts.shape, np.float32)
        if not self.on:
            return experts, gates
        prefix = self._prefix.pop(req.rid, None)
        n = req.prefix_len
        for seq in req.sequences:
            if prefix is not None:
                experts[seq.member, :n], gates[seq.member, :n] = prefix
            steps = self._steps.pop((req.rid, seq.member), [])
            if steps:
                experts[seq.member, n:n + len(steps)] = np.stack([e for e, _ in steps])
                gates[seq.member, n:n + len(steps)] = np.stack([w for _, w in steps])
        return experts, gates
