"""A thin synchronous wrapper over `SchedulerClient` for threaded routers and scripts.

The asyncio client runs on its own loop in a background thread; every call is handed over with
`run_coroutine_threadsafe`. Leases returned are the same `Lease` objects (their `with` form works).
"""

from __future__ import annotations

import asyncio
import threading

from .client import SchedulerClient
from .lease import Lease


class SyncLease:
    """Blocking face of a `Lease`: every call runs on the client's loop thread.

    Attributes mirror the lease (`request_id`, `worker`, `slot`, `generation`, `cached_tokens`, ...).
    """

    def __init__(self, client: "SyncSchedulerClient", lease: Lease) -> None:
        self._client = client
        self.lease = lease

    def __getattr__(self, name: str):
        return getattr(self.lease, name)

    def dispatched(self) -> None:
        self._client._call(self.lease.dispatched)

    def prefill_done(self) -> None:
        self._client._call(self.lease.prefill_done)

    def add_output_tokens(self, n: int) -> None:
        self._client._call(self.lease.add_output_tokens, n)

    def release(self, outcome: str = "completed", context_tokens: int | None = None) -> None:
        self._client._call(self.lease.release, outcome, context_tokens)

    def requeue(self) -> "SyncLease":
        return SyncLease(self._client, self._client._run(self.lease.requeue()))

    def __enter__(self) -> "SyncLease":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.lease.outcome is None:
            self.release("completed" if exc_type is None else "aborted")


class SyncSchedulerClient:
    """Blocking face of `SchedulerClient` (same arguments).

    Usage:
        with SyncSchedulerClient() as client:
            with client.schedule("r1", isl_tokens=800) as lease:
                pass  # send the request to lease.worker, stream, report progress
    """

    def __init__(self, *args, **kwargs) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvsched-client", daemon=True)
        self._thread.start()
        self._client = SchedulerClient(*args, **kwargs)
        self._run(self._client.connect())

    def _run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def welcome(self):
        return self._client.welcome

    def schedule(self, request_id: str, isl_tokens: int, block_hashes=None, **options) -> "SyncLease":
        """Blocking `SchedulerClient.schedule`; same arguments and errors; returns a `SyncLease`."""
        return SyncLease(self, self._run(self._client.schedule(request_id, isl_tokens, block_hashes, **options)))

    def _call(self, fn, *args):
        """Run `fn(*args)` on the client's loop thread (ZeroMQ sockets are not thread-safe)."""

        async def call():
            return fn(*args)

        return self._run(call())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self._client.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()

    def __enter__(self) -> "SyncSchedulerClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
