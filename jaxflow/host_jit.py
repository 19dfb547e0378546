"""numba for the few host loops numpy cannot vectorise (the sync diff, sample clustering).

``numba_or_none()`` is the ``numba`` module, or None when it is not installed, when
``JAXFLOW_HOST_KERNELS=numpy`` asks for the numpy paths, or on a big-endian host (the kernels
read little-endian words). Every compiled kernel has a numpy twin that gives the same
result; the tests compare the two.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys


def numba_or_none():
    if os.environ.get("JAXFLOW_HOST_KERNELS", "auto") == "numpy" or sys.byteorder != "little":
        return None
    try:
        import numba
    except ImportError:
        return None
    return numba


@functools.cache
def compiled_module(name: str):
    """The numba kernel module ``name`` (e.g. ``"jaxflow.sync._host_kernels_nb"``), imported on
    first use so that importing its caller does not load numba; None when
    :func:`numba_or_none` is None (the caller then runs its numpy twin)."""
    return importlib.import_module(name) if numba_or_none() is not None else None
