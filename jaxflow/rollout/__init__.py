"""Rollout engine for RL: paged KV cache, continuous batching, shared prefixes."""
