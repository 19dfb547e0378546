"""Experiment drivers: one module per experiment, ``main(config, run) -> summary``.

``configs/<experiment>.py`` names its driver here through ``ENTRY``. Drivers compose the library
packages (``jaxflow.rl``, ``jaxflow.sync``, ...); no library module imports a driver.
"""
