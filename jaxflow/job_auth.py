"""The job secret and the per-connection frame MACs of jaxflow's sockets.

Every socket a job serves (the SparseRL-Sync replica servers, the rollout job's control
socket) speaks only to peers that hold the job's secret. A connection starts with a hello each
way (the client's nonce and session id, then the server's nonce); from then on every frame
carries ``HMAC-SHA256(secret, client nonce | server nonce | session | direction | sequence
number | header | body)``, so a frame cannot be forged without the secret, replayed (the
sequence number), reflected (the direction) or moved to another connection (the nonces). A
frame whose MAC does not verify is dropped before its body is parsed.

Where the secret comes from (:func:`job_secret`), first match wins:

  1. an explicit ``secret`` argument (bytes);
  2. ``--secret-file PATH`` of the runner, i.e. ``JAXFLOW_JOB_SECRET_FILE`` (the file's
     stripped contents, at least ``MIN_SECRET_BYTES``);
  3. ``JAXFLOW_JOB_SECRET`` (the value itself);
  4. on a loopback address only: this user's host secret, ``jaxflow-host-secret`` in
     ``$XDG_RUNTIME_DIR`` or ``~/.cache/jaxflow`` (created 0600 on first use). Other users of
     the host cannot read it; this user's processes could read a per-job secret from each
     other's environment anyway, so it is as strong as a per-job secret on one host, and a
     job and the replica processes it starts on 127.0.0.1 need no set-up.

A non-loopback address without 1-3 is refused (one line). ``python -m jaxflow.job_auth PATH``
writes a new random secret file (mode 0600), as the launch recipes do.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import pathlib
import secrets
import socket
import sys
import tempfile

from jaxflow.errors import UserError

SECRET_ENV = "JAXFLOW_JOB_SECRET"
SECRET_FILE_ENV = "JAXFLOW_JOB_SECRET_FILE"
MIN_SECRET_BYTES = 16
HOST_SECRET_NAME = "jaxflow-host-secret"
MAGIC = b"JXA1"
NONCE_BYTES = 16
SESSION_BYTES = 16
TAG_BYTES = hashlib.sha256().digest_size


class AuthError(UserError, ConnectionError):
    """A peer or a secret that fails authentication: no secret where one is required, a
    secret file that cannot be used, or a peer whose frames do not carry this job's MAC."""


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP literals (127.0.0.0/8, ::1)."""
    if host.strip("[]").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_secret_file(path: str | os.PathLike, *, what: str = "--secret-file") -> bytes:
    """The stripped bytes of the secret file ``path``; AuthError (one line) when it is missing,
    unreadable or shorter than ``MIN_SECRET_BYTES``."""
    try:
        data = pathlib.Path(path).read_bytes().strip()
    except OSError as e:
        raise AuthError(f"{what} {os.fspath(path)!r}: cannot read it ({e.strerror or e}); "
                        "valid: a file holding the job's secret") from None
    return _checked(data, f"{what} {os.fspath(path)!r}")


def _checked(data: bytes, what: str) -> bytes:
    if len(data) < MIN_SECRET_BYTES:
        raise AuthError(f"{what}: the secret has {len(data)} bytes; valid: at least "
                        f"{MIN_SECRET_BYTES} (python -m jaxflow.job_auth PATH writes one)")
    return data


def secret_configured() -> bool:
    """True when ``JAXFLOW_JOB_SECRET`` or ``JAXFLOW_JOB_SECRET_FILE`` is set."""
    return bool(os.environ.get(SECRET_FILE_ENV) or os.environ.get(SECRET_ENV))


def job_secret(host: str, secret: bytes | None = None) -> bytes:
    """The secret the sockets bound to or connecting to ``host`` use (module doc for the order).

    Raises:
      AuthError: no secret is configured and ``host`` is not a loopback address, or the
        configured secret is unusable (one line naming where it came from).
    """
    if secret is not None:
        return _checked(bytes(secret), "the job secret")
    path = os.environ.get(SECRET_FILE_ENV)
    if path:
        return read_secret_file(path, what=f"{SECRET_FILE_ENV}")
    value = os.environ.get(SECRET_ENV)
    if value:
        return _checked(value.strip().encode(), SECRET_ENV)
    if is_loopback(host):
        return host_secret()
    raise AuthError(f"address {host!r} is not loopback and no job secret is set; valid: "
                    f"--secret-file PATH or {SECRET_ENV} (the same on every process of both jobs),"
                    " or a 127.0.0.1 address")


def _host_secret_dir() -> pathlib.Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return pathlib.Path(runtime)
    home = pathlib.Path.home() / ".cache" / "jaxflow"
    try:
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        return home
    except OSError:
        fallback = pathlib.Path(tempfile.gettempdir()) / f"jaxflow-{os.getuid()}"
        fallback.mkdir(exist_ok=True, mode=0o700)
        return fallback


def host_secret() -> bytes:
    """This user's loopback secret (created 0600 on first use, atomically, so processes that
    start together agree on it); AuthError if the file is not this user's or is readable by
    others."""
    path = _host_secret_dir() / HOST_SECRET_NAME
    if not path.exists():
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".secret-")
        try:
            os.write(fd, secrets.token_hex(32).encode())
            os.close(fd)
            try:
                os.link(tmp, path)  # fails when another process created it first: use theirs
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise AuthError(f"host secret {str(path)!r} is not private to this user (owner uid "
                        f"{st.st_uid}, mode {st.st_mode & 0o777:o}); valid: owned by uid "
                        f"{os.getuid()}, mode 600")
    return read_secret_file(path, what="host secret")


def new_session() -> bytes:
    """A random session id: one trainer's identity toward the servers it feeds."""
    return secrets.token_bytes(SESSION_BYTES)


