"""Experiment drivers: ``main(config, run) -> dict`` per experiment (see configs/)."""
