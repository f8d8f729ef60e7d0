"""The gateway's listen address: parsing `--port`, checking `host:port` before start-up, errors.

A taken port is `PortInUse` (exit 2, "cannot listen on HOST:PORT: the port is already in use ...");
any other bind failure a `ConfigError` naming `[gateway] host / port (or --host / --port)`.
"""

from __future__ import annotations

import argparse
import errno
import socket

from ..errors import ConfigError


class PortInUse(OSError):
    """The gateway's listen address is taken; the message names it and how to choose another."""


def port_arg(text: str) -> int:
    """`--port`: an int in 0-65535 (argparse then says so and exits 2)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def check_listen_address(host: str, port: int) -> None:
    """Bind (and close) `host:port` as the gateway will, to fail before any other start-up work.

    Args:
        host: listen address, e.g. "127.0.0.1". port: TCP port; 0 (any free port) is not checked.
    Raises:
        PortInUse: another socket listens there (EADDRINUSE); message: "cannot listen on HOST:PORT ...".
        ConfigError: any other bind failure (a host that does not resolve or is not local, a port out
            of range, permission), naming the address.
    """
    if port == 0:
        return
    try:
        socket.create_server((host, port)).close()  # SO_REUSEADDR as aiohttp's
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
        raise port_error(host, port, exc) from None


def port_error(host: str, port: int, exc: Exception) -> Exception:
    """The exception to raise for a failed bind of `host:port`: PortInUse for EADDRINUSE, else ConfigError."""
    if not isinstance(exc, OSError) or (exc.errno != errno.EADDRINUSE and "address already in use" not in str(exc)):
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return ConfigError(f"[gateway] host / port (or --host / --port): cannot listen on {host}:{port}: {why}")
    return PortInUse(errno.EADDRINUSE, f"cannot listen on {host}:{port}: the port is already in use by another "
                     "process; choose another with --port N (or [gateway] port), or stop that process")


def listen_socket(host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on `host:port` (port 0 = a free port) that `--workers` processes inherit.

    `SO_REUSEADDR` as aiohttp sets it, no `SO_REUSEPORT`: while it is open no other socket can bind
    the port, with or without `SO_REUSEPORT`. Raises OSError when the address cannot be bound
    (EADDRINUSE: the port is taken) or OverflowError for a port outside 0-65535."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(backlog)
    except (OSError, OverflowError):
        s.close()
        raise
    s.set_inheritable(True)
    return s