def client_hello(session: bytes) -> tuple[bytes, bytes]:
    """(the client's nonce, the hello body ``MAGIC | nonce | session``)."""
    if len(session) != SESSION_BYTES:
        raise ValueError(f"session of {len(session)} bytes; valid: {SESSION_BYTES}")
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce, MAGIC + nonce + session


def parse_client_hello(body: bytes | bytearray) -> tuple[bytes, bytes]:
    """(nonce, session) of a client hello; AuthError when it is not one."""
    body = bytes(body)
    if len(body) != len(MAGIC) + NONCE_BYTES + SESSION_BYTES or not body.startswith(MAGIC):
        raise AuthError(f"peer hello of {len(body)} bytes is not a jaxflow {MAGIC.decode()} hello")
    return body[len(MAGIC):len(MAGIC) + NONCE_BYTES], body[len(MAGIC) + NONCE_BYTES:]


def server_hello() -> tuple[bytes, bytes]:
    """(the server's nonce, the hello body ``MAGIC | nonce``)."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    return nonce, MAGIC + nonce


def parse_server_hello(body: bytes | bytearray, peer: str) -> bytes:
    """The server's nonce; AuthError naming ``peer`` when the body is not a server hello."""
    body = bytes(body)
    if len(body) != len(MAGIC) + NONCE_BYTES or not body.startswith(MAGIC):
        raise AuthError(f"{peer} answered the hello with {body[:40]!r}, not a jaxflow "
                        f"{MAGIC.decode()} hello (an older jaxflow or another service?)")
    return body[len(MAGIC):]


class FrameMac:
    """The MACs of one connection, for one side (``client`` True on the connecting side).

    ``tag(header, body)`` signs the next outgoing frame; ``verify(header, body, tag)`` checks
    the next incoming one. Each direction has its own sequence number, advanced per frame."""

    def __init__(self, secret: bytes, client_nonce: bytes, server_nonce: bytes, session: bytes,
                 *, client: bool):
        self.session = session
        self._base = hmac.new(secret, b"jaxflow-frame-v1" + client_nonce + server_nonce + session,
                              hashlib.sha256)
        self._out, self._in = (b"C", b"S") if client else (b"S", b"C")
        self._sent = self._received = 0

    def _mac(self, direction: bytes, seq: int, header: bytes, body) -> bytes:
        m = self._base.copy()
        m.update(direction + seq.to_bytes(8, "little") + bytes(header))
        m.update(body)
        return m.digest()

    def tag(self, header: bytes, body) -> bytes:
        """The tag of the next outgoing frame (``TAG_BYTES``)."""
        out = self._mac(self._out, self._sent, header, body)
        self._sent += 1
        return out

    def verify(self, header: bytes, body, tag: bytes | bytearray) -> bool:
        """True (and the incoming sequence advanced) when ``tag`` is the next incoming frame's."""
        ok = hmac.compare_digest(self._mac(self._in, self._received, header, body), bytes(tag))
        self._received += ok
        return ok


def write_secret_file(path: str | os.PathLike) -> pathlib.Path:
    """Writes a new random secret (64 hex characters) to ``path``, mode 0600; refuses to
    overwrite an existing file (AuthError)."""
    path = pathlib.Path(path)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise AuthError(f"secret file {str(path)!r} exists; valid: a new path") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def peer_name(sock: socket.socket) -> str:
    """``host:port`` of a connected socket's peer (``?`` once it is gone)."""
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "?"


__all__ = ["AuthError", "FrameMac", "MIN_SECRET_BYTES", "SECRET_ENV", "SECRET_FILE_ENV",
           "TAG_BYTES", "client_hello", "host_secret", "is_loopback", "job_secret", "new_session",
           "parse_client_hello", "parse_server_hello", "peer_name", "read_secret_file",
           "secret_configured", "server_hello", "write_secret_file"]


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxflow.job_auth PATH``: write a new job secret file (0600)."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m jaxflow.job_auth PATH  (writes a new job secret, mode 0600)",
              file=sys.stderr)
        return 2
    try:
        print(write_secret_file(argv[0]))
    except AuthError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
