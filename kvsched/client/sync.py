"""A thin synchronous wrapper over `SchedulerClient` for threaded routers and scripts.

The asyncio client runs on its own loop in a background thread; every call is handed over with
`run_coroutine_threadsafe`. Closing the wrapper, or dropping it unclosed (once it is collected),
closes the client (which ends its heartbeat thread) and stops that loop thread.
`SyncSchedulerClient.__init__`, `.schedule` and `.block_hashes` take exactly the arguments of
`SchedulerClient`'s (spelled out, so type checkers see them; a test compares the signatures).
"""

from __future__ import annotations

import asyncio
import os
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterable, Sequence
from types import TracebackType
from typing import Any, Literal, TypeVar

import numpy as np
import zmq

from .. import hashing
from .. import protocol as p
from .checks import BlockHashes
from .client import (
    DEFAULT_CONNECT_TIMEOUT_S,
    SchedulerClient,
    foreign_process_error,
)
from .lease import Lease

T = TypeVar("T")

CLOSE_WAIT_S = 30.0  # longest `close()` waits for the client to close on its loop (s); it takes ~ms


class SyncLease:
    """Blocking face of a `Lease`: every call runs on the client's loop thread.

    The attributes read the wrapped lease (`request_id`, `worker`, `slot`, `generation`,
    `cached_tokens`, ...; see `Lease`); `lease` is the `Lease` itself.
    """

    def __init__(self, client: SyncSchedulerClient, lease: Lease) -> None:
        self._client = client
        self.lease = lease

    @property
    def request_id(self) -> str:
        return self.lease.request_id

    @property
    def worker(self) -> p.WorkerKey:
        """(worker_id, dp_rank) to send the request to."""
        return self.lease.worker

    @property
    def slot(self) -> int:
        return self.lease.slot

    @property
    def generation(self) -> int:
        return self.lease.generation

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens already cached on the chosen worker."""
        return self.lease.cached_tokens

    @property
    def overlap_blocks(self) -> int:
        return self.lease.overlap_blocks

    @property
    def queued_us(self) -> int:
        """Time the request waited in the daemon (µs)."""
        return self.lease.queued_us

    @property
    def isl_tokens(self) -> int:
        return self.lease.isl_tokens

    @property
    def degraded(self) -> bool:
        """True for a lease made locally while the daemon was unavailable (bypass mode)."""
        return self.lease.degraded

    @property
    def output_tokens(self) -> int:
        return self.lease.output_tokens

    @property
    def outcome(self) -> str | None:
        """None while open; then how it closed (see `Lease.outcome`)."""
        return self.lease.outcome

    @property
    def lost_reason(self) -> str:
        """Why the daemon dropped the lease ("" unless outcome is "lost" or "revoked"; see `Lease`)."""
        return self.lease.lost_reason

    @property
    def closed(self) -> bool:
        return self.lease.closed

    @property
    def url(self) -> str:
        """The worker's base URL from the daemon (`Admitted.url`; "" when none is configured)."""
        return self.lease.url

    @property
    def dp_size(self) -> int:
        """Ranks of the worker (> 1: tell a vLLM engine the rank, `X-data-parallel-rank`)."""
        return self.lease.dp_size

    def dispatched(self) -> None:
        """`Lease.dispatched`."""
        self._client.call(self.lease.dispatched)

    def prefill_done(self) -> None:
        """`Lease.prefill_done`."""
        self._client.call(self.lease.prefill_done)

    def add_output_tokens(self, n: int) -> None:
        """`Lease.add_output_tokens` (n output tokens more)."""
        self._client.call(self.lease.add_output_tokens, n)

    def on_dropped(self, callback: Callable[[SyncLease], None] | None) -> None:
        """`Lease.on_dropped`: `callback(this SyncLease)` runs once on the client's loop thread when
        the daemon drops the lease ("lost" or "revoked"); keep it short and thread-safe."""
        fn = None if callback is None else (lambda _lease: callback(self))
        self._client.call(self.lease.on_dropped, fn)

    def release(
        self, outcome: Literal["completed", "aborted"] = "completed", context_tokens: int | None = None
    ) -> None:
        """`Lease.release`."""
        self._client.call(self.lease.release, outcome, context_tokens)

    def requeue(self) -> SyncLease:
        """`Lease.requeue`: blocks until the request is admitted again; returns the new lease."""
        return SyncLease(self._client, self._client.run(self.lease.requeue()))

    def __enter__(self) -> SyncLease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.lease.outcome is None:
            self.release("completed" if exc_type is None else "aborted")


