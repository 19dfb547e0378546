"""Test session set-up: 8 fake CPU devices before JAX initialises its backend."""
import os

# The compile gate (tests/aot/) runs in the environment of the `aot` extra, by its own step of
# .ci/run: JAXFLOW_COMPILE_GATE=1 collects it and sets what the compilers need before jax starts.
COMPILE_GATE = os.environ.get("JAXFLOW_COMPILE_GATE") == "1"
collect_ignore = [] if COMPILE_GATE else ["aot"]
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()
if COMPILE_GATE:
    from pallas_kernels.targets import compile_env

    for _k, _v in compile_env().items():
        os.environ.setdefault(_k, _v)

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)

import pytest  # noqa: E402


@pytest.fixture
def on_platform(monkeypatch):
    """``on_platform("gpu")``: the kernel dispatch believes it runs on that platform (caches
    cleared before and after, so no kernel built for another platform leaks between tests)."""
    from pallas_kernels import dispatch

    def patch(platform):
        jax.clear_caches()
        dispatch.clear_cache()
        monkeypatch.setattr(dispatch, "backend_platform", lambda: platform)

    yield patch
    dispatch.clear_cache()
    jax.clear_caches()
