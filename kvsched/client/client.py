"""`SchedulerClient`: one DEALER connection per router process, shared by its coroutines (SPEC §1, §5).

I/O follows the daemon's own pattern: a plain (non-asyncio) ZeroMQ socket whose FD is registered with
`loop.add_reader` and drained with NOBLOCK; each waiting `schedule()` is a future keyed by request_id.
Cancelling a caller still waiting in `schedule()` sends `Release(cancelled)`; an `Admitted` that
arrives for a request nobody waits for any more is released at once, so nothing leaks.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import weakref
from typing import Iterable

import msgspec
import numpy as np
import zmq

from .. import protocol as p
from ..config import data_endpoint
from ..core.types import WorkerKey
from ..errors import DaemonUnavailable, ProtocolError, rejection_error
from .lease import Lease

log = logging.getLogger(__name__)


class SchedulerClient:
    """Asyncio client of one kvsched daemon.

    Args:
        endpoint: data socket; None = discovery (`KVSCHED_ENDPOINT`, else the ipc path of `instance`).
        instance: daemon instance name used by discovery.
        client_name: shown in the daemon's logs and `kvsched status`.
        connect_timeout_s: seconds to wait for `Welcome` before raising `DaemonUnavailable`.
        attach_progress: map the progress segment to report output tokens without frames (local
            routers); falls back to `Update(progress)` frames when it cannot be mapped.
        ctx: a zmq.Context to use (default: a private one).
    Usage:
        async with SchedulerClient() as client:
            lease = await client.schedule(request_id="r1", isl_tokens=812, block_hashes=hashes)
            async with lease:
                ...  # send to lease.worker, stream, lease.add_output_tokens(n)
    """

    def __init__(self, endpoint: str | None = None, *, instance: str = "default", client_name: str = "",
                 connect_timeout_s: float = 5.0, attach_progress: bool = True, ctx: zmq.Context | None = None) -> None:
        self.endpoint = endpoint or data_endpoint(instance)
        self.client_name = client_name or f"router-{os.getpid()}"
        self.connect_timeout_s = connect_timeout_s
        self.attach_progress = attach_progress
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self._sock: zmq.Socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._enc = p.make_encoder()
        self._dec = p.make_daemon_decoder()
        self._pending: dict[str, asyncio.Future] = {}
        self._leases: dict[str, weakref.ref] = {}
        self._isl: dict[str, int] = {}
        self._welcome_fut: asyncio.Future | None = None
        self.welcome: p.Welcome | None = None
        self._progress: np.ndarray | None = None
        self._segments = None
        self._last_send = 0.0
        self._hb_seq = 0
        self._hb_handle: asyncio.TimerHandle | None = None
        self.errors: list[p.Error] = []  # Error frames not tied to a waiting call (for diagnostics)

    # ------------------------------------------------------------------ connection
    async def connect(self) -> "SchedulerClient":
        """Open the DEALER, say Hello, wait for Welcome.

        Raises:
            DaemonUnavailable: no Welcome within `connect_timeout_s` (names the endpoint).
            ProtocolError: the daemon refused our protocol version.
        """
        self._loop = asyncio.get_running_loop()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        sock.connect(self.endpoint)
        self._sock = sock
        self._loop.add_reader(sock.getsockopt(zmq.FD), self._on_readable)
        self._welcome_fut = self._loop.create_future()
        self._send(p.Hello(p.PROTOCOL_VERSION, self.client_name[:128], os.getpid(), socket.gethostname()[:128]))
        try:
            self.welcome = await asyncio.wait_for(self._welcome_fut, self.connect_timeout_s)
        except asyncio.TimeoutError:
            await self.close()
            raise DaemonUnavailable(
                f"no kvsched daemon answered at {self.endpoint} within {self.connect_timeout_s:.1f}s"
            ) from None
        except ProtocolError:
            await self.close()
            raise
        if self.attach_progress:
            self._attach_progress(self.welcome)
        self._schedule_heartbeat()
        return self

    def _attach_progress(self, welcome: p.Welcome) -> None:
        prefix, suffix = "kvsched-", "-ledger"
        name = welcome.shm_ledger
        if not (name.startswith(prefix) and name.endswith(suffix)):
            return
        try:
            from ..shm.layout import attach_segments

            self._segments = attach_segments(name[len(prefix):-len(suffix)], writable_ledger=False)
            self._progress = self._segments.progress
        except Exception as exc:  # remote host, permissions, layout mismatch: fall back to frames
            log.info("progress segment not mapped (using Update frames) reason=%s", exc)
            self._progress = None

    async def close(self) -> None:
        """Abort every open lease, fail every waiting call, close the socket."""
        for ref in list(self._leases.values()):
            lease = ref()
            if lease is not None and lease.outcome is None:
                lease.release("aborted")
        for rid, fut in list(self._pending.items()):
            if not fut.done():
                fut.set_exception(DaemonUnavailable(f"client closed while {rid!r} was waiting"))
        self._pending.clear()
        if self._hb_handle is not None:
            self._hb_handle.cancel()
        if self._sock is not None:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.remove_reader(self._sock.getsockopt(zmq.FD))
            self._sock.close(0)
            self._sock = None
        if self._segments is not None:
            self._progress = None
            try:
                self._segments.close()
            except BufferError:  # a numpy view is still alive somewhere; the mapping goes with the process
                pass
            self._segments = None
        if self._own_ctx:
            self._ctx.term()

    async def __aenter__(self) -> "SchedulerClient":
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ scheduling
    async def schedule(self, request_id: str, isl_tokens: int, block_hashes=None, *, policy_class: str = "",
                       priority: int = 0, strict_priority: int = 0, session_id: str | None = None,
                       expected_osl: int | None = None, pinned: tuple[int, int] | None = None,
                       allowed_workers: Iterable[int] | None = None, do_not_queue: bool = False,
                       deadline_ms: int | None = None, lora_name: str | None = None) -> Lease:
        """Ask whether `request_id` may run now and where; wait until it is admitted or rejected.

        Args:
            request_id: unique among this daemon's live requests (<= 128 UTF-8 bytes).
            isl_tokens: prompt tokens (>= 1).
            block_hashes: chained prefix-block hashes: uint64 array, list of ints, or little-endian
                u64 bytes; at most ceil(isl_tokens / block_size) of them.
            pinned: (worker_id, dp_rank) the request must run on. allowed_workers: worker ids it may use.
            deadline_ms: the longest it may wait in the queue.
            (other options: SPEC §2 `Enqueue`.)
        Returns:
            An open `Lease`.
        Raises:
            RequestRejected subclass: the daemon's reason (QueueFull, NoEndpoints, QueueTimeout, ...).
            DaemonUnavailable: not connected.
            ValueError: malformed block_hashes.
        """
        if self._sock is None or self._loop is None:
            raise DaemonUnavailable(f"not connected to {self.endpoint}; call connect() first")
        frame = p.Enqueue(
            request_id, isl_tokens, p.hashes_to_bytes(block_hashes if block_hashes is not None else b""),
            policy_class, priority, strict_priority, session_id, expected_osl,
            tuple(pinned) if pinned is not None else None,
            list(allowed_workers) if allowed_workers is not None else None, do_not_queue, deadline_ms, lora_name,
        )
        return await self._await_admission(request_id, isl_tokens, frame)

    async def _await_admission(self, request_id: str, isl_tokens: int, frame) -> Lease:
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r} is already waiting in this client")
        fut = self._loop.create_future()
        self._pending[request_id] = fut
        self._isl[request_id] = isl_tokens
        try:
            self._send(frame)
            reply = await fut
        except asyncio.CancelledError:
            if self._pending.pop(request_id, None) is fut and self._sock is not None:
                self._send(p.Release(request_id, -1, 0, "cancelled", 0))
            raise
        finally:
            self._pending.pop(request_id, None)
            self._isl.pop(request_id, None)
        if isinstance(reply, p.Rejected):
            raise rejection_error(reply.request_id, reply.reason, reply.detail, reply.policy_class,
                                  reply.limit_kind, reply.current, reply.limit)
        lease = Lease(self, reply.request_id, WorkerKey(reply.worker_id, reply.dp_rank), reply.slot,
                      reply.generation, reply.cached_tokens, reply.overlap_blocks, reply.queued_us, isl_tokens)
        self._leases[request_id] = weakref.ref(lease)
        return lease

    async def _requeue(self, lease: Lease) -> Lease:
        frame = p.Update(lease.request_id, lease.slot, lease.generation, "requeue")
        return await self._await_admission(lease.request_id, lease.isl_tokens, frame)

    # ------------------------------------------------------------------ lease callbacks
    def _report_progress(self, lease: Lease) -> None:
        if self._progress is not None:
            from ..shm.progress import write_progress

            write_progress(self._progress, lease.slot, lease.generation, lease.output_tokens)
        else:
            self._send(p.Update(lease.request_id, lease.slot, lease.generation, "progress", lease.output_tokens))

    def _forget_lease(self, lease: Lease) -> None:
        ref = self._leases.get(lease.request_id)
        if ref is not None and ref() is lease:
            del self._leases[lease.request_id]

    def _release_from_gc(self, request_id: str, slot: int, generation: int) -> None:
        """A lease was collected while open: abort it on the loop thread (GC may run anywhere)."""
        loop = self._loop
        if loop is None or loop.is_closed() or self._sock is None:
            return
        frame = p.Release(request_id, slot, generation, "aborted", 0)
        try:
            loop.call_soon_threadsafe(self._send_quiet, frame)
        except RuntimeError:  # loop closing
            pass

    def _send_quiet(self, frame) -> None:
        if self._sock is not None:
            self._send(frame)

    # ------------------------------------------------------------------ wire
    def _send(self, frame) -> None:
        if self._sock is None:
            raise DaemonUnavailable(f"connection to {self.endpoint} is closed")
        try:
            self._sock.send(self._enc.encode(frame), zmq.NOBLOCK)
        except zmq.Again as exc:
            raise DaemonUnavailable(f"send queue to {self.endpoint} is full") from exc
        self._last_send = time.monotonic()
        if self._loop is not None:  # sending can consume the FD's edge: re-check incoming
            self._loop.call_soon(self._on_readable)

    def _on_readable(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                raw = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                frame = self._dec.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                log.warning("undecodable frame from daemon error=%s", exc)
                continue
            self._dispatch(frame)
            sock = self._sock

    def _dispatch(self, frame) -> None:
        match frame:
            case p.Admitted() | p.Rejected():
                fut = self._pending.get(frame.request_id)
                if fut is not None and not fut.done():
                    fut.set_result(frame)
                elif isinstance(frame, p.Admitted):  # nobody waits (cancelled): give it back
                    self._send(p.Release(frame.request_id, frame.slot, frame.generation, "aborted", 0))
            case p.Welcome():
                if self._welcome_fut is not None and not self._welcome_fut.done():
                    self._welcome_fut.set_result(frame)
            case p.Error():
                fut = self._pending.get(frame.request_id) if frame.request_id else None
                if frame.code == p.ErrorCode.VERSION and self._welcome_fut and not self._welcome_fut.done():
                    self._welcome_fut.set_exception(ProtocolError(frame.message))
                elif fut is not None and not fut.done():
                    fut.set_exception(ProtocolError(f"daemon error {frame.code}: {frame.message}"))
                else:
                    self.errors.append(frame)
                    del self.errors[:-100]
            case p.HeartbeatAck() | p.Reattached():
                pass

    def _schedule_heartbeat(self) -> None:
        assert self.welcome is not None and self._loop is not None
        period = self.welcome.heartbeat_ms / 1000
        self._hb_handle = self._loop.call_later(period, self._heartbeat)

    def _heartbeat(self) -> None:
        if self._sock is None:
            return
        if time.monotonic() - self._last_send >= self.welcome.heartbeat_ms / 1000 * 0.9:
            self._hb_seq += 1
            try:
                self._send(p.Heartbeat(self._hb_seq))
            except DaemonUnavailable:
                pass
        self._schedule_heartbeat()
