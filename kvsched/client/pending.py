"""`PendingCalls`: the client's book of calls waiting for the daemon, and of what it re-sends after
a daemon restart.

Each `schedule()` / `requeue()` waits on a future keyed by request_id until an `Admitted`, a
`Rejected` or an `Error` for that id arrives. The book also keeps each open lease's original
`Enqueue` (a requeue not answered yet is re-sent with it) and the ids answered `shutting_down` (the
daemon is stopping: they stay waiting and are re-sent to the next daemon). From these it builds
the `Reattach` a reconnected link sends (docs/PROTOCOL.md "Router → daemon (data socket)"), and at
the reconnect deadline it fails, or resolves in bypass mode, every call still waiting. No I/O: the
client sends what it returns.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

from .. import protocol as p
from ..errors import DaemonUnavailable, ShuttingDown


class Bypass:
    """Result of a waiting call resolved by bypass mode at the reconnect deadline (a degraded lease)."""


BYPASS = Bypass()

Answer = p.Admitted | p.Rejected | Bypass


class Waiting(NamedTuple):
    """One call waiting for the daemon: its future, the frame it sent, the request's prompt tokens."""

    future: asyncio.Future[Answer]
    frame: p.Enqueue | p.Update  # an Enqueue (schedule) or an Update(requeue)
    isl_tokens: int


class PendingCalls:
    """Waiting calls by request_id, open leases' Enqueues, and the ids parked by `shutting_down`.

    Attributes:
        origins: request_id -> the `Enqueue` of an open lease or of a requeue in flight (the client
            adds it at admission and drops it when the lease ends).
    """

    __slots__ = ("_parked", "_waiting", "origins")

    def __init__(self) -> None:
        self._waiting: dict[str, Waiting] = {}
        self._parked: set[str] = set()
        self.origins: dict[str, p.Enqueue] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def __iter__(self) -> Iterator[str]:
        return iter(self._waiting)

    def open(
        self, request_id: str, future: asyncio.Future[Answer], frame: p.Enqueue | p.Update, isl_tokens: int
    ) -> None:
        """Start waiting for `request_id`.

        Raises:
            ValueError: `request_id` is already waiting in this client.
        """
        if request_id in self._waiting:
            raise ValueError(f"request {request_id!r} is already waiting in this client")
        self._waiting[request_id] = Waiting(future, frame, isl_tokens)

    def close(self, request_id: str) -> Waiting | None:
        """Stop waiting for `request_id` (answered, cancelled or failed); its entry, or None."""
        self._parked.discard(request_id)
        return self._waiting.pop(request_id, None)

    def answer(self, frame: p.Admitted | p.Rejected) -> bool:
        """Hand an `Admitted` / `Rejected` to the call waiting for it.

        A `Rejected(shutting_down)` parks the call instead (it is re-sent after reconnecting).
        Returns:
            False when no call waits for it (the caller gives an `Admitted` back, or takes a
            `Rejected` as the revocation of a lease).
        """
        entry = self._waiting.get(frame.request_id)
        if entry is None or entry.future.done():
            return False
        if isinstance(frame, p.Rejected) and frame.reason == "shutting_down":
            self._parked.add(frame.request_id)
        else:
            entry.future.set_result(frame)
        return True

    def fail(self, request_id: str, exc: BaseException) -> bool:
        """Fail the call waiting for `request_id` with `exc`; False when none waits."""
        entry = self._waiting.get(request_id)
        if entry is None or entry.future.done():
            return False
        entry.future.set_exception(exc)
        return True

    def fail_all(self) -> None:
        """Fail every waiting call with `DaemonUnavailable` (the client is closing) and forget them."""
        for rid, entry in list(self._waiting.items()):
            if not entry.future.done():
                entry.future.set_exception(DaemonUnavailable(f"client closed while {rid!r} was waiting"))
        self._waiting.clear()
        self._parked.clear()

    def expire(self, err: str, bypass: bool) -> None:
        """The daemon stayed away past the reconnect deadline: resolve every waiting call.

        Args:
            err: the outage, as the exceptions' message.
            bypass: resolve with `BYPASS` (the client makes a degraded lease) instead of failing.
        A call parked by `shutting_down` fails with `ShuttingDown`, any other with `DaemonUnavailable`.
        """
        for rid, entry in list(self._waiting.items()):
            if entry.future.done():
                continue
            if bypass:
                entry.future.set_result(BYPASS)
            elif rid in self._parked:
                entry.future.set_exception(ShuttingDown(rid, f"the daemon stopped and none came back: {err}"))
            else:
                entry.future.set_exception(DaemonUnavailable(err))

    def reattach(self, leases: Iterable[p.LeaseRef]) -> p.Reattach:
        """The `Reattach` for a new daemon: `leases` (open, plus those released while the link was
        down), every waiting `Enqueue`, and every unanswered requeue with its original `Enqueue`.
        Parked calls are re-sent by it, so the parked set is cleared."""
        pending: list[p.Enqueue] = []
        requeues: list[p.Requeued] = []
        for rid, entry in list(self._waiting.items()):
            if entry.future.done():
                continue
            frame = entry.frame
            if isinstance(frame, p.Enqueue):
                pending.append(frame)
            elif rid in self.origins:  # an Update(requeue) not answered yet
                requeues.append(p.Requeued(p.LeaseRef(rid, frame.slot, frame.generation), self.origins[rid]))
        self._parked.clear()
        return p.Reattach(list(leases), pending, requeues)


def split_reattach(
    frame: p.Reattach, limit: int, encode: Callable[[object], bytes]
) -> tuple[list[p.Reattach], list[tuple[str, int]]]:
    """Cut `frame` into `Reattach` frames of at most `limit` encoded bytes and `p.MAX_LIST` entries per
    list, in order.

    The daemon handles a `Reattach`'s leases, then its requeues, then its pending Enqueues, and several
    `Reattach` frames one after the other (each answered by its own `Reattached`), so chunks taken in
    that order are handled exactly like the one frame (docs/PROTOCOL.md "Transport"). Without
    the cut, a router holding many waiting requests when its daemon restarts sends one message larger
    than the daemon accepts, the transport drops the connection, and every reconnect repeats it.

    Args:
        frame: the whole `Reattach`.
        limit: bytes a frame may take (the daemon's `max_frame_bytes` minus the `Batch` overhead).
        encode: the link's msgpack encoder (`encode(struct) -> bytes`).
    Returns:
        (frames, too_large): `too_large` lists (request_id, bytes) of the requeues and pending Enqueues
        that alone exceed `limit`; they are left out (the caller fails their calls).
    """
    if len(encode(frame)) <= limit and max(len(frame.leases), len(frame.requeues), len(frame.pending)) <= p.MAX_LIST:
        return [frame], []
    base = len(encode(p.Reattach())) + 12  # each of the three list headers grows from 1 to at most 5 bytes
    fields = ("leases", "requeues", "pending")
    frames: list[p.Reattach] = []
    too_large: list[tuple[str, int]] = []
    cur: dict[str, list[Any]] = {f: [] for f in fields}
    size = base
    for field in fields:
        for item in getattr(frame, field):
            n = len(encode(item))
            if base + n > limit:
                rid = item.lease.request_id if isinstance(item, p.Requeued) else item.request_id
                too_large.append((rid, base + n))
                continue
            if size + n > limit or len(cur[field]) >= p.MAX_LIST:
                frames.append(p.Reattach(**cur))
                cur, size = {f: [] for f in fields}, base
            cur[field].append(item)
            size += n
    if any(cur.values()) or not frames:
        frames.append(p.Reattach(**cur))
    return frames, too_large
