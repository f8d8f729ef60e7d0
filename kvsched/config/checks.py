"""Checks of the addresses a config names: an engine's base URL and the CURVE rule for TCP endpoints
(the sections' cross-field rules use them; `loader.check_endpoints` checks a whole config's endpoints)."""

from __future__ import annotations

from urllib.parse import urlsplit

from ..endpoints import is_loopback_endpoint


def url_problem(url: str) -> str | None:
    """What is wrong with an engine's base URL (`[[workers]] url`), or None when it is usable.

    Accepted: `http://HOST[:PORT][/PATH]` and `https://...` — the gateway POSTs to URL + "/v1/..."
    (RFC 3986 syntax, checked with `urllib.parse`).
    """
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
