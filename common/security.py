"""The cluster key: who may talk to the scheduler's sockets.

Every internal socket is encrypted and authenticated with ZeroMQ's CURVE. The cluster has one key pair,
kept in `cluster_key_file` (default ~/.config/pagedserve/cluster_key), a file only its owner can read: the
first process that starts makes it, the others read it. The scheduler's two sockets (clients, workers) are
CURVE servers with that key and accept only peers that prove they hold it too, so a process without the file
can neither submit, nor register as a worker, nor read a plan, on loopback as on a network. For processes on
other hosts the operator copies the file there (or points `--cluster-key-file` at a copy).

The file holds the secret key in Z85 (40 characters); the public key is derived from it.

CURVE keeps strangers out, but a stranger's handshake is still read: every secured socket also bounds its
frames and its handshake time (common/socket_limits.py), so what a peer without the key can make a
process hold is one frame of that socket's limit, for a few seconds.
"""

from __future__ import annotations

import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from pagedserve.common.log import get_logger
from pagedserve.common.socket_limits import limit_socket

ZAP_DOMAIN = "pagedserve"
log = get_logger(component="security")


class ClusterKeyError(RuntimeError):
    """The cluster key file is missing and cannot be made, unreadable, malformed or open to others."""


@dataclass(frozen=True)
class ClusterKey:
    public: bytes  # Z85, 40 bytes
    secret: bytes  # Z85, 40 bytes

    @property
    def fingerprint(self) -> str:
        """The public key's first characters: enough to tell keys apart in logs, useless to an attacker."""
        return self.public[:8].decode()


def load_cluster_key(path: str | os.PathLike[str], create: bool = True) -> ClusterKey:
    """The key pair in `path`, made there first (mode 0600, in a 0700 folder) when missing and `create`.

    Processes that start together race to make the file: it is written to a private temporary file and
    linked into place, so every process reads the same complete key.
    """
    file = Path(path).expanduser()
    try:
        if not file.exists():
            if not create:
                raise ClusterKeyError(f"no cluster key at {file}")
            _create(file)
        info = file.stat()
        secret = file.read_bytes().strip()
    except OSError as e:  # an unwritable folder, an unreadable file: the operator's to fix
        raise ClusterKeyError(f"the cluster key {file} cannot be read or made: {e}") from e
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ClusterKeyError(
            f"the cluster key {file} is open to other users (mode {stat.filemode(info.st_mode)}); "
            f"make it private with: chmod 600 {file}"
        )
    if len(secret) != 40:
        raise ClusterKeyError(f"{file} does not hold a Z85 CURVE secret key (40 characters)")
    try:
        public = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError) as e:
        raise ClusterKeyError(f"{file} does not hold a valid CURVE secret key: {e}") from e
    return ClusterKey(public, secret)


def _create(file: Path) -> None:
    file.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _, secret = zmq.curve_keypair()
    fd, name = tempfile.mkstemp(dir=file.parent, prefix=f".{file.name}.")  # mode 0600, a unique name
    tmp = Path(name)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
        try:
            os.link(tmp, file)  # fails if another process made it first: then theirs is the key
            log.info("cluster_key_created", path=str(file))
        except FileExistsError:
            pass
    finally:
        tmp.unlink(missing_ok=True)


def secure_server(sock: zmq.Socket, key: ClusterKey, max_message_bytes: int) -> None:
    """Makes `sock` (before bind) a CURVE server that the authenticator of `authenticate` guards, taking
    frames of at most `max_message_bytes` (common/socket_limits.py) from anyone."""
    limit_socket(sock, max_message_bytes)
    sock.curve_secretkey = key.secret
    sock.curve_publickey = key.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()


def secure_client(sock: zmq.Socket, key: ClusterKey, max_message_bytes: int) -> None:
    """Makes `sock` (before connect) a CURVE client that proves it holds the cluster key, taking frames of
    at most `max_message_bytes` (common/socket_limits.py)."""
    limit_socket(sock, max_message_bytes)
    sock.curve_secretkey = key.secret
    sock.curve_publickey = key.public
    sock.curve_serverkey = key.public


class _ClusterMembers:
    """The authenticator's check: a peer is admitted when its public key is the cluster's."""

    def __init__(self, key: ClusterKey) -> None:
        self._public = key.public
        self.refused = 0  # handshakes refused, for the logs' rate limit

    def callback(self, domain: str, client_key: bytes) -> bool:
        if client_key == self._public:
            return True
        self.refused += 1
        if self.refused & (self.refused - 1) == 0:  # the 1st, 2nd, 4th, 8th... refusal: a flood logs little
            log.warning("peer_refused", reason="not the cluster key", num_refused=self.refused)
        return False


def authenticate(ctx: zmq.asyncio.Context, key: ClusterKey) -> AsyncioAuthenticator:
    """Starts the ZAP handler of `ctx`'s CURVE server sockets: only holders of `key` get in. Stop it with
    `.stop()` before the context terminates."""
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_ClusterMembers(key))
    return auth
