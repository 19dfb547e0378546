"""Processes of one job starting together (``jaxflow.rendezvous``, ``jaxflow.supervise``): a late
process is waited for before the first collective (gloo alone gives 30 s), a rendezvous that
expires names who is missing, processes with different configs, a second process 0, a process id
registered twice and a dead coordinator each end in one line, without JAX's C++ crash dump.

Real processes on 127.0.0.1 (gloo) except the first test (the supervisor on a fake abort and
the coordinator-port claim, no JAX runtime)."""

import socket
import subprocess
import sys
import time

import pytest

from jaxflow.distributed import LOST_PEER_EXIT
from tests._cli import ROOT, TINY_LM, cli_env, free_port

#: A process of a 2-process job (1 CPU device each): argv = process id, port, mode.
SCRIPT = r"""
import os, sys, time
import numpy as np
from jaxflow import distributed
pid, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
timeout = {"expire": 3.0, "duplicate": 15.0}.get(mode, 300.0)
distributed.initialize(f"127.0.0.1:{port}", 2, pid, peer_timeout_s=30, rendezvous_timeout_s=timeout)
import jax
from jax.sharding import NamedSharding, PartitionSpec as P
if mode in ("coordinator_dies", "duplicate"):
    if pid == 0 and mode == "coordinator_dies":
        os._exit(9)  # without a word, as under SIGKILL
    time.sleep(90)
    sys.exit(3)
mesh = jax.make_mesh((2,), ("data",))
if pid == 1:
    time.sleep(60 if mode == "late" else 8)  # a process compiling (or starting) late
start = time.time()
try:
    distributed.connect_collectives(mesh)
except distributed.StartError as e:
    print(e, file=sys.stderr, flush=True)
    sys.exit(2)
f = jax.jit(jax.shard_map(lambda x: jax.lax.psum(x, "data"), mesh=mesh, in_specs=P("data"), out_specs=P()))
x = jax.make_array_from_callback((2,), NamedSharding(mesh, P("data")), lambda i: np.arange(1.0, 3.0)[i])
print("sum", float(np.asarray(f(x).addressable_data(0))[0]), "waited", time.time() - start, flush=True)
"""


def _script(pid, port, mode, *, supervised=False):
    cmd = [sys.executable, "-c", SCRIPT, str(pid), str(port), mode]
    if supervised:  # as the runner starts every process of a multi-process run
        cmd = [sys.executable, "-c", "import sys; from jaxflow.supervise import supervise; "
               f"sys.exit(supervise({cmd!r}, host='127.0.0.1', port={port}, process_id={pid}))"]
    return subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def test_supervisor_turns_a_coordination_abort_into_one_line_and_a_second_coordinator_is_refused(capsys):
    from jaxflow.rendezvous import StartError, claim_coordinator_port
    from jaxflow.supervise import supervise

    dump = ("E1206 05:49:38.904386   32504 coordination_service_agent.cc:289] Polled an error\n"
            "F1206 05:49:38.904528   32504 client.h:80] Terminating process because the JAX distributed "
            "service detected fatal errors. absl::Status: ABORTED: 1 unexpectedly tried to connect with "
            "a different incarnation. It has likely restarted.\n\nRPC: /xla.coordination.CoordinationService"
            "/PollForError\n*** Check failure stack trace: ***\n    @     0x7f5a6a640634  absl::Flush()\n")
    child = ("import os, sys, resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); "
             f"print('step 1', file=sys.stderr, flush=True); sys.stderr.write({dump!r}); "
             "sys.stderr.flush(); os.abort()")
    with socket.socket() as alive:
        alive.bind(("127.0.0.1", 0))
        alive.listen()
        port = alive.getsockname()[1]
        code = supervise([sys.executable, "-c", child], host="127.0.0.1", port=port, process_id=0)
        assert code == LOST_PEER_EXIT
        assert capsys.readouterr().err.splitlines() == [
            "step 1", f"[jaxflow] process 0: process id 1 registered twice with the coordinator at "
            f"127.0.0.1:{port} (two processes started with --process-id=1, or one restarted into a "
            "running job); the job is stopped; exiting"]
        with pytest.raises(StartError, match=f"port {port} is already in use on this host"):
            claim_coordinator_port(port, f"127.0.0.1:{port}")  # something listens there already


