"""Health of the engines the gateway has learned from `Admitted.url`.

A worker is *failing* after an engine failure (connection refused, 5xx before the first token) or a
failed health check, and answers again after one successful check. Failing workers go into
`Enqueue.excluded_workers`, so the daemon places new requests elsewhere. Checks run every
`interval_s` against `url + path` (vLLM serves `GET /health`), concurrently, with `timeout_s` each.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aiohttp

log = logging.getLogger(__name__)


class EngineUnhealthy(Exception):
    """Why a request waiting for an engine's response headers was stopped: the engine's worker failed
    its health check (the request is retried on another worker, as after an engine error)."""


class EngineHealth:
    """Learned worker URLs and the failing set.

    Args:
        session: the gateway's aiohttp ClientSession.
        interval_s / timeout_s: check period and per-check timeout (s).
        path: health path appended to each worker URL.
    """

    def __init__(
        self, session: aiohttp.ClientSession, interval_s: float = 2.0, timeout_s: float = 1.0, path: str = "/health"
    ) -> None:
        self.session = session
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.path = path
        self.urls: dict[int, str] = {}  # worker_id -> base URL
        self.failing: set[int] = set()
        # worker_id -> requests sent to it that have no response headers yet (`forward.Silence`):
        # a failed health check stops them, and they are retried on another worker
        self.waiting: dict[int, set] = {}
        self._task: asyncio.Task | None = None

    def learn(self, worker_id: int, url: str) -> None:
        """Remember a worker's URL (from an Admitted)."""
        if url and self.urls.get(worker_id) != url:
            self.urls[worker_id] = url

    def mark_failed(self, worker_id: int, why: str) -> None:
        """An engine failure seen by a request: exclude the worker until a check passes."""
        if worker_id not in self.failing:
            log.warning("engine failing worker=%d url=%s reason=%s", worker_id, self.urls.get(worker_id, "?"), why)
        self.failing.add(worker_id)

    def excluded(self) -> set[int]:
        """Worker ids to send in `excluded_workers` now (a fresh set the caller may extend).

        Fails open: when every learned worker looks down (e.g. health checks timing out on an
        overloaded host), nothing is excluded and requests are tried as the daemon places them."""
        if self.failing and self.failing.issuperset(self.urls):
            return set()
        return set(self.failing)

    async def check_once(self) -> None:
        """Check every learned URL once; update the failing set."""
        items = list(self.urls.items())
        results = await asyncio.gather(*(self._check(url) for _, url in items))
        for (wid, url), ok in zip(items, results, strict=True):
            if ok and wid in self.failing:
                self.failing.discard(wid)
                log.info("engine healthy again worker=%d url=%s", wid, url)
            elif not ok and wid not in self.failing:
                self.failing.add(wid)
                log.warning("engine health check failed worker=%d url=%s", wid, url)
            if not ok:
                for silence in list(self.waiting.get(wid, ())):
                    silence.abort(EngineUnhealthy(f"worker {wid} failed its health check ({url}) before it answered"))

    async def _check(self, url: str) -> bool:
        try:
            async with self.session.get(url.rstrip("/") + self.path, timeout=self.timeout) as resp:
                return resp.status == 200
        except (TimeoutError, aiohttp.ClientError, OSError):
            return False

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.check_once()
            except Exception:  # never let a bug stop the checks
                log.exception("health check pass failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
