"""Where an engine listens: the default per-user ipc socket, loopback checks, stale-socket cleanup.

The default address is an `ipc://` socket in a directory only this user can enter (mode 0700), so
other local users cannot submit work or read stats; an explicit ipc address gets owner-only socket
files too. `tcp://` is for loopback unless the operator explicitly allows remote clients, and then
only with a shared-secret auth token (any local user can reach a loopback port, so a token is worth
giving there as well).
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import os
import socket
import stat
from pathlib import Path

SOCKET_NAME = "engine.sock"
# sockaddr_un.sun_path holds 108 bytes including the terminating NUL.
MAX_IPC_PATH = 107


class AddressError(ValueError):
    """The address is malformed, not allowed, or already taken."""


def runtime_dir() -> Path:
    """The per-user directory for sockets and logs, created with mode 0700 and checked to be private."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = Path(base) / "minichat" if base else Path.home() / ".cache" / "minichat"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid != os.getuid():
        raise AddressError(f"{path} belongs to another user; refusing to put the engine's socket there")
    if stat.S_IMODE(st.st_mode) & 0o077:
        path.chmod(0o700)
    return path


def default_address() -> str:
    return f"ipc://{runtime_dir() / SOCKET_NAME}"


def log_path(address: str) -> Path:
    """The known log file of a background engine at `address` (the launcher writes it)."""
    if address == default_address():
        return runtime_dir() / "engine.log"
    return runtime_dir() / f"engine-{hashlib.sha1(address.encode()).hexdigest()[:10]}.log"


def stats_address(address: str) -> str:
    """The stats PUB socket that goes with an engine address: `<path>.stats` for ipc, port + 1 for tcp."""
    scheme, rest = split(address)
    if scheme == "ipc":
        return f"ipc://{rest}.stats"
    host, port = _host_port(rest)
    return f"tcp://{host}:{port + 1}"


def split(address: str) -> tuple[str, str]:
    """('ipc', path) or ('tcp', 'host:port'); AddressError for anything else."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("ipc", "tcp") or not rest:
        raise AddressError(f"address {address!r} must look like ipc:///path/to/socket or tcp://127.0.0.1:PORT")
    if scheme == "tcp":
        _host_port(rest)
    return scheme, rest


def _host_port(rest: str) -> tuple[str, int]:
    host, _, port = rest.rpartition(":")
    bad_host = not host or (":" in host and not (host.startswith("[") and host.endswith("]")))
    if bad_host or not port.isdigit() or not 0 < int(port) < 65535:
        raise AddressError(f"tcp address 'tcp://{rest}' needs a host (an IPv6 one in brackets: [::1]) and an "
                           f"explicit port in 1..65534 (the stats socket uses port + 1)")
    return host, int(port)


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface name or a hostname: possibly reachable from outside


def check_bindable(address: str, allow_remote: bool = False, has_token: bool = False) -> None:
    """Refuse addresses an engine must not bind: malformed, too long, or non-loopback without consent
    (--allow-remote) and an auth token."""
    scheme, rest = split(address)
    if scheme == "tcp":
        host, _ = _host_port(rest)
        if not is_loopback(host) and not (allow_remote and has_token):
            raise AddressError(f"{address} is not a loopback address; to listen beyond this machine pass "
                               f"--allow-remote and an --auth-token (or MINICHAT_AUTH_TOKEN) that clients must give")
        return
    for path in (rest, rest + ".stats"):
        if len(path.encode()) > MAX_IPC_PATH:
            raise AddressError(f"ipc socket path {path!r} is longer than {MAX_IPC_PATH} bytes; choose a shorter one")


def ipc_listening(path: str) -> bool:
    """True if something accepts connections on the unix socket at `path`; a refused connect means stale."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(path)
        except OSError as e:
            if e.errno in (errno.ECONNREFUSED, errno.ENOENT):
                return False
            raise
    return True


def remove_stale_ipc(address: str) -> None:
    """Delete socket files left by an engine that died; AddressError if a live one answers there."""
    scheme, path = split(address)
    if scheme != "ipc":
        return
    Path(path).parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for p in (path, path + ".stats"):
        if not os.path.lexists(p):
            continue
        if not stat.S_ISSOCK(os.lstat(p).st_mode):
            raise AddressError(f"{p} exists and is not a socket; choose another --address")
        if ipc_listening(p):
            raise AddressError(f"another process already listens on {p}; stop it (minichat stop "
                               f"--address {address}) or choose another --address")
        os.unlink(p)
