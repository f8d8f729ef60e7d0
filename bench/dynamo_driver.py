"""NVIDIA Dynamo's selector as a baseline, through its standalone selection service.

Install: `pip install -e '.[bench-dynamo]'` (`ai-dynamo-runtime>=1.6,<1.7`, a manylinux_2_28 wheel;
runs on CPU). One module for every bench that drives Dynamo (routing quality, transport).

The service (`python -m dynamo.select_service --port P`) keeps its own KV index fed by the engines'
vLLM-format KV events and its own active-load bookkeeping, with Dynamo's cost and defaults
(overlap_score_credit 1.0, prefill_load_scale 1.0, temperature 0, as its start-up log prints).
HTTP API used here (JSON bodies):

* `POST /workers` {worker_id, endpoint, block_size, kv_events_endpoints: {"<dp rank>": url}} —
  a worker is schedulable once it has an endpoint, a block size > 0 and a KV-event endpoint;
* `POST /select_and_reserve` {token_ids} → {selection_id, worker_id, dp_rank, overlap{gpu, ...},
  effective_prefill_tokens, ...}; `POST /reservations/{id}/prefill_complete`; `DELETE /reservations/{id}`;
* `POST /overlap_scores` {token_ids} → per worker `device_blocks` (cached leading blocks).

Dynamo identifies blocks by token ids: a `BlockStored` event without `token_ids` is dropped. The
traces carry only block hash ids, so engines publish synthetic token ids for every
block (`kvsched.sim.tokens`, `FleetParams.kv_token_ids`; the same ids for every request sharing that block) and requests are sent as the
concatenation of their blocks' ids.

Status: this client, the service lifecycle and the overlap check (`overlap_agrees`) work against
the real service; the wall-clock replay with Dynamo routing the simulated fleet (routers calling it
instead of the daemon, engines publishing token ids) is not written yet.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

def dynamo_unavailable_reason() -> str | None:
    """None when the service can run here; else why not (benches print it and skip `dynamo`)."""
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.select_service") is None:
        return "package ai-dynamo-runtime not installed (pip install -e '.[bench-dynamo]')"
    return None


def request_token_ids(block_hashes, block_size: int) -> list[int]:
    """A request's prompt as token ids: its blocks' synthetic ids (`kvsched.sim.tokens`), concatenated."""
    from kvsched.sim.tokens import token_ids_for

    return token_ids_for(block_hashes, block_size)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DynamoService:
    """A `dynamo.select_service` child process and a small HTTP client for it (module docstring).

    Use as a context manager; `start()` waits until `GET /workers` answers (RuntimeError after
    `start_timeout_s`). Errors from the service raise `DynamoError` with its message.
    """

    def __init__(self, port: int | None = None, threads: int = 1, start_timeout_s: float = 30.0) -> None:
        self.port = port or _free_port()
        self.threads = threads
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None
        self.base = f"http://127.0.0.1:{self.port}"

    def start(self) -> "DynamoService":
        self.proc = subprocess.Popen([sys.executable, "-m", "dynamo.select_service", "--port", str(self.port),
                                      "--threads", str(self.threads)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynamo.select_service exited with {self.proc.returncode}")
            try:
                self._call("GET", "/workers")
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"dynamo.select_service did not answer on {self.base} within {self.start_timeout_s} s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "DynamoService":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _call(self, method: str, path: str, body: dict | None = None) -> dict | list | None:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method,
                                     headers={"content-type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise DynamoError(f"{method} {path}: HTTP {e.code} {e.read()[:300]!r}") from None
        return json.loads(raw) if raw else None

    def add_worker(self, worker_id: int, block_size: int, kv_events_endpoint: str, endpoint: str | None = None,
                   dp_rank: int = 0) -> dict:
        """Register one engine (one DP rank) with its KV-event PUB endpoint; returns the service's record."""
        return self._call("POST", "/workers", {"worker_id": worker_id, "endpoint": endpoint or f"http://sim/{worker_id}",
                                               "block_size": block_size,
                                               "kv_events_endpoints": {str(dp_rank): kv_events_endpoint}})

    def select_and_reserve(self, token_ids: list[int]) -> dict:
        """Pick and book a worker: {selection_id, worker_id, dp_rank, overlap{gpu}, effective_prefill_tokens, ...}."""
        return self._call("POST", "/select_and_reserve", {"token_ids": token_ids})

    def prefill_complete(self, selection_id: str) -> None:
        self._call("POST", f"/reservations/{selection_id}/prefill_complete", {})

    def release(self, selection_id: str) -> None:
        self._call("DELETE", f"/reservations/{selection_id}")

    def overlap_blocks(self, token_ids: list[int]) -> dict[tuple[int, int], int]:
        """(worker_id, dp_rank) -> cached leading blocks of `token_ids`, as the service sees them."""
        rep = self._call("POST", "/overlap_scores", {"token_ids": token_ids})
        return {(w["worker_id"], w["dp_rank"]): int(w["device_blocks"]) for w in rep["workers"]}


class DynamoError(RuntimeError):
    """The selection service answered with an error (message included)."""


def overlap_agrees(block_size: int = 16, blocks: int = 4, settle_s: float = 1.0) -> dict:
    """Start the service, register one worker whose KV events come from kvsched's vLLM-format publisher,
    publish one BlockStored of `blocks` blocks with synthetic token ids and check that the service
    sees exactly that overlap for a request extending them (the daemon's overlap for the same events
    is `blocks`). Returns {"agrees", "dynamo_blocks", "expected_blocks"}."""
    import zmq

    from kvsched.kvevents.publisher import KvEventPublisher

    ctx = zmq.Context.instance()
    port = _free_port()
    pub = KvEventPublisher(ctx, f"tcp://127.0.0.1:{port}")
    hashes = [0xABC0 + k for k in range(blocks + 2)]
    stored, query = hashes[:blocks], hashes
    try:
        with DynamoService() as svc:
            svc.add_worker(1, block_size, f"tcp://127.0.0.1:{port}")
            seen = 0
            deadline = time.monotonic() + 10 * settle_s
            while time.monotonic() < deadline and seen < blocks:  # PUB/SUB slow joiner: resend until seen
                pub.block_stored(stored, None, block_size, token_ids=request_token_ids(stored, block_size))
                pub.flush()
                time.sleep(settle_s)
                seen = svc.overlap_blocks(request_token_ids(query, block_size)).get((1, 0), 0)
            return {"agrees": seen == blocks, "dynamo_blocks": seen, "expected_blocks": blocks}
    finally:
        pub.close()
