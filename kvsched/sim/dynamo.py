"""NVIDIA Dynamo's standalone selection service as a replay router (`kvsched replay --router-via dynamo`).

Install: `pip install -e '.[bench-dynamo]'` (`ai-dynamo-runtime>=1.6,<1.7`, a manylinux_2_28 wheel;
runs on CPU). `DynamoService` starts `python -m dynamo.select_service --port P` and registers each
simulated engine; `DynamoRoute` is one router process's asynchronous client (one aiohttp
keep-alive session per router).

The service keeps its own KV index fed by the engines' vLLM-format KV events and its own active-load
bookkeeping, with Dynamo's cost and defaults (overlap_score_credit 1.0, prefill_load_scale 1.0,
temperature 0, as its start-up log prints). HTTP API used (JSON bodies; Dynamo's select_service):

* `POST /workers` {worker_id, endpoint, block_size, kv_events_endpoints: {"<dp rank>": url}} —
  a worker is schedulable once it has an endpoint, a block size > 0 and a KV-event endpoint;
* `POST /select_and_reserve` {token_ids} → {selection_id, worker_id, dp_rank, overlap{gpu: cached tokens, ...}, ...};
  `POST /reservations/{id}/prefill_complete`; `DELETE /reservations/{id}`;
* `POST /overlap_scores` {token_ids} → {workers: [{worker_id, dp_rank, device_blocks, ...}]}.

Dynamo identifies blocks by token ids: a `BlockStored` event without `token_ids` is dropped. The
traces carry only block hash ids, so engines publish synthetic token ids per block
(`kvsched.sim.tokens`, `FleetParams.kv_token_ids`) and a request is sent as its blocks' ids
concatenated (`token_ids_for`).
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
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..protocol import WorkerKey

try:  # the HTTP client of `DynamoRoute`: the optional extra `kvsched[bench-dynamo]` (or `[gateway]`)
    import aiohttp
except ImportError:  # a replay without Dynamo never opens a DynamoRoute
    HAVE_AIOHTTP = False
else:
    HAVE_AIOHTTP = True


def dynamo_unavailable_reason() -> str | None:
    """None when the service can run here; else why not (benches print it and skip `dynamo`)."""
    if importlib.util.find_spec("dynamo") is None or importlib.util.find_spec("dynamo.select_service") is None:
        return "package ai-dynamo-runtime not installed (pip install -e '.[bench-dynamo]')"
    return None


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

    def start(self) -> DynamoService:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.select_service", "--port", str(self.port), "--threads", str(self.threads)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
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

    def __enter__(self) -> DynamoService:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            self.base + path, data=data, method=method, headers={"content-type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            raise DynamoError(f"{method} {path}: HTTP {e.code} {e.read()[:300]!r}") from None
        return json.loads(raw) if raw else None

    def add_worker(
        self, worker_id: int, block_size: int, kv_events_endpoint: str, endpoint: str | None = None, dp_rank: int = 0
    ) -> dict:
        """Register one engine (one DP rank) with its KV-event PUB endpoint; returns the service's record."""
        return self._call(
            "POST",
            "/workers",
            {
                "worker_id": worker_id,
                "endpoint": endpoint or f"http://sim/{worker_id}",
                "block_size": block_size,
                "kv_events_endpoints": {str(dp_rank): kv_events_endpoint},
            },
        )

    def register_fleet(self, keys: Iterable[WorkerKey], pubs: Sequence[str], block_size: int) -> None:
        """Register every engine: `keys` (WorkerKey per engine) and `pubs` (its KV-event PUB endpoint), one
        POST /workers per worker id with the endpoints of all its DP ranks."""
        by_worker: dict[int, dict[str, str]] = {}
        for key, pub in zip(keys, pubs, strict=False):  # no KV events (pubs empty): nothing registered
            by_worker.setdefault(int(key.worker_id), {})[str(int(key.dp_rank))] = pub
        for wid, eps in by_worker.items():
            self._call(
                "POST",
                "/workers",
                {
                    "worker_id": wid,
                    "endpoint": f"http://sim/{wid}",
                    "block_size": block_size,
                    "kv_events_endpoints": eps,
                },
            )

    def overlap_blocks(self, token_ids: list[int]) -> dict[tuple[int, int], int]:
        """(worker_id, dp_rank) -> cached leading blocks of `token_ids`, as the service sees them."""
        rep = self._call("POST", "/overlap_scores", {"token_ids": token_ids})
        return {(w["worker_id"], w["dp_rank"]): int(w["device_blocks"]) for w in rep["workers"]}


class DynamoError(RuntimeError):
    """The selection service answered with an error (message included)."""


class DynamoRoute:
    """One router's asynchronous client of a running service (module docstring); `await open()` first.

    Errors: `DynamoError` (HTTP status >= 400, with the service's message); aiohttp's ClientError
    on connection failures.
    """

    def __init__(self, base_url: str) -> None:
        self.base = base_url.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        if not HAVE_AIOHTTP:
            raise RuntimeError("routing via Dynamo needs aiohttp: pip install -e '.[bench-dynamo]'")
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=64, keepalive_timeout=60), timeout=aiohttp.ClientTimeout(total=30)
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        assert self.session is not None, "open() first"
        async with self.session.request(method, self.base + path, json=body) as resp:
            raw = await resp.read()
            if resp.status >= 400:
                raise DynamoError(f"{method} {path}: HTTP {resp.status} {raw[:300]!r}")
        return json.loads(raw) if raw else None

    async def select_and_reserve(self, token_ids: list[int]) -> dict:
        """{selection_id, worker_id, dp_rank, overlap{gpu}, ...}: the chosen worker, booked."""
        return await self._call("POST", "/select_and_reserve", {"token_ids": token_ids})

    async def prefill_complete(self, selection_id: str) -> None:
        await self._call("POST", f"/reservations/{selection_id}/prefill_complete", {})

    async def release(self, selection_id: str) -> None:
        await self._call("DELETE", f"/reservations/{selection_id}")

    async def overlap_blocks(self, token_ids: list[int]) -> dict[str, int]:
        """ "worker:rank" -> cached leading blocks of `token_ids` as the service sees them."""
        rep = await self._call("POST", "/overlap_scores", {"token_ids": token_ids})
        return {f"{w['worker_id']}:{w['dp_rank']}": int(w["device_blocks"]) for w in rep["workers"]}
