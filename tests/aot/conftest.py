"""The compile gate's session: the real XLA:TPU and XLA:GPU compilers must be installed.

This folder is collected only when ``JAXFLOW_COMPILE_GATE=1`` (``tests/conftest.py``), in the
environment of the ``aot`` extra (``.ci/run``'s compile step); without the compilers the session
stops with the install command instead of skipping anything.
"""

import pytest

from pallas_kernels import targets


def pytest_configure(config):
    missing = [p for p in ("tpu", "gpu") if not targets.available(p)]
    if missing:
        raise pytest.UsageError(
            "the compile gate needs the " + " and ".join(p.upper() for p in missing)
            + " compiler(s): pip install -e '.[aot]' (libtpu and the CUDA PJRT plugin at the jax "
            "version of this environment)")
