"""`Lease`: the router's handle on one admitted request, used as a guard (docs/DESIGN.md §5.1).

`async with lease:` — a normal exit sends `Release(completed, context_tokens = isl + output tokens)`;
an exception or cancellation sends `Release(aborted)`. A lease garbage-collected without being closed
is aborted through the client's one batched cleanup queue (`DroppedLeases`), never leaked: a burst of
dropped leases costs one loop wake, not one callback each (Dynamo kv-router: "one bounded wake can
cover a batch of dropped requests"). `dispatched()`, `prefill_done()` and output tokens of local
routers are aligned 8-byte stores into the slot's state and progress words (no frame); routers that
could not map the progress segment send `Update` frames instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Literal

from .. import protocol as p
from ..errors import LeaseError, LeaseLost, LeaseRevoked
from .checks import MAX_TOKENS, checked_int
from .link import Link

log = logging.getLogger(__name__)


_DROPPED = ("lost", "revoked")  # outcomes set by the daemon's side, not by the caller


@dataclass(frozen=True, slots=True)
class LeaseChannel:
    """What a `Lease` and the `DroppedLeases` queue call on the `SchedulerClient` that made them: the
    client's own methods, bound once when it is created. The client keeps its state (connection,
    progress words, open leases, waiting calls); its leases reach it only through these calls."""

    loop: Callable[[], asyncio.AbstractEventLoop | None]  # the client's loop (None before `connect`)
    link: Callable[[], Link | None]  # its data connection (None before `connect` / after `close`)
    send: Callable[[p.Frame], None]  # one frame to the daemon (raises DaemonUnavailable once closed)
    report_state: Callable[[Lease, Literal["dispatched", "prefill_done"]], None]  # state word or Update
    report_progress: Callable[[Lease], None]  # the lease's output tokens: progress word or Update
    forget: Callable[[Lease], None]  # the lease is closed: drop it from the client's open leases
    requeue: Callable[[Lease], Awaitable[Lease]]  # Update(requeue), then wait for the new admission
    release_from_gc: Callable[[str, int, int], None]  # (request_id, slot, generation) of a collected lease


class DroppedLeases:
    """The client's cleanup queue of leases garbage-collected while open.

    `push` may run on any thread (the garbage collector runs wherever the last reference dies). It
    appends (request_id, slot, generation) and asks the client's loop for a wake only when none is
    pending, so a batch of dropped leases costs ONE `call_soon_threadsafe`; the wake sends one
    `Release(aborted)` per entry. The queue holds at most one entry per open lease (a lease is pushed
    once, when it dies), so it is bounded by the number of open leases.

    Args:
        channel: the client's `LeaseChannel` (its loop and link are read at push / flush time).
    """

    __slots__ = ("_channel", "_queue", "_wake_pending")

    def __init__(self, channel: LeaseChannel) -> None:
        self._channel = channel
        self._queue: deque[tuple[str, int, int]] = deque()
        self._wake_pending = False

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, request_id: str, slot: int, generation: int) -> None:
        """Queue the abort of one dropped lease (any thread); wakes the loop once per batch."""
        loop = self._channel.loop()
        if loop is None or loop.is_closed() or self._channel.link() is None:
            return  # not connected: the daemon reaps the lease when this connection goes silent
        self._queue.append((request_id, slot, generation))
        if self._wake_pending:
            return
        self._wake_pending = True
        try:
            loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # loop closing: the daemon reaps the lease with the connection
            self._wake_pending = False

    def _flush(self) -> None:
        """On the loop: send a Release(aborted) for every queued lease."""
        self._wake_pending = False  # before draining: a push racing with this drain wakes again
        link = self._channel.link()
        while self._queue:
            request_id, slot, generation = self._queue.popleft()
            if link is not None:
                link.send(p.Release(request_id, slot, generation, "aborted", 0))


class Lease:
    """One admitted request.

    Attributes:
        request_id: the request.
        worker: WorkerKey(worker_id, dp_rank) to send it to.
        slot / generation: the lease key the daemon knows it by.
        cached_tokens / overlap_blocks: prompt tokens / blocks already cached on that worker.
        queued_us: time it waited in the daemon (µs).
        isl_tokens: prompt tokens (for the completed context count).
        degraded: True for a lease made locally because the daemon was unavailable
            (`on_unavailable="bypass"`): nothing is reported for it.
        output_tokens: output tokens reported so far.
        outcome: None while open; then "completed" / "aborted" / "requeued" (closed by the caller),
            or "lost" / "revoked" (closed by the daemon). After "lost" (the daemon declared this
            router dead after its liveness timeout of silence, restarted without the lease, or an
            operator removed the lease's worker: `kvsched remove-worker`) the
            progress calls and `requeue()` raise `LeaseLost` naming the cause, and `release()` /
            guard exit log it once and return. After "revoked" (an operator's `kvsched cancel` of
            the active lease) the progress calls and `requeue()` raise `LeaseRevoked` (a
            `LeaseLost`): abort the request; `release()` / guard exit return quietly.
        lost_reason: why the daemon dropped the lease ("" unless outcome is "lost" or "revoked").
        url: the worker's base URL from the daemon (`Admitted.url`; "" when none is configured).
        dp_size: ranks of the worker (> 1: tell a vLLM engine the rank, `X-data-parallel-rank`).
    """

    __slots__ = (
        "__weakref__",
        "_channel",
        "_dispatched",
        "_loss_logged",
        "_on_dropped",
        "cached_tokens",
        "degraded",
        "dp_size",
        "generation",
        "isl_tokens",
        "lost_reason",
        "outcome",
        "output_tokens",
        "overlap_blocks",
        "queued_us",
        "request_id",
        "slot",
        "url",
        "worker",
    )

    def __init__(
        self,
        channel: LeaseChannel | None,
        request_id: str,
        worker: p.WorkerKey,
        slot: int,
        generation: int,
        cached_tokens: int,
        overlap_blocks: int,
        queued_us: int,
        isl_tokens: int,
        degraded: bool = False,
        url: str = "",
        dp_size: int = 1,
    ) -> None:
        self._channel = channel
        self.url = url
        self.dp_size = dp_size
        self.request_id = request_id
        self.worker = worker
        self.slot = slot
        self.generation = generation
        self.cached_tokens = cached_tokens
        self.overlap_blocks = overlap_blocks
        self.queued_us = queued_us
        self.isl_tokens = isl_tokens
        self.degraded = degraded
        self.output_tokens = 0
        self.outcome: str | None = None
        self.lost_reason = ""
        self._loss_logged = False
        self._dispatched = False
        self._on_dropped: Callable[[Lease], None] | None = None

    def __repr__(self) -> str:
        return (
            f"Lease({self.request_id!r}, worker={self.worker}, slot={self.slot}, gen={self.generation}, "
            f"cached_tokens={self.cached_tokens}, outcome={self.outcome})"
        )

    @property
    def closed(self) -> bool:
        return self.outcome is not None

    def on_dropped(self, callback: Callable[[Lease], None] | None) -> None:
        """Call `callback(lease)` once, on the client's loop, when the daemon drops this open lease
        (`outcome` becomes "lost" or "revoked"); at once if it already has. A caller streaming from
        an engine uses it to stop at once (e.g. close the engine request on a revoke) instead of at
        its next progress call. None removes the callback. Exceptions it raises are logged."""
        self._on_dropped = callback
        if callback is not None and self.outcome in _DROPPED:
            self._notify_dropped()

    def mark_dropped(self, outcome: Literal["lost", "revoked"], reason: str) -> None:
        """The client's call when the daemon drops this open lease (a revocation notice, a restart it
        did not survive, its worker removed): `outcome` and `lost_reason` are set and the `on_dropped`
        callback runs. Not a router's verb: a router ends a lease with `release` / `async with`."""
        self.outcome = outcome
        self.lost_reason = reason
        self._notify_dropped()

    def _notify_dropped(self) -> None:
        callback, self._on_dropped = self._on_dropped, None
        if callback is None:
            return
        try:
            callback(self)
        except Exception:  # a caller's bug must not break the client's frame dispatch
            log.exception("on_dropped callback of lease request_id=%s failed", self.request_id)

    def _check_open(self, what: str) -> bool:
        """True when the lease is open. A "lost" lease raises LeaseLost and a "revoked" one (an
        operator's cancel) LeaseRevoked: the worker's booking is gone and the caller must stop; a
        lease the caller already closed raises LeaseError (a bug in the caller)."""
        if self.outcome is None:
            return True
        if self.outcome == "lost":
            raise LeaseLost(self.request_id, self.lost_reason or "the daemon no longer holds it")
        if self.outcome == "revoked":
            raise LeaseRevoked(self.request_id, self.lost_reason or "cancelled by an operator")
        raise LeaseError(f"{what} on lease {self.request_id!r} after it was {self.outcome}")

    def dispatched(self) -> None:
        """The backend accepted the request (sent at most once)."""
        if not self._check_open("dispatched()"):
            return
        if self._dispatched or self.degraded or self._channel is None:
            return
        self._dispatched = True
        self._channel.report_state(self, "dispatched")

    def prefill_done(self) -> None:
        """The first output token was seen: the request's prefill load leaves the worker."""
        if not self._check_open("prefill_done()"):
            return
        if self.degraded or self._channel is None:
            return
        self._channel.report_state(self, "prefill_done")

    def add_output_tokens(self, n: int) -> None:
        """Report `n` more output tokens (cumulative count kept here).

        Local routers: one aligned 8-byte store into the slot's progress word (no frame). Routers that
        could not map the progress segment send `Update(progress)`.

        Raises:
            TypeError: `n` is not an int (a bool or a float, e.g. a character count / 4).
            ValueError: `n` < 0, or isl + output tokens would pass 2**31 - 1 (the wire's token bound:
                the daemon would refuse the release, docs/PROTOCOL.md). Nothing is counted then.
        """
        if not self._check_open("add_output_tokens()"):
            return
        n = checked_int("n", n, 0, MAX_TOKENS)  # checked before counting: a refused count must not reach the release
        if self.isl_tokens + self.output_tokens + n > MAX_TOKENS:
            raise ValueError(
                f"{self.output_tokens + n} output tokens after {self.isl_tokens} prompt tokens pass "
                f"the {MAX_TOKENS:,}-token bound of a request's context"
            )
        self.output_tokens += n
        if self.degraded or self._channel is None:
            return
        self._channel.report_progress(self)

    def release(
        self, outcome: Literal["completed", "aborted"] = "completed", context_tokens: int | None = None
    ) -> None:
        """Close the lease (idempotent for the same outcome).

        Args:
            outcome: "completed" (normal end) or "aborted" (failed / cancelled mid-way).
            context_tokens: tokens of context at the end (isl + output); default computed here.
        A lease the daemon dropped ("lost", "revoked") is already released there: this returns
        without raising (so guards and `finally:` blocks stay simple) and logs a lost lease once.

        Raises:
            ValueError: any other outcome, or `context_tokens` outside [0, 2**31 - 1] (either would be
                refused by the daemon, and the lease would stay booked there until this process exits).
            TypeError: `context_tokens` not an int. The lease stays open after either error.
            LeaseError: closing again with a different outcome.
        """
        if outcome not in ("completed", "aborted"):
            raise ValueError(f"lease outcome must be 'completed' or 'aborted', not {outcome!r}")
        if context_tokens is not None:
            context_tokens = checked_int("context_tokens", context_tokens, 0, MAX_TOKENS)
        if self.outcome is not None:
            if self.outcome in _DROPPED:
                if self.outcome == "lost" and not self._loss_logged:
                    self._loss_logged = True
                    log.warning(
                        "release(%s) of lost lease request_id=%s ignored: %s",
                        outcome,
                        self.request_id,
                        self.lost_reason,
                    )
                return
            if self.outcome != outcome:
                raise LeaseError(f"lease {self.request_id!r} already {self.outcome}, cannot be {outcome}")
            return
        if self.degraded or self._channel is None:
            self.outcome = outcome
            return
        ctx = self.isl_tokens + self.output_tokens if context_tokens is None else context_tokens
        self._channel.send(p.Release(self.request_id, self.slot, self.generation, outcome, ctx))
        self.outcome = outcome  # after the send: a Release that could not be sent leaves the lease open
        self._channel.forget(self)

    async def requeue(self) -> Lease:
        """Dispatch failed or the engine preempted the request: give the booking back and wait for a
        new admission (same request, original queue position). Returns the new lease.

        Raises:
            RequestRejected: the daemon rejected the re-admission.
            LeaseLost: the daemon lost the lease (schedule the request again).
            LeaseRevoked: an operator cancelled it (abort the request).
            LeaseError: the lease is closed or degraded.
        """
        self._check_open("requeue()")
        if self.degraded or self._channel is None:
            raise LeaseError("a degraded lease cannot be requeued")
        self.outcome = "requeued"
        self._channel.forget(self)
        return await self._channel.requeue(self)

    async def __aenter__(self) -> Lease:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.outcome is None:
            self.release("completed" if exc_type is None else "aborted")

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.outcome is None:
            self.release("completed" if exc_type is None else "aborted")

    def __del__(self) -> None:
        if self.outcome is None and not self.degraded and self._channel is not None:
            self.outcome = "aborted"
            self._channel.release_from_gc(self.request_id, self.slot, self.generation)
