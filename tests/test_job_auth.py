"""The job secret and the frame MACs (``jaxflow.job_auth``): where the secret comes from, what
is refused (one line), and that a MAC binds the frame to its connection, direction, position
and session. The runner's ``--secret-file`` and the remote roles' addresses at ``--dry-run``."""

import os
import stat

import pytest

from jaxflow import job_auth
from jaxflow import run as runner
from jaxflow.config import ConfigError
from jaxflow.job_auth import AuthError, FrameMac
from jaxflow.rl.remote.protocol import RemoteConfig
from jaxflow.rl.remote.server import RolloutService
from jaxflow.sync import Replica, to_bf16
from jaxflow.sync.transport import ReplicaServer, tcp

SECRET = b"s" * 32
HEADER = b"STAT" + bytes(8)


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No configured secret; the host secret under ``tmp_path``."""
    monkeypatch.setenv(job_auth.SECRET_ENV, "")
    monkeypatch.setenv(job_auth.SECRET_FILE_ENV, "")
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    return tmp_path


def pair(secret_c=SECRET, secret_s=SECRET, session=b"t" * 16):
    cn, sn = os.urandom(16), os.urandom(16)
    return (FrameMac(secret_c, cn, sn, session, client=True),
            FrameMac(secret_s, cn, sn, session, client=False))


def test_a_mac_binds_secret_connection_direction_sequence_and_session():
    client, server = pair()
    tag = client.tag(HEADER, b"{}")
    assert server.verify(HEADER, b"{}", tag)
    assert not server.verify(HEADER, b"{}", tag)  # replayed: the next sequence number
    assert not client.verify(HEADER, b"{}", client.tag(HEADER, b"{}"))  # reflected
    client2, server2 = pair()  # another connection: other nonces
    assert not server2.verify(HEADER, b"{}", tag)
    tampered_c, tampered_s = pair()
    assert not tampered_s.verify(HEADER, b"{ }", tampered_c.tag(HEADER, b"{}"))
    wrong_c, wrong_s = pair(secret_c=b"x" * 32)
    assert not wrong_s.verify(HEADER, b"", wrong_c.tag(HEADER, b""))
    c, s = pair()
    other_session = FrameMac(SECRET, os.urandom(16), os.urandom(16), b"u" * 16, client=True)
    assert not s.verify(HEADER, b"", other_session.tag(HEADER, b""))
    assert s.verify(HEADER, b"", c.tag(HEADER, b""))  # the failures above did not advance it


def test_where_the_secret_comes_from(clean_env, monkeypatch):
    assert job_auth.job_secret("10.0.0.1", SECRET) == SECRET
    monkeypatch.setenv(job_auth.SECRET_ENV, "e" * 20)
    assert job_auth.job_secret("10.0.0.1") == b"e" * 20
    path = clean_env / "secret"
    job_auth.write_secret_file(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    monkeypatch.setenv(job_auth.SECRET_FILE_ENV, str(path))  # the file wins over the value
    assert job_auth.job_secret("10.0.0.1") == path.read_bytes().strip()
    with pytest.raises(AuthError, match="exists; valid: a new path"):
        job_auth.write_secret_file(path)


def test_loopback_uses_this_users_private_host_secret(clean_env):
    first = job_auth.job_secret("127.0.0.1")
    assert job_auth.job_secret("localhost") == first == job_auth.job_secret("::1")
    path = clean_env / job_auth.HOST_SECRET_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.chmod(0o644)
    with pytest.raises(AuthError, match=r"is not private to this user .* mode 644\); valid: "):
        job_auth.job_secret("127.0.0.1")


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "", "trainer-0.example"])
def test_no_secret_on_a_non_loopback_address_is_refused(clean_env, host):
    with pytest.raises(AuthError, match=f"address {host!r} is not loopback and no job secret"):
        job_auth.job_secret(host)
    with pytest.raises(AuthError, match="is not loopback"):
        ReplicaServer(Replica(to_bf16({"w": [1.0]})), host=host)
    with pytest.raises(AuthError, match="is not loopback"):
        tcp.TcpLink(host or "0.0.0.0", 7100)
    with pytest.raises(AuthError, match="is not loopback"):
        RolloutService(None, host=host)  # refused before the worker is looked at


def test_replica_server_process_without_a_secret_exits_2(clean_env, capsys):
    with pytest.raises(SystemExit) as info:  # refused before the template is read
        tcp.main(["--template=absent.pkl", f"--port-file={clean_env / 'port'}", "--host=0.0.0.0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "address '0.0.0.0' is not loopback" in err
    assert not (clean_env / "port").exists()


@pytest.mark.parametrize("content, problem", [(b"short\n", "has 5 bytes; valid: at least 16"),
                                              (None, "cannot read it")])
def test_unusable_secret_files(clean_env, content, problem):
    path = clean_env / "s"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(AuthError, match=problem) as info:
        job_auth.read_secret_file(path)
    assert "\n" not in str(info.value)


def test_remote_roles_need_a_secret_off_loopback(clean_env, monkeypatch):
    with pytest.raises(ConfigError, match="remote.listen host '0.0.0.0' is not loopback"):
        RemoteConfig(role="rollout", listen="0.0.0.0:7100")
    with pytest.raises(ConfigError, match="remote.rollout host '10.0.0.2' is not loopback"):
        RemoteConfig(role="trainer", rollout="127.0.0.1:7100,10.0.0.2:7101")
    RemoteConfig(role="rollout", listen="127.0.0.1:7100")
    monkeypatch.setenv(job_auth.SECRET_ENV, "e" * 20)
    RemoteConfig(role="rollout", listen="0.0.0.0:7100")


def test_runner_secret_file(clean_env, capsys):
    rollout = ["--exp=flagship", "--variant=quick", "--dry-run", "--set", "remote.role=rollout",
               "--set", "remote.listen=0.0.0.0:7100"]
    assert runner.main([*rollout, f"--out={clean_env / 'a'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "remote.listen host '0.0.0.0' is not loopback" in err
    assert runner.main([*rollout, f"--secret-file={clean_env / 'none'}", f"--out={clean_env / 'b'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--secret-file" in err and "cannot read it" in err
    job_auth.write_secret_file(clean_env / "secret")
    assert runner.main([*rollout, f"--secret-file={clean_env / 'secret'}",
                        f"--out={clean_env / 'c'}"]) == 0
    assert os.environ[job_auth.SECRET_FILE_ENV] == str(clean_env / "secret")


def test_secret_file_cli(clean_env, capsys):
    assert job_auth.main([str(clean_env / "new")]) == 0
    assert len((clean_env / "new").read_text().strip()) == 64
    assert job_auth.main([str(clean_env / "new")]) == 2
    assert "exists" in capsys.readouterr().err
