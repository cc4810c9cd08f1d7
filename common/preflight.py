"""Configuration checks that run before a process starts anything, and the one way a configuration error
ends a process: one line on stderr naming the flag, exit status 2, which a supervisor never restarts
(common/supervisor.py). Torch-free: the scheduler and `pagedserve serve` use it; the worker's own checks
(model limits, tensor parallelism, device, model family) are worker/preflight.py's.
"""

from __future__ import annotations

import errno
import os
import re
import socket
import sys
from collections.abc import Iterable
from typing import NoReturn

CONFIG_ERROR = 2  # argparse's status for a usage error; the supervisor does not restart it


class ConfigError(ValueError):
    """A setting that cannot work: `flag` names it (`--port`), the message says why."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"{flag}: {message}")
        self.flag = flag


def flag_of(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def flag_named_in(message: str, field_names: Iterable[str]) -> str:
    """The flag of the field that `message` (a config's ValueError, written with field names) is about: the
    first snake_case field name in it, or a one-word name that starts it ("port must be ..."); "" when none
    is."""
    found: list[tuple[int, str]] = []
    for name in field_names:
        match = re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", message)
        if match and ("_" in name or match.start() == 0):
            found.append((match.start(), name))
    return flag_of(min(found, key=lambda f: (f[0], -len(f[1])))[1]) if found else ""


def exit_config_error(process: str, error: Exception) -> NoReturn:
    """Ends the process for a configuration error: one line, status 2."""
    print(f"{process}: error: {error}", file=sys.stderr, flush=True)
    raise SystemExit(CONFIG_ERROR)


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """`port` is a TCP port (1-65535) that `host` can listen on now. Raises ConfigError otherwise."""
    if not 1 <= port <= 65535:
        raise ConfigError(flag, f"{port} is not a TCP port (1-65535)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp and ZeroMQ listen
        try:
            s.bind((host, port))
        except socket.gaierror as e:
            raise ConfigError("--host" if flag == "--port" else flag, f"{host!r}: {e.strerror}") from None
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ConfigError(flag, f"{host}:{port} is already in use (another server?)") from None
            raise ConfigError(flag, f"cannot listen on {host}:{port}: {e.strerror}") from None


def check_bind_address(address: str, flag: str) -> None:
    """`address` is a ZeroMQ endpoint this host can bind now: tcp://HOST:PORT (`*` for any interface) with
    the port free, or ipc://PATH in an existing directory. Raises ConfigError otherwise."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc"):
        raise ConfigError(flag, f"{address!r} is not tcp://HOST:PORT or ipc://PATH")
    if scheme == "ipc":
        folder = os.path.dirname(os.path.abspath(rest))
        if not rest or not os.path.isdir(folder):
            raise ConfigError(flag, f"{address!r}: no directory {folder}")
        return
    host, colon, port = rest.rpartition(":")
    if not colon or not port.isdigit():
        raise ConfigError(flag, f"{address!r} has no port (tcp://HOST:PORT)")
    host = host.strip("[]")
    check_port("0.0.0.0" if host == "*" else host, int(port), flag)


def check_connect_address(address: str, flag: str) -> None:
    """`address` is a ZeroMQ endpoint to connect to: tcp://HOST:PORT with a port in range, or ipc://PATH."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("tcp", "ipc") or not rest:
        raise ConfigError(flag, f"{address!r} is not tcp://HOST:PORT or ipc://PATH")
    if scheme == "tcp":
        _, colon, port = rest.rpartition(":")
        if not colon or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(flag, f"{address!r} has no TCP port (1-65535)")