@pytest.mark.multiprocess
def test_a_process_late_by_60_s_is_waited_for_before_the_first_collective():
    port = free_port()
    procs = [_script(i, port, "late") for i in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    sums = [[line.split() for line in out.splitlines() if line.startswith("sum ")] for out, _ in outs]
    assert [[s[:2] for s in lines] for lines in sums] == [[["sum", "3.0"]]] * 2, outs
    waited = float(sums[0][0][3])
    assert waited > 50, waited  # process 0 waited at the rendezvous, past gloo's 30 s


@pytest.mark.multiprocess
def test_an_expired_rendezvous_names_the_missing_process_on_every_process():
    port = free_port()
    procs = [_script(i, port, "expire") for i in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], [e[-2000:] for _, e in outs]
    last0 = outs[0][1].strip().splitlines()[-1]
    assert last0.startswith("process 0: the start rendezvous 'connect_collectives' expired: "
                            "process(es) 1 did not arrive within --rendezvous-timeout 3 s"), last0
    assert "expired" in outs[1][1].strip().splitlines()[-1]


@pytest.mark.multiprocess
def test_a_dead_coordinator_is_one_line_without_the_crash_dump():
    port = free_port()
    procs = [_script(0, port, "coordinator_dies"), _script(1, port, "coordinator_dies", supervised=True)]
    (_, _), (_, err1) = [p.communicate(timeout=120) for p in procs]
    assert procs[1].returncode == LOST_PEER_EXIT, err1[-3000:]
    assert err1.strip().splitlines() == [
        f"[jaxflow] process 1: lost process 0 (the coordinator at 127.0.0.1:{port} no longer "
        "answers); exiting"], err1[-3000:]


@pytest.mark.multiprocess
def test_a_process_id_registered_twice_stops_the_job_in_one_line_per_process():
    port = free_port()
    job = [_script(i, port, "duplicate", supervised=True) for i in range(2)]
    time.sleep(15)  # the job is running
    duplicate = _script(1, port, "duplicate", supervised=True)
    errs = [p.communicate(timeout=120)[1] for p in [*job, duplicate]]
    line = (f"process id 1 registered twice with the coordinator at 127.0.0.1:{port} (two processes "
            "started with --process-id=1, or one restarted into a running job); the job is stopped; exiting")
    for i, p in enumerate(job):
        assert p.returncode == LOST_PEER_EXIT, errs[i][-3000:]
        assert errs[i].strip().splitlines() == [f"[jaxflow] process {i}: {line}"], errs[i][-3000:]
    assert duplicate.returncode == LOST_PEER_EXIT, errs[2][-3000:]
    assert errs[2].strip().splitlines()[-1].startswith(  # it could not join: waited, then one line
        f"[jaxflow] process 1: not every process joined the job at 127.0.0.1:{port} "), errs[2][-3000:]
    assert "Check failure stack trace" not in errs[2]


def _cli(args, pid, port, out, extra=()):
    cmd = [sys.executable, "-m", "jaxflow.run", "--exp=lm_pretrain", "--variant=quick", *TINY_LM,
           "--set", "train.steps=4", "--devices=1", f"--coordinator=127.0.0.1:{port}",
           "--num-processes=2", f"--process-id={pid}", f"--out={out}", *args, *extra]
    return subprocess.Popen(cmd, cwd=ROOT, env=cli_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.multiprocess
def test_cli_process_started_60_s_late_joins_and_the_run_finishes(tmp_path):
    port = free_port()
    first = _cli([], 0, port, tmp_path / "run")
    time.sleep(60)
    late = _cli([], 1, port, tmp_path / "run")
    for p in (first, late):
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()


@pytest.mark.multiprocess
def test_cli_processes_with_different_configs_each_name_the_keys(tmp_path):
    port = free_port()
    procs = [_cli(["--set", f"train.steps={4 + i}"], i, port, tmp_path / "run") for i in range(2)]
    errs = [p.communicate(timeout=300)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2], [e[-2000:] for e in errs]
    for i, err in enumerate(errs):
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
        assert "the processes resolved different configs: train.steps (process " in lines[0], lines[0]
        assert f"process {i}: {4 + i}" in lines[0], lines[0]


@pytest.mark.multiprocess
def test_cli_a_second_process_0_is_refused_and_the_first_stops_at_the_rendezvous(tmp_path):
    port = free_port()
    first = _cli([], 0, port, tmp_path / "a", extra=["--rendezvous-timeout=20"])
    time.sleep(8)  # the first one holds the port
    second = _cli([], 0, port, tmp_path / "b", extra=["--rendezvous-timeout=20"])
    _, err2 = second.communicate(timeout=120)
    assert second.returncode == 2, err2[-2000:]
    assert err2.strip().splitlines() == [
        f"python -m jaxflow.run: error: --coordinator 127.0.0.1:{port}: another process 0 already "
        f"coordinates a job on port {port} of this host; each process of a job needs its own "
        "--process-id (0..N-1) and each job its own port"]
    _, err1 = first.communicate(timeout=120)  # nobody joined it within 20 s
    assert first.returncode == LOST_PEER_EXIT, err1[-3000:]
    assert err1.strip().splitlines()[-1] == (
        f"[jaxflow] process 0: not every process joined the job at 127.0.0.1:{port} within "
        "--rendezvous-timeout 20 s (a process not started, started with another --coordinator or "
        "--num-processes, or a duplicate --process-id); exiting")
    assert "Check failure stack trace" not in err1
