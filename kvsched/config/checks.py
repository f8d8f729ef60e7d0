"""Checks of the addresses a config names: an engine's base URL, the CURVE rule for TCP endpoints, and
the endpoints the daemon would really bind (discovery and `KVSCHED_*ENDPOINT` included)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..endpoints import daemon_endpoints, endpoint_problem, is_loopback_endpoint

if TYPE_CHECKING:
    from .sections import Config


def url_problem(url: str) -> str | None:
    """What is wrong with an engine's base URL (`[[workers]] url`), or None when it is usable.

    Accepted: `http://HOST[:PORT][/PATH]` and `https://...` — the gateway POSTs to URL + "/v1/..."
    (RFC 3986 syntax, checked with `urllib.parse`).
    """
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError on a port that is not a number in 0..65535
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "expected http://HOST[:PORT] or https://HOST[:PORT]"
    return None


def curve_problem(endpoint: str, curve_secret_key_file: str | None) -> str | None:
    """The CURVE rule: a TCP endpoint not bound to loopback requires `daemon.curve_secret_key_file`."""
    if endpoint.startswith("tcp://") and not is_loopback_endpoint(endpoint) and not curve_secret_key_file:
        return f"{endpoint} is a TCP endpoint off loopback: it requires daemon.curve_secret_key_file (CURVE keys)"
    return None


def check_endpoints(cfg: Config, env: Mapping[str, str] | None = None) -> list[str]:
    """Problems of the endpoints the daemon would really use (discovery and `KVSCHED_*ENDPOINT`
    included): syntax (ipc path length too, `endpoint_problem`), the CURVE rule, and addresses a start
    could not bind (data = admin, an endpoint on the metrics host:port). [] = fine. Used by
    `kvsched-daemon --check-config`."""
    d = cfg.daemon
    problems = []
    (data, _), (admin, _) = daemon_endpoints(d.instance, d.endpoint, d.admin_endpoint, env)
    wild = ("*", "0.0.0.0", "")
    for what, ep in (("data endpoint", data), ("admin endpoint", admin)):
        problem = endpoint_problem(ep) or curve_problem(ep, d.curve_secret_key_file)
        if problem:
            problems.append(f"{what} {ep!r}: {problem}")
        host, _, port = ep[len("tcp://") :].rpartition(":") if ep.startswith("tcp://") else ("", "", "")
        if (
            d.metrics_port
            and port == str(d.metrics_port)
            and (host == d.metrics_host or host in wild or d.metrics_host in wild)
        ):
            problems.append(f"the {what} and daemon.metrics_host/metrics_port both use {host}:{port}")
    if data == admin:
        problems.append(f"the data and admin endpoints are the same ({data!r}): each needs its own socket")
    if d.curve_secret_key_file and not Path(d.curve_secret_key_file).is_file():
        problems.append(f"daemon.curve_secret_key_file {d.curve_secret_key_file}: no such file")
    return problems
