"""docs/launch/: every launch recipe parses (bash -n, YAML), and the jaxflow command it runs is
accepted by the runner's flag parser and names an experiment and variant that exist."""

import pathlib
import re
import shlex
import subprocess

import pytest
import yaml

from jaxflow import run as runner
from jaxflow.config import experiments

LAUNCH = pathlib.Path(__file__).resolve().parents[1] / "docs" / "launch"
SHELL = ["tpu_pod.sh", "slurm_gpu.sbatch"]


def _jaxflow_args(text: str) -> list[str]:
    """The arguments after ``python -m jaxflow.run`` in ``text`` (comments dropped; the shell
    variables it uses expanded from their ``NAME=value`` assignments in the same text)."""
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    values = {m[1]: m[2].strip('"') for m in re.finditer(r'\b([A-Z_]+)=("[^"]*"|[^\s;"]+)', text)}
    command = text[text.index("python -m jaxflow.run") + len("python -m jaxflow.run"):]
    command = re.split(r"[;\n]", command)[0].rstrip('"')
    expanded = re.sub(r'"?\$\{?([A-Z_]+)\}?"?', lambda m: values.get(m[1], m[0]), command)
    return shlex.split(expanded)


@pytest.mark.parametrize("name", SHELL)
def test_shell_recipes_parse(name):
    proc = subprocess.run(["bash", "-n", str(LAUNCH / name)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_jobset_parses_as_a_jobset():
    doc = yaml.safe_load((LAUNCH / "jobset_tpu.yaml").read_text())
    assert doc["apiVersion"].startswith("jobset.x-k8s.io/") and doc["kind"] == "JobSet"
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["parallelism"] == job["completions"] >= 1
    pod = job["template"]["spec"]
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    (container,) = pod["containers"]
    assert "python -m jaxflow.run" in " ".join(container["args"])


@pytest.mark.parametrize("name", [*SHELL, "jobset_tpu.yaml"])
def test_the_command_is_one_the_runner_accepts(name):
    text = (LAUNCH / name).read_text()
    if name.endswith(".yaml"):
        text = " ".join(yaml.safe_load(text)["spec"]["replicatedJobs"][0]["template"]["spec"]
                        ["template"]["spec"]["containers"][0]["args"])
    args = _jaxflow_args(text)
    assert not [a for a in args if "$" in a], args  # every variable it uses is set in the file
    parsed = runner.build_parser().parse_args(args)
    assert parsed.distributed_auto, args
    assert parsed.out and parsed.exp in experiments(), args
    assert (parsed.variant or "default") in experiments()[parsed.exp].variants, args
