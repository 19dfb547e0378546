"""Where an All2All's bytes go (node, pod, oversubscribed spine) and the mean per-worker stage
costs as a function of the worker count (the scale laws of the package doc).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class NetworkShape:
    """Where an All2All's bytes go: G workers per node, pods of P, an o:1 spine above pods."""

    gpus_per_node: int = 8
    pod_size: int = 256
    oversubscription: float = 2.0
    intra_over_inter_bw: float = 8.0  # node fabric (NVLink / HCCS) vs NIC bandwidth

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.pod_size < self.gpus_per_node:
            raise ValueError(f"gpus_per_node={self.gpus_per_node}, pod_size={self.pod_size}: "
                             "need 1 <= gpus_per_node <= pod_size")
        if self.oversubscription < 1 or self.intra_over_inter_bw <= 0:
            raise ValueError(f"oversubscription={self.oversubscription} (need >= 1), "
                             f"intra_over_inter_bw={self.intra_over_inter_bw} (need > 0)")


def bandwidth_factor(n: int, shape: NetworkShape) -> float:
    """phi(N): an All2All's byte time per worker in units of (its bytes / NIC bandwidth)."""
    if n <= 1:
        return 0.0
    g = min(n, shape.gpus_per_node)
    p = min(n, shape.pod_size)
    return ((g - 1) / shape.intra_over_inter_bw + (p - g)
            + max(0, n - p) * shape.oversubscription) / n


@dataclasses.dataclass(frozen=True)
class StageModel:
    """Mean per-worker stage costs as a function of the worker count (step units).

    ``route``, ``retrieve`` etc. are the means at ``n0``; lookup (route + retrieve) grows by
    ``lookup_per_peer`` per added worker; each All2All direction costs
    ``a2a_call`` per call (``a2a_latency * (N - 1)``) plus ``a2a_bytes`` split over the calls
    (``a2a_congestion * (N - 1) + a2a_bandwidth * bandwidth_factor(N)``).
    """

    n0: int
    data: float
    h2d: float
    route: float
    retrieve: float
    compute: float
    write_back: float
    patch: float = 0.0
    lookup_per_peer: float = 0.0
    a2a_latency: float = 0.0
    a2a_congestion: float = 0.0
    a2a_bandwidth: float = 0.0
    shape: NetworkShape = NetworkShape()
    unit_ms: float = 1.0  # milliseconds per step unit

    def costs(self, n: int) -> dict[str, float]:
        """Mean per-worker cost of each stage at ``n`` workers (step units), by the scale laws."""
        lookup0 = self.route + self.retrieve
        scale = (lookup0 + self.lookup_per_peer * (n - self.n0)) / lookup0 if lookup0 > 0 else 1.0
        if scale < 0:
            raise ValueError(f"workers={n}: the lookup law gives a negative cost")
        return {"data": self.data, "h2d": self.h2d, "route": self.route * scale,
                "retrieve": self.retrieve * scale, "compute": self.compute,
                "write_back": self.write_back, "patch": self.patch,
                "a2a_call": self.a2a_latency * max(n - 1, 0),
                "a2a_bytes": (self.a2a_congestion * max(n - 1, 0)
                              + self.a2a_bandwidth * bandwidth_factor(n, self.shape))}

    def mean_shares(self, n: int) -> dict[str, float]:
        """Lookup / All2All / rest as fractions of the serial sum of mean costs (no waits)."""
        c = self.costs(n)
        lookup = c["route"] + c["retrieve"]
        a2a = 2 * (c["a2a_call"] + c["a2a_bytes"])
        rest = c["data"] + c["h2d"] + c["compute"] + c["write_back"]
        total = lookup + a2a + rest
        return {"lookup": lookup / total, "all2all": a2a / total, "rest": rest / total,
                "a2a_call_fraction": c["a2a_call"] / max(c["a2a_call"] + c["a2a_bytes"], 1e-30)}
