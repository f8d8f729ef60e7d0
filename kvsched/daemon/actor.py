"""The actor: drives the Scheduler from reader callbacks and timers on one loop, and sends every reply.

I/O pattern (docs/DESIGN.md §8): each ROUTER socket is read by a `reader.Reader`; a wake drains at
most `frame_budget_per_wake` frames with NOBLOCK, hands each decoded frame to its handler in the one
dispatch table (by exact type; the pure frame ↔ record functions are `translate.py`'s), runs one
`drain_cleanup`, then sends every reply of the wake; its metrics are counted in the `WakeTally` and
written to Prometheus by the tick. No frame is bounced through a queue or a task. The actor holds no
policy: every decision comes from the Scheduler.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from .. import protocol as p
from ..core.types import DAEMON_OWNER, Admit, Reject
from .admin_socket import ADMIN_BUDGET, AdminSocket
from .connections import Connection, ConnectionTable
from .envelope import REQ_ON_DATA_SOCKET, is_req_envelope
from .heartbeats import TokenHeartbeats
from .metrics import Metrics
from .ratelimit import RateLimitedLog
from .reader import Reader, readable
from .replies import ReplyOutbox
from .tally import WakeTally, now_us
from .tick import Ticker
from .translate import admitted_frame, enqueue_problem, rejected_frame, spec_from_enqueue

if TYPE_CHECKING:
    from ..config import DaemonConfig
    from ..core.scheduler import Scheduler

log = logging.getLogger(__name__)

_NOBLOCK = int(zmq.NOBLOCK)  # a plain int: pyzmq's enum flags cost an enum construction per call
_RCVMORE = int(zmq.RCVMORE)
_ENQUEUE, _RELEASE, _BATCH = p.Enqueue, p.Release, p.Batch
_BATCH_MIN_VERSION = p.BATCH_MIN_VERSION


class Actor:
    """Reads frames, drives the Scheduler, answers peers. Create, then `start()`; `stop()` at the end.

    Args:
        loop: the running (uvloop) event loop.
        scheduler: `kvsched.core.scheduler.Scheduler`.
        data_sock: bound ROUTER socket for routers.
        welcome: the `Welcome` frame sent in answer to a valid `Hello`.
        daemon_cfg: `DaemonConfig` (budgets, caps, timers).
        metrics: `Metrics`.
        admin_handler: `(AdminRequest, now_us) -> (AdminReply, list[Admit|Reject])`, or None.
        admin_sock: bound ROUTER socket for the admin CLI, or None.
        worker_urls: worker_id -> base URL sent in `Admitted.url` (read only: `WorkerRegistry.urls`).
        conns: the `ConnectionTable` whose `owner_alive` / `same_process` the scheduler was built
            with (None = a new one; the scheduler then assumes every owner alive).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        scheduler: Scheduler,
        data_sock: zmq.Socket,
        welcome: p.Welcome,
        daemon_cfg: DaemonConfig,
        metrics: Metrics,
        admin_handler: Callable | None = None,
        admin_sock: zmq.Socket | None = None,
        worker_urls: Mapping[int, str] | None = None,
        conns: ConnectionTable | None = None,
    ) -> None:
        self.loop = loop
        self.worker_urls = worker_urls if worker_urls is not None else {}
        self.scheduler = scheduler
        self.data_sock = data_sock
        self.admin_sock = admin_sock
        self.welcome = welcome
        self.cfg = daemon_cfg
        self.metrics = metrics
        self.conns = conns if conns is not None else ConnectionTable(daemon_cfg.liveness_timeout_ms * 1000)
        self.enc = p.make_encoder()
        self.dec = p.make_router_decoder()
        self.warn = RateLimitedLog(log)
        self.batch_dec = p.make_batched_router_decoder()
        self._batch_index: int | None = None  # position in the Batch being handled, for Error frames
        self._carry: tuple[Connection, list, int] | None = None  # a Batch begun, not finished: (peer, frames, next)
        self.max_frame_bytes = daemon_cfg.max_frame_bytes  # bigger messages are answered error{oversized}
        self.outbox = ReplyOutbox(
            data_sock, daemon_cfg.max_frame_bytes, self.warn, loop.call_soon, self._flush_outside_wake
        )  # version-2 peers: the replies of one wake
        self.tally = WakeTally(metrics)
        self.admin = AdminSocket(admin_sock, admin_handler, metrics, self.enc) if admin_sock is not None else None
        self.accepting = True  # False once `begin_shutdown` ran: Enqueues and requeues answered `shutting_down`
        self.releases_this_wake = 0  # Release frames of this wake (the cleanup batch size)
        self._dispatch: dict[type, Callable[[Connection, Any, int], None]] = {  # exact type -> handler
            p.Enqueue: self._on_enqueue,
            p.Release: self._on_release,
            p.Update: self._on_update,
            p.Heartbeat: self._on_heartbeat,
            p.Reattach: self._on_reattach,
            p.Hello: self._on_hello,
        }
        self.beats = TokenHeartbeats(self.conns, metrics.unknown_token_heartbeats)
        self.stopped = False
        self.ticker = Ticker(self)
        self._fold_timer: asyncio.TimerHandle | None = None
        self.data_reader = Reader(loop, data_sock, self._wake_data)
        self.admin_reader = Reader(loop, admin_sock, self._serve_admin) if admin_sock is not None else None
        self._flush_queued: asyncio.Handle | None = None  # the one queued `_flush_outside_wake`
        self.dropped_dead_frames = 0  # frames left by peers whose process died, dropped unread

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.data_reader.start()
        if self.admin_reader is not None:
            self.admin_reader.start()
        stall_s = float(os.environ.get("KVSCHED_DEBUG_STALL_S", "0") or 0)
        if stall_s > 0:  # operators' check of the watchdog wiring: `kill -USR2` freezes the loop
            self.loop.add_signal_handler(signal.SIGUSR2, self._stall, stall_s)
        self.ticker.start()

    def _stall(self, seconds: float) -> None:
        """Block the actor loop (debug aid, enabled by KVSCHED_DEBUG_STALL_S): the watchdog must fire."""
        log.warning("stalling the actor loop on request seconds=%.1f", seconds)
        time.sleep(seconds)

    def stop_reading(self) -> None:
        while self.outbox:  # what this wake still owes version-2 peers, while the socket is open
            self._flush_replies()
        self.tally.flush()
        self.stopped = True  # callbacks already queued (call_soon) must not touch closed sockets
        self.data_reader.stop()
        if self.admin_reader is not None:
            self.admin_reader.stop()
        self.ticker.stop()
        if self._fold_timer is not None:
            self._fold_timer.cancel()
            self._fold_timer = None

    def begin_shutdown(self) -> None:
        """Stop accepting Enqueues and requeues; answer every waiting request `shutting_down`.
        Releases, progress and heartbeats are still served (idempotent)."""
        if not self.accepting:
            return
        self.accepting = False
        self.deliver(self.scheduler.shutdown(now_us()), now_us())
        self._flush_replies()
        self.tally.flush()

    # ------------------------------------------------------------------ data socket
    def _wake_data(self) -> bool:
        """The data socket's drain (`Reader`): one wake (`_drain_data`), whose replies it flushes itself
        (no safety-net callback per wake); if the wake failed midway, what it queued is flushed on the
        next turn. True when another wake is needed."""
        self.outbox.in_wake = True
        try:
            return self._drain_data()
        finally:
            self.outbox.in_wake = False
            if self.outbox:
                self.loop.call_soon(self._flush_replies)

    def _drain_data(self) -> bool:
        if self.stopped:
            return False
        sock = self.data_sock
        if self._carry is None and not readable(sock):
            # Nothing to read: the ZMQ FD also signals after sends and internal commands. No fold,
            # no cleanup pass (the timers fold while anything waits); flush what a timer left.
            if self.outbox:
                self._flush_replies()
                return readable(sock)
            return False
        budget = self.cfg.frame_budget_per_wake
        t = now_us()
        n = beats = 0  # data frames, and heartbeat DEALERs' beats (outside the data budget, with their own)
        sends = self.outbox.sends
        folded = self.fold_words()  # local routers' dispatched / prefill_done / tokens, before this wake's frames
        more = True  # readable: checked above, then after each message (no zmq.Again raised per wake)
        if self._carry is not None:  # the rest of a Batch an earlier wake began comes before any new message
            n = self._resume_batch(budget, t)
            more = n < budget and self._carry is None and readable(sock)
        while more:
            identity = sock.recv(_NOBLOCK)
            part = sock.recv(_NOBLOCK, copy=False)  # the rest of a message is there once its first part is
            payload = part.bytes
            if part.more:  # more than [identity, payload]: several parts, or a REQ's envelope
                rest = []  # (`Frame.more` reads the message; getsockopt(RCVMORE) would build an enum)
                while sock.getsockopt(_RCVMORE):
                    rest.append(sock.recv(_NOBLOCK))
                self.metrics.malformed.labels(code="malformed").inc()
                if is_req_envelope(payload, rest):  # a REQ socket: tell it (it waits for an answer)
                    self._refuse(identity, REQ_ON_DATA_SOCKET, envelope=True)
                else:
                    self._refuse(
                        identity,
                        f"a data-socket message is one frame; this one had {1 + len(rest)} parts",
                        envelope=False,
                    )
            else:
                counted = self._handle_data(identity, payload, t)
                if self._carry is not None:  # a Batch: its inner frames up to the budget now, the rest next wakes
                    n += self._resume_batch(budget - n, t)
                elif counted == 0:
                    beats += 1  # a heartbeat DEALER's beat: outside the data budget
                else:
                    n += counted or 1
            more = n < budget and beats < budget and self._carry is None and readable(sock)
        tally = self.tally
        if n:
            tally.frames += n
            if self.releases_this_wake:
                tally.cleanup_sizes.append(self.releases_this_wake)
                self.releases_this_wake = 0
            tally.samples += n
            self.deliver(self.scheduler.drain_cleanup(t), t)
        elif folded:
            self.deliver(self.scheduler.drain_cleanup(t), t)
        self._arm_fold_timer()
        self._flush_replies()
        tally.flush_if_full()
        # Sends process the socket's commands and can swallow the FD's edge for a message that
        # arrived meanwhile: look again after sending. With nothing sent, the check that ended the
        # loop above still holds.
        return (
            n >= budget or beats >= budget or self._carry is not None or (self.outbox.sends != sends and readable(sock))
        )

    # ------------------------------------------------------------------ shared-memory words
    def fold_words(self) -> bool:
        """Fold the routers' progress and state words (one kernel call); True if anything changed."""
        if self.scheduler.fold_words():
            self.tally.word_folds += 1
            return True
        return False

    def _arm_fold_timer(self) -> None:
        """While a request waits, fold at least every `fold_interval_ms`: a `prefill_done` stored by a
        local router then frees capacity for it within that bound even when no frame arrives."""
        if self._fold_timer is None and self.scheduler.waiting:
            self._fold_timer = self.loop.call_later(self.cfg.fold_interval_ms / 1000, self._on_fold_timer)

    def _on_fold_timer(self) -> None:
        self._fold_timer = None
        if self.stopped:
            return
        if self.fold_words():
            t = now_us()
            self.deliver(self.scheduler.drain_cleanup(t), t)
            self.tally.flush_if_full()
        self._arm_fold_timer()

    def _handle_data(self, identity: bytes, payload: bytes, t: int) -> int | None:
        """Handle one message; returns the frames of a Batch, 0 for a heartbeat DEALER's beat (not a
        data frame), else None (one frame)."""
        conn = self.conns.get(identity)
        if conn is None:
            reply = self.beats.answer(payload, t)
            if reply is not None:  # credits the data connection its token names; never a connection itself
                self._send_raw(identity, reply)
                return 0
        if conn is None and self.conns.died(identity):
            self.dropped_dead_frames += 1
            notice = self.conns.dead_notice(identity)  # the first frame only: a wrong pid may be listening
            if notice is not None:
                self._refuse(identity, notice, envelope=False, code=p.ErrorCode.NOT_HELLO)
            return None
        if conn is None:
            conn = self.conns.open(identity, t)
            self.metrics.connections.set(len(self.conns))
        conn.last_seen_us = t
        if len(payload) > self.max_frame_bytes:  # read only up to the transport's cut (sockets.transport_cut)
            self._error(
                conn,
                p.ErrorCode.OVERSIZED,
                f"message of {len(payload):,} bytes exceeds max_frame_bytes {self.max_frame_bytes:,}: "
                "split it into several messages, or send fewer block hashes",
                p.peek_request_id(payload),
            )
            return None
        try:
            frame = self.dec.decode(payload)
        except Exception as exc:
            frames = (
                p.batch_frames(payload, p.MAX_LIST)  # only what the walk is for: nesting msgspec gave up on
                if type(exc) is RecursionError and conn.protocol_version >= _BATCH_MIN_VERSION
                else None
            )
            if frames is None:
                self._undecodable(conn, payload, exc)
                return None
            frame = p.Batch(
                [msgspec.Raw(f) for f in frames]
            )  # one frame nested too deep fails alone, the others are handled
        if conn.protocol_version == 0 and not isinstance(frame, p.Hello):
            self._error(
                conn,
                p.ErrorCode.NOT_HELLO,
                self.conns.not_hello_reason(conn.identity),
                getattr(frame, "request_id", None),
            )
            return None
        if type(frame) is _BATCH:
            return self._on_batch(conn, frame, t)
        self._handle_frame(conn, frame, t)
        return None

    def _handle_frame(self, conn: Connection, frame: Any, t: int) -> None:
        """One decoded frame (not a Batch): its handler in the dispatch table, by exact type."""
        handler = self._dispatch.get(type(frame))
        if handler is not None:
            handler(conn, frame, t)

    def _undecodable(self, conn: Connection, payload: bytes, exc: Exception) -> None:
        """Answer a frame the typed decoder refused. Only bounded, typed peeks run here (never an
        untyped decode, which deep nesting turns into a RecursionError): one for the admin tag, one
        for the request id, each allowed to fail."""
        if p.peek_admin_tag(payload):
            self._error(conn, p.ErrorCode.ADMIN_ON_DATA_SOCKET, "admin frames are accepted on the admin socket only")
            return
        detail = (
            (f"undecodable frame: {str(exc)[:300]} (a frame is a MessagePack array [tag, fields...], docs/PROTOCOL.md)")
            if isinstance(exc, (msgspec.DecodeError, msgspec.ValidationError))
            else f"undecodable frame ({type(exc).__name__}: nested too deep or too large)"
        )
        self._error(conn, p.ErrorCode.MALFORMED, detail, p.peek_request_id(payload))

    def _on_batch(self, conn: Connection, batch: p.Batch, t: int) -> int:
        """Begin a Batch: its frames are handled in order by `_resume_batch`, as if they had arrived
        one by one. Returns 1 for a batch refused or empty (one frame's worth), else 0 (not counted yet)."""
        if conn.protocol_version < p.BATCH_MIN_VERSION:
            self._error(
                conn,
                p.ErrorCode.MALFORMED,
                f"batch frames need protocol version {p.BATCH_MIN_VERSION}; this connection said "
                f"Hello with version {conn.protocol_version}",
            )
            return 1
        self.tally.batches += 1
        if not batch.frames:
            return 1
        self._carry = (conn, batch.frames, 0)
        return 0

    def _resume_batch(self, room: int, t: int) -> int:
        """Handle the next frames, at most `room`, of the Batch being handled; returns how many.

        The rest waits for the next wakes, which handle it before reading another message: so
        `frame_budget_per_wake` bounds every wake, however many frames one message carries (a client
        coalesces a loop turn's frames into batches of up to `max_frame_bytes`, tens of thousands of
        Enqueues), and the admin socket and the timers run between them. What remains of a batch
        whose connection was closed meanwhile (found dead) is dropped, as its unread messages are.
        """
        assert self._carry is not None
        conn, frames, start = self._carry
        if not conn.alive:
            self.dropped_dead_frames += len(frames) - start
            self._carry = None
            return 0
        end = min(len(frames), start + room)
        decode = self.batch_dec.decode
        handle = self._handle_frame
        i = start
        try:
            while i < end:
                raw = frames[i]
                self._batch_index = i
                i += 1  # past this frame even if handling it raises: a frame is never handled twice
                try:
                    frame = decode(raw)
                except Exception as exc:
                    self._undecodable(conn, raw, exc)  # its Error carries batch_index
                    continue
                handle(conn, frame, t)
        finally:
            self._batch_index = None
            self._carry = (conn, frames, i) if i < len(frames) else None
        return i - start

    def _on_hello(self, conn: Connection, frame: p.Hello, t: int) -> None:
        if not (p.PROTOCOL_MIN <= frame.protocol_version <= p.PROTOCOL_MAX):
            self._error(
                conn,
                p.ErrorCode.VERSION,
                f"protocol {frame.protocol_version} not in [{p.PROTOCOL_MIN}, {p.PROTOCOL_MAX}]",
            )
            return
        self.conns.hello(conn, frame.protocol_version, frame.pid, frame.client_name, frame.host, frame.pid_ns)
        log.info(
            "router connected owner=%d client=%s pid=%d host=%s pid_ns=%d pid_watch=%s",
            conn.owner,
            frame.client_name,
            frame.pid,
            frame.host,
            frame.pid_ns,
            conn.pid != 0,
        )
        self._send(conn, msgspec.structs.replace(self.welcome, conn_token=conn.conn_token))

    def _on_heartbeat(self, conn: Connection, frame: p.Heartbeat, t: int) -> None:
        self._send(conn, p.HeartbeatAck(frame.seq))

    def _on_release(self, conn: Connection, f: p.Release, t: int) -> None:
        """A Release: the lease's duration is observed, then the scheduler applies it (idempotent;
        a stale or repeated release, whose generation no longer matches, is not observed)."""
        self.releases_this_wake += 1
        if self._owns(conn, f.request_id):
            started = self.scheduler.lease_started(f.slot, f.generation)
            if started is not None:
                self.tally.lease_s.setdefault(started[0], []).append(max(0, t - started[1]) / 1e6)
            self.scheduler.release(f.request_id, f.slot, f.generation, f.outcome, f.context_tokens, t)

    def _on_enqueue(self, conn: Connection, f: p.Enqueue, t: int) -> None:
        problem = enqueue_problem(f, self.accepting, conn.inflight, self.cfg.inflight_cap_per_connection)
        if problem is not None:
            self._send_reject(conn, f.request_id, problem[0], problem[1], f.policy_class)
            return
        conn.inflight += 1
        spec = spec_from_enqueue(f, conn.owner, t)
        if self.scheduler.cleanup_pending(f.request_id):  # its release is buffered: clean up first
            self.deliver(self.scheduler.drain_cleanup(t), t)
        outcomes = self.scheduler.enqueue(spec, t)
        self.deliver(outcomes, t)
        if outcomes and type(outcomes[0]) is Admit and outcomes[0].request_id == f.request_id:
            self.tally.admission_s.append((now_us() - t) / 1e6)

    def _owns(self, conn: Connection, request_id: str) -> bool:
        """Only the connection that owns a request may update or release it; others get an Error."""
        owner = self.scheduler.owner_of(request_id)
        if owner is None or owner == conn.owner:
            return True
        self._error(
            conn, p.ErrorCode.UNKNOWN_REQUEST, f"request {request_id!r} belongs to another connection", request_id
        )
        return False

    def _on_update(self, conn: Connection, f: p.Update, t: int) -> None:
        """Apply one Update; `kvsched_update_frames{kind}` counts those that reached a live lease (one
        for an unknown or foreign lease is answered an error and counted there, not here)."""
        if not self._owns(conn, f.request_id):
            return
        updates = self.tally.updates
        if f.kind == "requeue" and not self.accepting:  # stopping: give the booking back, answer now
            updates[f.kind] = updates.get(f.kind, 0) + 1
            self.scheduler.release(f.request_id, f.slot, f.generation, "aborted", 0, t)
            self._send_reject(conn, f.request_id, "shutting_down", "the daemon is stopping", "")
            return
        try:
            outcomes = self.scheduler.update(f.request_id, f.slot, f.generation, f.kind, f.output_tokens, t)
        except KeyError:
            self._error(
                conn,
                p.ErrorCode.UNKNOWN_REQUEST,
                f"no lease ({f.request_id}, slot={f.slot}, generation={f.generation})",
                f.request_id,
            )
            return
        updates[f.kind] = updates.get(f.kind, 0) + 1
        if f.kind == "requeue":
            conn.inflight += 1
        if outcomes:
            self.deliver(outcomes, t)

    def _on_reattach(self, conn: Connection, f: p.Reattach, t: int) -> None:
        """A reconnected client claims its leases and re-sends its waiting Enqueues (docs/DESIGN.md
        §5.6); who may claim a request is the Scheduler's rule (`may_take_over`)."""
        s = self.scheduler
        kept, lost = [], []
        for ref in f.leases:
            if s.may_take_over(ref.request_id, conn.owner) and s.adopt_lease(
                ref.request_id, ref.slot, ref.generation, conn.owner, t
            ):
                kept.append(ref.request_id)
            else:
                lost.append(ref.request_id)
        self._send(conn, p.Reattached(kept=kept, lost=lost))
        for rq in f.requeues:  # requeues in flight: before pending, in list order
            ref, enq = rq.lease, rq.enqueue
            if (
                ref.request_id == enq.request_id
                and s.may_take_over(ref.request_id, conn.owner)
                and s.adopt_lease(ref.request_id, ref.slot, ref.generation, conn.owner, t)
            ):
                self._on_update(conn, p.Update(ref.request_id, ref.slot, ref.generation, "requeue"), t)
            else:  # the requeue was applied (same daemon) or the lease is gone (restarted daemon)
                self._reattach_pending(conn, enq, t)
        for enq in f.pending:
            self._reattach_pending(conn, enq, t)
        log.info(
            "reattach owner=%d kept=%d lost=%d pending=%d requeues=%d",
            conn.owner,
            len(kept),
            len(lost),
            len(f.pending),
            len(f.requeues),
        )

    def _reattach_pending(self, conn: Connection, enq: p.Enqueue, t: int) -> None:
        """A re-sent Enqueue: hand a request this daemon still holds to `conn`, else enqueue it."""
        if not self.scheduler.may_take_over(enq.request_id, conn.owner):
            self._on_enqueue(conn, enq, t)  # answered duplicate_request
            return
        got = self.scheduler.adopt_waiting(enq.request_id, conn.owner)
        if got is False:
            self._on_enqueue(conn, enq, t)
        else:
            conn.inflight += 1
            if isinstance(got, Admit):
                self.deliver([got], t)

    def deliver(self, outcomes: list, t: int) -> None:
        """Send Admitted / Rejected for the Scheduler's outcomes at `t` (µs). An admission nobody can
        receive (its owner unknown, dead, or its queue full) is released at once and the cleanup pass
        that follows delivered too (docs/DESIGN.md §4.11: a failed delivery must release)."""
        tally, urls, s = self.tally, self.worker_urls, self.scheduler
        while outcomes:
            released = False
            for o in outcomes:
                conn = self.conns.by_owner(o.owner)
                if type(o) is Admit:
                    w = o.worker.worker_id
                    frame = admitted_frame(o, urls.get(w, ""), s.ranks_of(w))
                    if conn is not None and conn.alive and self._send(conn, frame, o):
                        conn.inflight -= 1
                        tally.admissions[o.policy_class] = tally.admissions.get(o.policy_class, 0) + 1
                        tally.queue_wait_s.append(o.queued_us / 1e6)
                    elif o.owner != DAEMON_OWNER:
                        tally.undeliverable += 1
                        s.release(o.request_id, o.slot, o.generation, "aborted", 0, t)
                        released = True
                elif isinstance(o, Reject):
                    if not o.revoked:  # a revocation notice (lease cancelled / worker removed) rejects nothing
                        tally.rejections[o.reason] = tally.rejections.get(o.reason, 0) + 1
                    if conn is not None and conn.alive:
                        if not o.revoked:
                            conn.inflight -= 1
                        self._send(conn, rejected_frame(o))
            outcomes = s.drain_cleanup(t) if released else []

    def _send_reject(
        self, conn: Connection, request_id: str, reason: p.RejectReason, detail: str, policy_class: str
    ) -> None:
        rejections = self.tally.rejections
        rejections[reason] = rejections.get(reason, 0) + 1
        self._send(conn, p.Rejected(request_id, reason, detail, policy_class))

    def _error(self, conn: Connection, code: p.ErrorCode, message: str, request_id: str | None = None) -> None:
        self.metrics.malformed.labels(code=code.name.lower()).inc()
        self.warn.warning(
            f"bad-frame-{code.name}", "frame rejected owner=%d code=%s detail=%s", conn.owner, code.name, message[:200]
        )
        self._send(conn, p.Error(int(code), message, request_id, self._batch_index))

    def _send(self, conn: Connection, frame: p.DaemonFrame, admit: Admit | None = None) -> bool:
        """Send one frame to a peer. False when the peer is unknown to ZeroMQ or its queue is full.

        To a version-2 peer the frame is queued and sent with everything else this wake owes it
        (`_flush_replies`); an `admit` that then proves undeliverable is released there.
        """
        if conn.protocol_version >= _BATCH_MIN_VERSION:
            self.outbox.add(conn, self.enc.encode(frame), admit)
            return True
        return self.outbox.send_now(conn, self.enc.encode(frame))

    def _flush_replies(self) -> None:
        """Send what this wake owes the version-2 peers; release admissions nobody can receive.

        Releasing them runs one cleanup pass, which may admit more requests and so owe more
        replies: those are sent on the next loop turn, not here. A peer gone with a long queue is
        admitted one capacity's worth at a time, each undeliverable, until the reaper cancels its
        requests; looping here until nothing was lost held the loop that long (100,000 requests
        of a killed flooder kept `kvsched queues` waiting 18 s, tests/daemon/test_admin_flood.py).
        """
        if self.stopped:  # the sockets are closed (a queued safety-net flush after stop_reading)
            return
        lost = self.outbox.flush()
        if not lost:
            return
        t = now_us()
        for o in lost:
            self.tally.undeliverable += 1
            self.scheduler.release(o.request_id, o.slot, o.generation, "aborted", 0, t)
        self.deliver(self.scheduler.drain_cleanup(t), t)
        if self.outbox and self._flush_queued is None:
            self._flush_queued = self.loop.call_soon(self._flush_outside_wake)

    def _flush_outside_wake(self) -> None:
        """The outbox's callback for replies owed outside a wake (timers, admin): flush them, then
        look at the data socket again when something was sent — a send can swallow the FD's edge
        of a frame that arrived meanwhile (tests/daemon/test_wake.py)."""
        self._flush_queued = None
        sends = self.outbox.sends
        self._flush_replies()
        if not self.stopped and self.outbox.sends != sends:
            self.data_reader.rearm()

    def _send_raw(self, identity: bytes, raw: bytes) -> None:
        """Send an encoded frame to a routing id that is no connection (a heartbeat DEALER); dropped
        when ZeroMQ cannot route or queue it (the peer is gone, or reads nothing)."""
        try:
            self.outbox.sends += 1
            self.data_sock.send_multipart((identity, raw), _NOBLOCK)
        except zmq.ZMQError:
            pass

    def _refuse(self, identity: bytes, message: str, envelope: bool, code: p.ErrorCode = p.ErrorCode.MALFORMED) -> None:
        """Answer a message from a peer without a connection entry with `error{code}` (in a REQ's
        envelope when `envelope`): bad input gets an answer, never silence."""
        try:
            raw = self.enc.encode(p.Error(int(code), message))
            self.outbox.sends += 1
            self.data_sock.send_multipart((identity, b"", raw) if envelope else (identity, raw), _NOBLOCK)
        except zmq.ZMQError:
            pass

    # ------------------------------------------------------------------ admin socket
    def _serve_admin(self) -> bool:
        """The admin socket's drain (`Reader`): answer the admin messages (`AdminSocket.serve`), then
        one `drain_cleanup`. True when more may wait."""
        assert self.admin is not None
        if self.stopped:
            return False
        t = now_us()
        n = self.admin.serve(t, self.deliver)
        if n:
            self.deliver(self.scheduler.drain_cleanup(t), t)
            self.tally.flush()
        return n == ADMIN_BUDGET or readable(self.admin.sock)

    # ------------------------------------------------------------------ timers
    def after_tick(self) -> None:
        """The `Ticker`'s call after each tick: arm the fold timer, look at the data socket again."""
        self._arm_fold_timer()
        self.data_reader.rearm()
