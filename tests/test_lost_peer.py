"""Two real processes (jax.distributed on 127.0.0.1, gloo): when one dies, the other exits with
LOST_PEER_EXIT within the peer timeout and one line naming the lost process."""

import os
import socket
import subprocess
import sys
import time

from jaxflow.distributed import LOST_PEER_EXIT
from tests._cli import ROOT, free_port

SCRIPT = r"""
import os, sys, time
import numpy as np
from jaxflow import distributed
pid, port = int(sys.argv[1]), sys.argv[2]
distributed.initialize(f"127.0.0.1:{port}", 2, pid, peer_timeout_s=3)
from jax.experimental import multihost_utils
multihost_utils.sync_global_devices("ready")
if pid == 1:
    os._exit(9)  # dies without a word (as under SIGKILL)
print("started", time.time(), flush=True)
try:
    while True:  # a collective with a dead peer fails; then the watchdog names it
        multihost_utils.process_allgather(np.ones(3))
        time.sleep(0.1)
except Exception:
    distributed.await_lost_peer()
print("peer still alive?", flush=True)
"""


def test_survivor_names_the_lost_process_and_exits_within_the_timeout():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", SCRIPT, str(i), port], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    (out0, err0), _ = [p.communicate(timeout=240) for p in procs]
    done = time.time()
    assert procs[1].returncode == 9
    assert procs[0].returncode == LOST_PEER_EXIT, err0[-3000:]
    started = float(out0.split("started ")[1].split()[0])
    assert done - started < 3 * 1.5 + 10, done - started  # bounded: the timeout, not JAX's 100 s
    last = err0.strip().splitlines()[-1]
    assert last.startswith("[jaxflow] process 0: lost process 1 (no sign of life for ")
    assert "peer still alive" not in out0 and "Check failure stack trace" not in err0


def _listening_socket():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_supervisor_names_a_lost_coordinator_and_passes_other_outcomes_through(capsys):
    from jaxflow.supervise import supervise

    port = free_port()  # nothing listens there: the coordinator is gone
    abort = [sys.executable, "-c", "import os, resource; resource.setrlimit(resource.RLIMIT_CORE, (0, 0)); os.abort()"]
    assert supervise(abort, host="127.0.0.1", port=port, process_id=1) == LOST_PEER_EXIT
    assert capsys.readouterr().err.strip().splitlines() == [
        f"[jaxflow] process 1: lost process 0 (the coordinator at 127.0.0.1:{port} no longer "
        "answers); exiting"]
    with _listening_socket() as alive:  # coordinator still there: the abort is something else
        assert supervise(abort, host="127.0.0.1", port=alive.getsockname()[1], process_id=1) == 134
    assert capsys.readouterr().err == ""
    term = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"]
    assert supervise(term, host="127.0.0.1", port=port, process_id=1) == 143
    env_check = [sys.executable, "-c", "import os, sys; sys.exit(int(os.environ['JAXFLOW_SUPERVISED']) + 4)"]
    assert supervise(env_check, host="127.0.0.1", port=port, process_id=1) == 5
