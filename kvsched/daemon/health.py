"""Health endpoints and the HTTP server of the metrics port (docs/DEPLOY.md "Health endpoints").

One small WSGI server thread answers four paths; anything else is 404:

* `/metrics` — the Prometheus page (prometheus_client's own WSGI app, so content negotiation,
  OpenMetrics and gzip behave as prometheus_client documents).
* `/healthz` — liveness: 200 when the actor's periodic tick ran within `[daemon] health_stall_ms`,
  503 before the first tick and while the loop is stuck. It does not depend on systemd's watchdog.
* `/readyz` — readiness: 200 once the sockets are bound and the numba kernels are warm, 503 before
  that and once shutdown has begun. Overload never makes the daemon unready.
* `/readyz?workers=1` — additionally requires one registered worker that is neither drained nor
  removed (workers may be added at run time with `kvsched add-worker`).

Thread model: `Health` is written by the actor's loop (`tick`, `mark_ready`, `mark_stopping`) and
read by the HTTP thread. Every field is a single float/int/bool assignment, atomic under the GIL;
the HTTP thread never touches scheduling state.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

import numpy as np
from prometheus_client import CollectorRegistry, make_wsgi_app

from ..errors import ConfigError
from ..shm.layout import FLAG_DRAINED


def available_workers(present: np.ndarray, flags: np.ndarray) -> int:
    """Registered workers that are neither drained nor removed.

    Args:
        present: `w_present` of the ledger, uint8 (max_workers,), 1 = registered.
        flags: `w_flags` of the ledger, uint8 (max_workers,), bit 0 = drained.
    """
    return int(np.count_nonzero((present != 0) & ((flags & FLAG_DRAINED) == 0)))


class Health:
    """The liveness and readiness facts the probes read.

    Args:
        stall_ms: `/healthz` fails when the actor's last tick is older than this (ms).
        clock: monotonic clock in seconds (tests inject one).
    """

    def __init__(self, stall_ms: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_s = stall_ms / 1000
        self.clock = clock
        self.last_tick_s: float | None = None
        self.ready = False
        self.stopping = False
        self.available_workers = 0
        self._count_workers: Callable[[], int] | None = None

    def watch_workers(self, count: Callable[[], int]) -> None:
        """Set the function (run on the actor's loop, at each tick) counting available workers."""
        self._count_workers = count

    def stamp(self) -> None:
        """An actor on-tick callback (every `progress_fold_ms`): stamp the time only."""
        self.last_tick_s = self.clock()

    def tick(self) -> None:
        """Stamp the time and refresh the available-worker count. The daemon runs it once a second
        (`Actor.on_second`): the count is a few numpy passes, too dear for every 10 ms tick, and
        workers change only by admin commands and runtime registration."""
        if self._count_workers is not None:
            self.available_workers = self._count_workers()
        self.last_tick_s = self.clock()

    def mark_ready(self) -> None:
        """Sockets are bound and kernels are warm."""
        self.ready = True

    def mark_stopping(self) -> None:
        """Shutdown began: `/readyz` answers 503 from now on."""
        self.stopping = True

    def liveness(self) -> tuple[bool, dict]:
        """(alive, details): alive when the last tick is at most `stall_s` old."""
        if self.last_tick_s is None:
            return False, {"status": "starting", "detail": "the actor loop has not ticked yet"}
        age = self.clock() - self.last_tick_s
        body = {"last_tick_age_s": round(age, 4), "stall_s": self.stall_s}
        if age > self.stall_s:
            return False, {"status": "stalled", **body}
        return True, {"status": "ok", **body}

    def readiness(self, need_workers: int = 0) -> tuple[bool, dict]:
        """(ready, details): ready when started, not stopping, and (if asked) with enough workers."""
        body = {"available_workers": self.available_workers}
        if self.stopping:
            return False, {"status": "stopping", **body}
        if not self.ready:
            return False, {"status": "starting", **body}
        if self.available_workers < need_workers:
            return False, {"status": "no_available_worker", "required_workers": need_workers, **body}
        return True, {"status": "ok", **body}


def _json(start_response, ok: bool, body: dict) -> list[bytes]:
    data = (json.dumps(body) + "\n").encode()
    start_response(
        "200 OK" if ok else "503 Service Unavailable",
        [("Content-Type", "application/json"), ("Content-Length", str(len(data))), ("Cache-Control", "no-store")],
    )
    return [data]


def make_app(health: Health, registry: CollectorRegistry):
    """The WSGI application routing `/metrics`, `/healthz`, `/readyz`; other paths are 404."""
    metrics_app = make_wsgi_app(registry)

    def app(environ, start_response) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return metrics_app(environ, start_response)
        if path == "/healthz":
            return _json(start_response, *health.liveness())
        if path == "/readyz":
            query = parse_qs(environ.get("QUERY_STRING", ""))
            try:
                need = int(query.get("workers", ["0"])[0])
            except ValueError:
                start_response("400 Bad Request", [("Content-Type", "text/plain")])
                return [b"workers must be an integer\n"]
            return _json(start_response, *health.readiness(need))
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics, /healthz, /readyz\n"]

    return app


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


# A connection must send its request within this long (s); one that does not is closed, so
# half-open connections cannot each keep a server thread forever (tests/ops/test_health.py).
REQUEST_TIMEOUT_S = 5.0


class _QuietHandler(WSGIRequestHandler):
    timeout = REQUEST_TIMEOUT_S  # socketserver.StreamRequestHandler: the connection's socket timeout

    def log_message(self, format: str, *args) -> None:  # probes every few seconds: no access log
        pass


def metrics_host_problem(host: str, port: int) -> str | None:
    """Why `HttpServer(host, port)` could not listen because of `host`, or None: resolves `host` the
    way its bind does (`socket.getaddrinfo`, the server's address family, IPv4), binds nothing (the
    port may be the running daemon's). For `kvsched-daemon --check-config`; port 0 = no metrics
    server, nothing to check. The message names `daemon.metrics_host`.
    """
    if not port or host == "":  # "" binds every address (INADDR_ANY)
        return None
    try:
        socket.getaddrinfo(host, port, _Server.address_family, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, socket.gaierror) else str(exc)
        return (
            f"daemon.metrics_host {host!r}: cannot resolve it as an IPv4 address to listen on "
            f"(metrics_port {port}): {reason}"
        )
    return None


class HttpServer:
    """The metrics port: `/metrics`, `/healthz`, `/readyz` from one daemon thread.

    Args:
        health: the `Health` facts.
        registry: the daemon's Prometheus registry.
        host / port: where to listen (port 0 picks a free one; see `.port`).
    Raises:
        ConfigError: the address cannot be bound (in use, not local, ...).
    """

    def __init__(self, health: Health, registry: CollectorRegistry, host: str, port: int) -> None:
        try:
            self._server = make_server(host, port, make_app(health, registry), _Server, handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigError(f"daemon.metrics_host/metrics_port {host}:{port}: cannot listen: {exc.strerror}") from exc
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvsched-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop serving and close the listening socket."""
        self._server.shutdown()
        self._server.server_close()
