"""Where a daemon's sockets are: endpoint discovery and endpoint syntax (docs/DESIGN.md §1.2).

The ground floor shared by the daemon, the routers' client, the CLI and the gateway: it imports
only the standard library, so a router process finds its daemon without loading the server's
configuration tree or the scheduling core.

Discovery, first match wins: the `KVSCHED_ENDPOINT` / `KVSCHED_ADMIN_ENDPOINT` environment
variables, then the configured endpoint, then `ipc://<runtime dir>/<instance>.sock` (data) and
`ipc://<runtime dir>/<instance>-admin.sock` (admin), where the runtime dir is `/run/kvsched` when it
exists (the systemd units' `RuntimeDirectory=kvsched`), else `$XDG_RUNTIME_DIR/kvsched`, else
`/tmp/kvsched-<uid>`. That is the order for routers and the CLI (`data_endpoint`, `admin_endpoint`).
The daemon binds its configured endpoint first (`daemon_endpoints`): the variables tell routers and
the CLI where to connect, and apply to the daemon only when its config leaves the endpoint "".
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path

SYSTEM_RUNTIME_DIR = Path("/run/kvsched")


def runtime_dir(env: Mapping[str, str] | None = None) -> Path:
    """`/run/kvsched` if it exists, else `$XDG_RUNTIME_DIR/kvsched`, else `/tmp/kvsched-<uid>`.

    Args:
        env: environment mapping (default `os.environ`).
    """
    env = os.environ if env is None else env
    if SYSTEM_RUNTIME_DIR.is_dir():
        return SYSTEM_RUNTIME_DIR
    xdg = env.get("XDG_RUNTIME_DIR")
    if xdg:
        return Path(xdg) / "kvsched"
    return Path(f"/tmp/kvsched-{os.getuid()}")


# A daemon instance name: it names the ipc sockets and the /dev/shm segments, so no path separators.
INSTANCE_PATTERN = r"^[A-Za-z0-9_.-]{1,64}$"


def instance_problem(name: str) -> str | None:
    """Why `name` cannot be an instance name (it would leave the runtime directory or name nothing), or None."""
    if not re.match(INSTANCE_PATTERN, name):
        return f"instance name {name!r}: 1-64 characters of A-Z a-z 0-9 _ . - (it names sockets and segments)"
    return None


def _discover(variable: str, configured: str, socket_name: str, env: Mapping[str, str] | None) -> str:
    env = os.environ if env is None else env
    return env.get(variable) or configured or f"ipc://{runtime_dir(env)}/{socket_name}"


def data_endpoint(instance: str = "default", configured: str = "", env: Mapping[str, str] | None = None) -> str:
    """The data socket endpoint: `KVSCHED_ENDPOINT`, else the configured one, else ipc discovery
    (`<runtime dir>/<instance>.sock`). `env` defaults to `os.environ`."""
    return _discover("KVSCHED_ENDPOINT", configured, f"{instance}.sock", env)


def admin_endpoint(instance: str = "default", configured: str = "", env: Mapping[str, str] | None = None) -> str:
    """The admin socket endpoint: `KVSCHED_ADMIN_ENDPOINT`, else configured, else `<instance>-admin.sock`."""
    return _discover("KVSCHED_ADMIN_ENDPOINT", configured, f"{instance}-admin.sock", env)


def daemon_endpoints(
    instance: str, configured: str, configured_admin: str, env: Mapping[str, str] | None = None
) -> tuple[tuple[str, str], tuple[str, str]]:
    """The endpoints a daemon binds, each with where it came from: ((data, source), (admin, source)).

    A non-empty configured endpoint wins (source "config"); else `KVSCHED_ENDPOINT` /
    `KVSCHED_ADMIN_ENDPOINT` (source: the variable's name), the discovery variables of routers and
    the CLI; else the runtime dir path (source "discovery"). `env` defaults to `os.environ`.
    """
    env = os.environ if env is None else env
    out = []
    for variable, value, socket_name in (
        ("KVSCHED_ENDPOINT", configured, f"{instance}.sock"),
        ("KVSCHED_ADMIN_ENDPOINT", configured_admin, f"{instance}-admin.sock"),
    ):
        if value:
            out.append((value, "config"))
        elif env.get(variable):
            out.append((env[variable], variable))
        else:
            out.append((f"ipc://{runtime_dir(env)}/{socket_name}", "discovery"))
    return out[0], out[1]


MAX_IPC_PATH_BYTES = 107  # sun_path of a Unix socket address is 108 bytes on Linux, NUL included (unix(7))


def endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a ZeroMQ endpoint string, or None when it is well formed.

    Accepted: `ipc://PATH` (at most `MAX_IPC_PATH_BYTES` bytes), `inproc://NAME`, `tcp://HOST:PORT`
    (PORT 1..65535, or `*` for an ephemeral bind). ZeroMQ itself reports a missing port only when the socket
    connects, at which
    point a daemon has already started; checking here makes it a config error (zmq_tcp(7)).
    """
    scheme, sep, rest = endpoint.partition("://")
    if not sep:
        return "expected ipc://PATH, tcp://HOST:PORT or inproc://NAME"
    if scheme in ("ipc", "inproc"):
        if scheme == "ipc" and len(rest.encode()) > MAX_IPC_PATH_BYTES:  # the bind / connect would fail
            return f"the ipc path is {len(rest.encode())} bytes; a Unix socket path holds at most {MAX_IPC_PATH_BYTES}"
        return None if rest else f"{scheme}:// needs a name"
    if scheme != "tcp":
        return f"unsupported transport {scheme!r} (ipc, tcp or inproc)"
    host, colon, port = rest.rpartition(":")
    if not colon or not host or host == "[]":
        return "tcp:// needs HOST:PORT"
    if port == "*":
        return None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"port {port!r} is not in 1..65535"
    return None


def connect_problem(endpoint: str) -> str | None:
    """`endpoint_problem` for an address a client connects to: a `*` host or port (any interface,
    an ephemeral port) is only meaningful when binding, so `tcp://*:5555` is refused here."""
    problem = endpoint_problem(endpoint)
    if problem is None and endpoint.startswith("tcp://"):
        host, _, port = endpoint[len("tcp://") :].rpartition(":")
        if host == "*" or port == "*":
            return "'*' only binds; connect to the daemon's HOST:PORT"
    return problem


def is_loopback_endpoint(endpoint: str) -> bool:
    """True for `tcp://127.x:P`, `tcp://[::1]:P` and `tcp://localhost:P`."""
    host = endpoint.partition("://")[2].rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def missing_ipc_path(endpoint: str) -> str | None:
    """The socket path of an `ipc://` endpoint when that file does not exist, else None.

    An abstract-namespace endpoint (`ipc://@name`) has no file and is never reported missing.
    """
    if not endpoint.startswith("ipc://"):
        return None
    path = endpoint[len("ipc://") :]
    if path.startswith("@") or os.path.exists(path):
        return None
    return path