class SyncSchedulerClient:
    """Blocking face of `SchedulerClient`: same arguments, same errors; connects in `__init__`.

    Raises (from `__init__`): `DaemonUnavailable` / `ProtocolError` as `SchedulerClient.connect`.

    Usage:
        with SyncSchedulerClient() as client:
            with client.schedule("r1", isl_tokens=800) as lease:
                pass  # send the request to lease.worker, stream, report progress
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        instance: str = "default",
        client_name: str = "",
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        reconnect_deadline_s: float = 30.0,
        on_unavailable: Literal["fail", "bypass"] = "fail",
        bypass_workers: Iterable[tuple[int, int]] = (),
        attach_progress: bool = True,
        curve_server_key: str | bytes | None = None,
        curve_client_keys: tuple[bytes, bytes] | None = None,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        protocol_version: int = p.PROTOCOL_VERSION,
    ) -> None:
        self._pid = os.getpid()  # the process whose loop thread serves this wrapper
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=_serve, args=(self._loop,), name="kvsched-client", daemon=True)
        self._thread.start()
        try:
            self._client = SchedulerClient(
                endpoint,
                instance=instance,
                client_name=client_name,
                connect_timeout_s=connect_timeout_s,
                reconnect_deadline_s=reconnect_deadline_s,
                on_unavailable=on_unavailable,
                bypass_workers=bypass_workers,
                attach_progress=attach_progress,
                curve_server_key=curve_server_key,
                curve_client_keys=curve_client_keys,
                ctx=ctx,
                protocol_version=protocol_version,
            )
            self.run(self._client.connect())
        except BaseException:
            self._stop_loop()
            raise
        # Neither the loop thread nor the client refers to this wrapper: dropped unclosed, it is
        # collected, and this closes the client and ends both threads.
        self._closer = weakref.finalize(self, _shut_down, self._loop, self._thread, self._client)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` (e.g. a call of the asyncio client, `.client`) on the loop thread and wait for its
        result (at most `timeout` s; None: no limit).

        Raises:
            KvschedError: in a forked child (`foreign_process_error`): the loop thread lives in the
                parent only, so the call would wait forever.
        """
        wrong = foreign_process_error(self._pid)
        if wrong is not None:
            coro.close()
            raise wrong
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    @property
    def client(self) -> SchedulerClient:
        """The wrapped asyncio client (use it only from its loop thread)."""
        return self._client

    @property
    def welcome(self) -> p.Welcome | None:
        """The daemon's last `Welcome` (block size, epoch, limits), or None before the first."""
        return self._client.welcome

    def block_hashes(
        self,
        token_ids: Sequence[int] | np.ndarray,
        *,
        mode: Literal["vllm", "xxhash"] = "vllm",
        extra_keys: Sequence[Any] | None = None,
        cache: hashing.BlockHashCache | None = None,
    ) -> np.ndarray:
        """`SchedulerClient.block_hashes` (the daemon's block size and `kv_hash_seed`): same arguments
        and errors. Runs in the calling thread: it only reads the last `Welcome` (an immutable frame),
        so hashing never queues behind the client's loop thread."""
        return self._client.block_hashes(token_ids, mode=mode, extra_keys=extra_keys, cache=cache)

    def schedule(
        self,
        request_id: str,
        isl_tokens: int,
        block_hashes: BlockHashes | None = None,
        *,
        policy_class: str = "",
        priority: int = 0,
        strict_priority: int = 0,
        session_id: str | None = None,
        expected_osl: int | None = None,
        pinned: tuple[int, int] | None = None,
        allowed_workers: Iterable[int] | None = None,
        do_not_queue: bool = False,
        deadline_ms: int | None = None,
        lora_name: str | None = None,
        excluded_workers: Iterable[int] | None = None,
    ) -> SyncLease:
        """Blocking `SchedulerClient.schedule`: same arguments and errors; returns a `SyncLease`."""
        lease = self.run(
            self._client.schedule(
                request_id,
                isl_tokens,
                block_hashes,
                policy_class=policy_class,
                priority=priority,
                strict_priority=strict_priority,
                session_id=session_id,
                expected_osl=expected_osl,
                pinned=pinned,
                allowed_workers=allowed_workers,
                do_not_queue=do_not_queue,
                deadline_ms=deadline_ms,
                lora_name=lora_name,
                excluded_workers=excluded_workers,
            )
        )
        return SyncLease(self, lease)

    def call(self, fn: Callable[..., T], *args: object) -> T:
        """Run `fn(*args)` on the client's loop thread and return its result: anything that touches the
        asyncio client or its leases goes through here (ZeroMQ sockets are not thread-safe)."""

        async def call() -> T:
            return fn(*args)

        return self.run(call())

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def close(self) -> None:
        """Abort open leases, fail waiting calls, close the socket, end the heartbeat thread and stop
        the loop thread (idempotent). In a forked child it does nothing: the connection and the loop
        thread are the parent's."""
        if os.getpid() != self._pid:
            return
        self._closer()

    def __enter__(self) -> SyncSchedulerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(loop: asyncio.AbstractEventLoop) -> None:
    """The loop thread: run `loop` until stopped, then close it."""
    try:
        loop.run_forever()
    finally:
        loop.close()


def _shut_down(loop: asyncio.AbstractEventLoop, thread: threading.Thread, client: SchedulerClient) -> None:
    """Close `client` on `loop`, then stop the loop (its thread closes it). Waits for both unless it
    runs on the loop thread itself (a collection can happen there): the loop then stops after the close."""
    if loop.is_closed() or not thread.is_alive():
        return
    if threading.current_thread() is thread:

        async def close_then_stop() -> None:
            try:
                await client.close()
            finally:
                loop.stop()

        loop.create_task(close_then_stop())
        return
    try:
        asyncio.run_coroutine_threadsafe(client.close(), loop).result(CLOSE_WAIT_S)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_WAIT_S)
