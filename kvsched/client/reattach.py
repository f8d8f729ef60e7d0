"""The client's side of a daemon outage: what it tells a daemon that welcomes it again, and when
its waiting callers stop waiting.

After a reconnect the client claims its open leases (and those whose `Release` waits in the
link's reconnect buffer), re-sends its waiting Enqueues and its unanswered requeues in one or more
`Reattach` frames (docs/PROTOCOL.md "Router → daemon (data socket)"); the `Welcome`'s
`daemon_epoch` says whether the daemon restarted or reaped this router as silent, which is the
reason a lease the daemon no longer knows is reported lost with. The book of waiting calls the
frames are built from is `pending.py`'s; the socket is `link.py`'s.
"""

from __future__ import annotations

import logging
import time

from .. import protocol as p
from ..errors import FrameTooLarge
from .link import Link
from .pending import PendingCalls, split_reattach

log = logging.getLogger(__name__)

RESTART_LOSS = "released by the daemon after its restart"  # reason of a lease lost before any reconnect


def loss_reason(epoch_before: int | None, welcome: p.Welcome) -> str:
    """Why the daemon that sent `welcome` (after a reconnect) may not know our leases any more: the
    same `daemon_epoch` as before means it reaped this router as silent, another one that it
    restarted. Shown by `LeaseLost` for each lease its `Reattached` lists as lost."""
    if welcome.daemon_epoch == epoch_before:  # same daemon: it reaped this router as silent
        return (
            f"the daemon (same daemon_epoch, it did not restart) declared this router dead "
            f"after {welcome.liveness_timeout_ms / 1000:.1f} s of silence "
            f"(the process stopped, its heartbeats did not reach the daemon, or the link was down longer than "
            f"liveness_timeout_ms); lease lost"
        )
    return f"the daemon restarted (daemon_epoch {epoch_before} -> {welcome.daemon_epoch}) without it; lease lost"


def send_reattach(link: Link | None, pending: PendingCalls, leases: list[p.LeaseRef], welcome: p.Welcome) -> None:
    """Claim `leases` (the open ones) and those whose Release waits in the link's buffer, re-send
    the waiting Enqueues and unanswered requeues (each with the lease it gave back and the
    request's original Enqueue), split into frames under the daemon's `max_frame_bytes`. A call
    whose frame alone exceeds it fails with `FrameTooLarge`; the others go out."""
    if link is not None:  # released while disconnected (or unread): their Releases follow the Reattach
        busy = {ref.request_id for ref in leases} | set(pending)  # a reused id: never claim its old lease
        leases += [ref for ref in link.buffered_releases() if ref.request_id not in busy]
    frame = pending.reattach(leases)
    log.info(
        "reconnected epoch=%d reattaching leases=%d pending=%d requeues=%d",
        welcome.daemon_epoch,
        len(frame.leases),
        len(frame.pending),
        len(frame.requeues),
    )
    if link is None:
        return
    limit = link.max_frame_bytes - p.BATCH_OVERHEAD_BYTES
    frames, too_large = split_reattach(frame, limit, link.enc.encode)
    for rid, size in too_large:  # fits no frame this daemon accepts: fail the call, keep the others
        pending.origins.pop(rid, None)
        pending.fail(
            rid,
            FrameTooLarge(
                f"request {rid!r} takes {size:,} bytes to re-send; the restarted daemon accepts at most "
                f"{link.max_frame_bytes:,} (max_frame_bytes)"
            ),
        )
    if len(frames) > 1:
        log.info("reattach split into frames=%d (max_frame_bytes=%d)", len(frames), link.max_frame_bytes)
    for f in frames:
        link.send(f)


def outage_expired(link: Link | None, deadline_s: float) -> bool:
    """The daemon has been away longer than `deadline_s` (s), or never answered at all: waiting
    callers fail (or, in bypass mode, get a degraded lease). False while connected or closed."""
    if link is None or link.connected:
        return False
    if not link.ever_connected:
        return True
    return time.monotonic() - (link.reconnecting_since or 0) > deadline_s
