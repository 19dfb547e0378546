"""Experiment drivers: ``main(config, run) -> dict`` entry points named by configs/*.py."""
