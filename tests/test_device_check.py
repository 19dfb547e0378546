"""experiments/device_check.sh cannot rot: it is valid bash, and every step's runner command
resolves (experiment, variant, --set overrides, meshes) with ``--dry-run``."""

from __future__ import annotations

import contextlib
import io
import json
import pathlib
import re
import shlex
import subprocess
import tomllib

import pytest

from jaxflow import run as runner

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "experiments" / "device_check.sh"
REQUIRED = {"bench_kernels", "flagship", "bench_policy_loss", "bench_sync_codec",
            "bench_embedding"}


def _steps() -> list[tuple[str, int, list[str]]]:
    text = SCRIPT.read_text().replace("\\\n", " ")
    body = text[text.index("steps() {"):]
    body = body[:body.index("\n}\n")]
    return [(m[1], int(m[2]), shlex.split(m[3]))
            for m in re.finditer(r"^\s*step (\S+) (\d+) (.*)$", body, re.MULTILINE)]


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, capture_output=True, text=True)


def test_steps_cover_the_device_check_and_fit_the_budget():
    steps = _steps()
    assert {name for name, _, _ in steps} == REQUIRED
    assert all(0 < limit <= 300 for _, limit, _ in steps)
    assert "TOTAL_S=\"${DEVICE_CHECK_TOTAL_S:-300}\"" in SCRIPT.read_text()  # 5 minutes in all
    full = dict((n, a) for n, _, a in steps)["bench_kernels"]
    assert "--variant=full" in full


@pytest.mark.parametrize("name,args", [(n, a) for n, _, a in _steps()], ids=lambda x: str(x)[:20])
def test_every_step_parses_with_the_runner(name, args):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = runner.main([*args, "--dry-run"])
    assert rc == 0, f"{name}: {args}"
    resolved = json.loads(out.getvalue().strip().splitlines()[-1])
    assert resolved["experiment"] == name
    variant = next(a.split("=", 1)[1] for a in args if a.startswith("--variant"))
    assert resolved["variant"] == variant


def test_carried_wheels_are_project_dependencies():
    pins = re.search(r"WHEEL_PINS=\(([^)]*)\)", SCRIPT.read_text())[1].split()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=\[ ]", d)[0].lower() for d in deps}
    assert pins and all(p.split("==")[0].lower() in names for p in pins)
    ignored = (ROOT / ".gitignore").read_text().split()
    assert "experiments/wheels/" in ignored and "experiments/device_results/" in ignored
