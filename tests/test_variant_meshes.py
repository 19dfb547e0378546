"""Every variant of every experiment resolves its meshes on 1 and on 8 devices (the devices an
accelerator machine may have), without training: ``jaxflow.run.resolve_meshes`` builds what the
driver would build, from the same code path the driver uses."""

from __future__ import annotations

import argparse
import dataclasses
import json

import jax
import numpy as np
import pytest

from jaxflow.config import apply_overrides, experiments
from jaxflow.mesh import CPU_FAKE_DEVICES, MeshError
from jaxflow.run import default_devices, resolve_meshes
from jaxflow.run import main as runner_main

#: experiments whose drivers build device meshes (a mesh, roles or a devices field)
MULTI_DEVICE = {"nestpipe", "flowtrain", "flexmarl"}

#: production-size variants: pod meshes, checked on POD_DEVICES fake devices
PRODUCTION = {("flagship", "full"), ("lm_pretrain", "full"), ("dlrm_train", "full"),
              ("bench_embedding", "full"), ("nestpipe", "full"), ("flowtrain", "full"),
              ("flexmarl", "full"), ("bench_rollout", "full"), ("rl", "full")}
POD_DEVICES = 64

CASES = [(name, variant) for name, spec in sorted(experiments().items())
         for variant in spec.variants]


@pytest.mark.parametrize("n", [1, 8])
@pytest.mark.parametrize("name,variant", CASES)
def test_every_variant_resolves_its_meshes(name, variant, n):
    spec = experiments()[name]
    config = spec.get_config(variant)
    devices = jax.devices()[:n]
    assert len(devices) == n
    if (name, variant) in PRODUCTION:
        # sized for a pod: on fewer devices either meshes or a one-line error naming the
        # devices (the test below resolves them on 64)
        try:
            meshes = resolve_meshes(spec, config, devices)
        except (MeshError, ValueError) as e:
            assert "device" in str(e), str(e)
            return
    else:
        meshes = resolve_meshes(spec, config, devices)
    if name in MULTI_DEVICE or hasattr(config, "mesh") or hasattr(config, "roles"):
        assert meshes, f"{name}[{variant}] resolved no mesh"
    for key, mesh in meshes.items():
        used = set(mesh.devices.flat)
        assert used <= set(devices), f"{name}[{variant}] mesh {key} uses devices not given"
        assert 1 <= len(used) <= n


@pytest.mark.parametrize("name", ["nestpipe", "flowtrain"])
def test_pinned_experiments_span_the_devices_present(name):
    """devices=None: every device given (1 GPU or 8); the CPU default stays 8 fake devices."""
    spec = experiments()[name]
    config = spec.get_config("quick")
    assert config.devices is None
    args = argparse.Namespace(devices=None, coordinator=None, distributed_auto=False)
    assert default_devices(args, config) == CPU_FAKE_DEVICES
    for n in (1, 2, 8):
        meshes = resolve_meshes(spec, config, jax.devices()[:n])
        first = next(iter(meshes.values()))
        assert first.devices.size == n
    pinned = dataclasses.replace(config, devices=2)
    assert next(iter(resolve_meshes(spec, pinned, jax.devices()).values())).devices.size == 2
    with pytest.raises(MeshError, match="devices=2, but 1 cpu device"):
        resolve_meshes(spec, pinned, jax.devices()[:1])


def test_flowtrain_one_device_is_colocated_and_splits_otherwise():
    spec = experiments()["flowtrain"]
    config = spec.get_config("quick")
    one = resolve_meshes(spec, config, jax.devices()[:1])
    assert one["encoder/1(1x1)+1(1x1)"] is one["backbone/1(1x1)+1(1x1)"]
    eight = resolve_meshes(spec, config, jax.devices())
    enc, bb = eight["encoder/2(2x1)+6(6x1)"], eight["backbone/2(2x1)+6(6x1)"]
    assert not set(enc.devices.flat) & set(bb.devices.flat)
    two = resolve_meshes(spec, config, jax.devices()[:2])  # candidate 2 does not fit 2 devices
    assert sorted(k for k in two if k.startswith("encoder/")) == ["encoder/1(1x1)+1(1x1)"]


def test_nestpipe_batch_not_divisible_by_resolved_devices_is_a_clear_error():
    spec = experiments()["nestpipe"]
    config = apply_overrides(spec.get_config("quick"), ["batch_size=2052"])  # 4 x 513
    resolve_meshes(spec, config, jax.devices()[:1])
    with pytest.raises(MeshError, match=r"batch_size=2052 is not divisible by 2 devices x "
                                        r"micro_batches=4 = 8"):
        resolve_meshes(spec, config, jax.devices()[:2])


def test_nestpipe_capacities_apply_only_on_the_count_they_were_measured_on():
    from jaxflow.nestpipe.model import capacities

    config = experiments()["nestpipe"].get_config("quick")
    assert capacities(config, 8)["capacity"] == config.capacity > 0
    assert set(capacities(config, 1).values()) == {0}  # worst-case sizes, cannot overflow


def test_dry_run_prints_the_meshes_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "run"
    assert runner_main(["--exp=flowtrain", "--variant=quick", f"--out={out}", "--dry-run"]) == 0
    resolved = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert resolved["meshes"]["monolithic"] == {"data": 8} and resolved["device_count"] == 8
    assert not out.exists()
    assert runner_main(["--exp=nestpipe", "--variant=quick", "--set", "batch_size=2052",
                        "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "batch_size=2052 is not divisible by 8 devices" in err[0]


@pytest.mark.parametrize("name,variant", sorted(PRODUCTION))
def test_production_variants_resolve_on_a_pod(name, variant):
    """``--dry-run`` of each production-size variant on 64 fake devices (a v5p:4x4x4 pod's
    count): its config validates and its meshes form (what ``--compile-only`` builds on the
    abstract chips)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "jaxflow.run", f"--exp={name}",
                           f"--variant={variant}", "--dry-run", f"--devices={POD_DEVICES}"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert line["device_count"] == POD_DEVICES
    assert line["meshes"], line
    for shape in line["meshes"].values():
        assert 1 <= int(np.prod(list(shape.values()))) <= POD_DEVICES
