"""The gateway's listen address: parsing `--port`, checking `host:port` before start-up, errors.

A taken port is `PortInUse` (exit 2, "cannot listen on HOST:PORT: the port is already in use ...");
any other bind failure a `ConfigError` naming `[gateway] host / port (or --host / --port)`.
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import socket

from ..errors import ConfigError

# listen(2) backlog of every gateway socket, single process or `--workers` group (aiohttp's own default is 128).
LISTEN_BACKLOG = 1024


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


def host_arg(text: str) -> str:
    """`--host`: an address or name; an IPv6 literal may come in brackets as in URLs ("[::1]" -> "::1").
    An empty value is refused (argparse then says so and exits 2) rather than silently ignored."""
    if not text:
        raise argparse.ArgumentTypeError(
            "empty; give an address or name, e.g. 127.0.0.1, or 0.0.0.0 / :: for every interface"
        )
    if text.startswith("[") or text.endswith("]"):
        inner = text[1:-1] if text.startswith("[") and text.endswith("]") else ""
        try:
            if not isinstance(ipaddress.ip_address(inner), ipaddress.IPv6Address):
                raise ValueError
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: brackets hold an IPv6 address, e.g. [::1]") from None
        return inner
    return text


def address_family(host: str) -> socket.AddressFamily:
    """The socket family to listen on `host` with: AF_INET6 for an IPv6 literal ("::1", "::"), AF_INET
    for an IPv4 literal or "", else the family of the first address `getaddrinfo` gives for the name.

    Raises socket.gaierror (an OSError) for a name that does not resolve."""
    if not host:
        return socket.AF_INET
    try:
        return socket.AF_INET6 if isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address) else socket.AF_INET
    except ValueError:  # a name, not a literal
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]


def host_port(host: str, port: int) -> str:
    """`host:port` for messages and URLs, an IPv6 literal in brackets ("[::1]:8080")."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
        # SO_REUSEADDR, and IPV6_V6ONLY for AF_INET6, as aiohttp (asyncio) binds
        socket.create_server((host, port), family=address_family(host)).close()
    except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
        raise port_error(host, port, exc) from None


def port_error(host: str, port: int, exc: Exception) -> Exception:
    """The exception to raise for a failed bind of `host:port`: PortInUse for EADDRINUSE, else ConfigError."""
    if not isinstance(exc, OSError) or (exc.errno != errno.EADDRINUSE and "address already in use" not in str(exc)):
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        return ConfigError(
            f"[gateway] host / port (or --host / --port): cannot listen on {host_port(host, port)}: {why}"
        )
    return PortInUse(
        errno.EADDRINUSE,
        f"cannot listen on {host_port(host, port)}: the port is already in use by "
        "another process; choose another with --port N (or [gateway] port), or stop that process",
    )


def listen_socket(host: str, port: int, backlog: int = LISTEN_BACKLOG) -> socket.socket:
    """A listening TCP socket on `host:port` (port 0 = a free port) that `--workers` processes inherit.

    `SO_REUSEADDR` as aiohttp sets it, no `SO_REUSEPORT`: while it is open no other socket can bind
    the port, with or without `SO_REUSEPORT`. Raises OSError when the address cannot be bound
    (EADDRINUSE: the port is taken; socket.gaierror: a host that does not resolve) or OverflowError
    for a port outside 0-65535. The family is `address_family(host)` (IPv6 hosts work)."""
    s = socket.create_server((host, port), family=address_family(host), backlog=backlog)  # SO_REUSEADDR
    s.set_inheritable(True)
    return s
