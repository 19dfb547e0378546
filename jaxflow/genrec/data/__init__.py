"""Data for generative recommendation: the request layout, a synthetic multi-scenario
generator with known intents, and MovieLens readers for user-given files."""
