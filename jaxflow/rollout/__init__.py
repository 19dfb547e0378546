"""jaxflow.rollout: a rollout engine for RL (paged KV cache, continuous batching, shared group
prefixes, weights updated in place) and its paged decode attention."""
from jaxflow.rollout.engine import (
    EngineConfig,
    EngineOutput,
    EngineStats,
    RequestOutput,
    RolloutConfigError,
    RolloutEngine,
)

__all__ = ["EngineConfig", "EngineOutput", "EngineStats", "RequestOutput",
           "RolloutConfigError", "RolloutEngine"]
