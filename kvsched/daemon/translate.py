"""Frames ↔ core calls: what the actor does with each decoded router frame, and how the core's
`Admit` / `Reject` records become `Admitted` / `Rejected` frames (docs/PROTOCOL.md).

The actor pumps the sockets (receive, decode, send, flush); the `Translator` turns each frame into
Scheduler calls and each outcome into a reply, without policy of its own: every decision comes from
the Scheduler, including who may claim a request on Reattach (`Scheduler.may_take_over`). An
`Admitted` that cannot be delivered (ROUTER_MANDATORY raises EHOSTUNREACH, or the owner is known
dead) is released at once (docs/DESIGN.md §4.11: a failed delivery must release).

Metrics of the decision path are counted in a `WakeTally` (plain ints and lists) and written to
Prometheus in bulk (`WakeTally.flush`): by the actor's tick every 100 ms (`tick.LIVENESS_EVERY_US`)
or when `FLUSH_SAMPLES` samples are pending, never once per frame.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .. import protocol as p
from ..core.types import DAEMON_OWNER, Admit, Reject, RequestSpec, WorkerKey
from .connections import Connection
from .tally import WakeTally, now_us


class Translator:
    """Router frames → Scheduler calls → reply frames.

    Args:
        scheduler: the `Scheduler`; conns: the `ConnectionTable`.
        send: `(conn, frame, admit=None) -> bool` (the actor's send; False = not delivered).
        error: `(conn, ErrorCode, message, request_id=None)` (the actor's Error reply).
        tally: the `WakeTally` the actor flushes once per wake.
        daemon_cfg: `DaemonConfig` (in-flight cap per connection).
        worker_urls: worker_id -> base URL sent in `Admitted.url`.
    Attributes:
        accepting: False once shutdown began (Enqueues and requeues are answered `shutting_down`).
        releases_this_wake: Release frames since the actor last read it (cleanup batch size).
    """

    def __init__(
        self,
        scheduler,
        conns,
        send: Callable,
        error: Callable,
        tally: WakeTally,
        daemon_cfg,
        worker_urls: dict[int, str],
    ) -> None:
        self.scheduler, self.conns, self.send, self.error, self.tally = scheduler, conns, send, error, tally
        self.cfg = daemon_cfg
        self.worker_urls = worker_urls
        self.accepting = True
        self.releases_this_wake = 0

    def handle(self, conn: Connection, frame, t: int) -> None:
        """One decoded frame other than Hello (the actor answers Hello itself). Dispatch is by exact
        type, the lifecycle's two frames first (a `match` on class patterns costs an isinstance
        check per case)."""
        tp = type(frame)
        if tp is p.Enqueue:
            self.on_enqueue(conn, frame, t)
        elif tp is p.Release:
            self.on_release(conn, frame, t)
        elif tp is p.Update:
            self.on_update(conn, frame, t)
        elif tp is p.Heartbeat:
            self.send(conn, p.HeartbeatAck(frame.seq))
        elif tp is p.Reattach:
            self.on_reattach(conn, frame, t)

    def on_release(self, conn: Connection, f: p.Release, t: int) -> None:
        """A Release: the lease's duration is observed, then the scheduler applies it (idempotent)."""
        self.releases_this_wake += 1
        if self.owns(conn, f.request_id):
            self._observe_lease(f.slot, f.generation, t)
            self.scheduler.release(f.request_id, f.slot, f.generation, f.outcome, f.context_tokens, t)

    def _observe_lease(self, slot: int, generation: int, t: int) -> None:
        """A lease's duration, just before the scheduler applies its Release (stale or repeated
        releases, whose generation no longer matches, are not observed)."""
        a = self.scheduler.ledger.arrays
        # `.item` gives Python ints: no numpy scalar per read, no mixed-type comparison
        if not (0 <= slot < len(a.s_state)) or a.s_state.item(slot) == 0 or a.s_generation.item(slot) != generation:
            return
        idx = a.s_class.item(slot)
        classes = self.scheduler.pq.classes
        if 0 <= idx < len(classes):
            self.tally.lease_s.setdefault(classes[idx].name, []).append(max(0, t - a.s_admit_us.item(slot)) / 1e6)

    # ------------------------------------------------------------------ Enqueue
    def on_enqueue(self, conn: Connection, f: p.Enqueue, t: int) -> None:
        reject = self.precheck_enqueue(conn, f)
        if reject is not None:
            self.send_reject(conn, f.request_id, reject[0], reject[1], f.policy_class)
            return
        conn.inflight += 1
        spec = spec_from_enqueue(f, conn.owner, t)
        if self.scheduler.cleanup_pending(f.request_id):  # its release is buffered: clean up first
            self.deliver(self.scheduler.drain_cleanup(t), t)
        outcomes = self.scheduler.enqueue(spec, t)
        self.deliver(outcomes, t)
        if outcomes and type(outcomes[0]) is Admit and outcomes[0].request_id == f.request_id:
            self.tally.admission_s.append((now_us() - t) / 1e6)

    def precheck_enqueue(self, conn: Connection, f: p.Enqueue) -> tuple[str, str] | None:
        if not self.accepting:
            return "shutting_down", "the daemon is stopping"
        if conn.inflight >= self.cfg.inflight_cap_per_connection:
            return "overloaded", f"in-flight cap {self.cfg.inflight_cap_per_connection} reached on this connection"
        rid = f.request_id  # at most 4 UTF-8 bytes per character: short ids are not encoded to be measured
        if 4 * len(rid) > p.MAX_REQUEST_ID_BYTES and len(rid.encode()) > p.MAX_REQUEST_ID_BYTES:
            return "invalid", f"request_id longer than {p.MAX_REQUEST_ID_BYTES} UTF-8 bytes"
        if len(f.block_hashes) % 8:
            return "invalid", "block_hashes length is not a multiple of 8 bytes"
        return None

    def owns(self, conn: Connection, request_id: str) -> bool:
        """Only the connection that owns a request may update or release it; others get an Error."""
        owner = self.scheduler.owner_of(request_id)
        if owner is None or owner == conn.owner:
            return True
        self.error(
            conn, p.ErrorCode.UNKNOWN_REQUEST, f"request {request_id!r} belongs to another connection", request_id
        )
        return False

    # ------------------------------------------------------------------ Update
    def on_update(self, conn: Connection, f: p.Update, t: int) -> None:
        """Apply one Update; `kvsched_update_frames{kind}` counts those that reached a live lease (one
        for an unknown or foreign lease is answered an error and counted there, not here)."""
        if not self.owns(conn, f.request_id):
            return
        updates = self.tally.updates
        if f.kind == "requeue" and not self.accepting:  # stopping: give the booking back, answer now
            updates[f.kind] = updates.get(f.kind, 0) + 1
            self.scheduler.release(f.request_id, f.slot, f.generation, "aborted", 0, t)
            self.send_reject(conn, f.request_id, "shutting_down", "the daemon is stopping", "")
            return
        try:
            outcomes = self.scheduler.update(f.request_id, f.slot, f.generation, f.kind, f.output_tokens, t)
        except KeyError:
            self.error(
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

    # ------------------------------------------------------------------ Reattach
    def on_reattach(self, conn: Connection, f: p.Reattach, t: int) -> list[str]:
        """A reconnected client claims its leases and re-sends its waiting Enqueues (docs/DESIGN.md §5.6).
        Returns the kept request ids (the actor logs the counts)."""
        s = self.scheduler
        kept, lost = [], []
        for ref in f.leases:
            if s.may_take_over(ref.request_id, conn.owner) and s.adopt_lease(
                ref.request_id, ref.slot, ref.generation, conn.owner, t
            ):
                kept.append(ref.request_id)
            else:
                lost.append(ref.request_id)
        self.send(conn, p.Reattached(kept=kept, lost=lost))
        for rq in f.requeues:  # requeues in flight: before pending, in list order
            ref, enq = rq.lease, rq.enqueue
            if (
                ref.request_id == enq.request_id
                and s.may_take_over(ref.request_id, conn.owner)
                and s.adopt_lease(ref.request_id, ref.slot, ref.generation, conn.owner, t)
            ):
                self.on_update(conn, p.Update(ref.request_id, ref.slot, ref.generation, "requeue"), t)
            else:  # the requeue was applied (same daemon) or the lease is gone (restarted daemon)
                self.reattach_pending(conn, enq, t)
        for enq in f.pending:
            self.reattach_pending(conn, enq, t)
        return kept

    def reattach_pending(self, conn: Connection, enq: p.Enqueue, t: int) -> None:
        """A re-sent Enqueue: hand a request this daemon still holds to `conn`, else enqueue it."""
        if not self.scheduler.may_take_over(enq.request_id, conn.owner):
            self.on_enqueue(conn, enq, t)  # answered duplicate_request
            return
        got = self.scheduler.adopt_waiting(enq.request_id, conn.owner)
        if got is False:
            self.on_enqueue(conn, enq, t)
        else:
            conn.inflight += 1
            if isinstance(got, Admit):
                self.deliver([got], t)

    # ------------------------------------------------------------------ outcomes → frames
    def deliver(self, outcomes: list, t: int) -> None:
        """Send Admitted/Rejected for scheduler outcomes; release what cannot be delivered."""
        tally = self.tally
        while outcomes:
            released = False
            for o in outcomes:
                conn = self.conns.by_owner(o.owner)
                if type(o) is Admit:
                    ok = conn is not None and conn.alive and self.send(conn, self.admitted_frame(o), o)
                    if ok:
                        conn.inflight -= 1
                        tally.admissions[o.policy_class] = tally.admissions.get(o.policy_class, 0) + 1
                        tally.queue_wait_s.append(o.queued_us / 1e6)
                    elif o.owner != DAEMON_OWNER:
                        tally.undeliverable += 1
                        self.scheduler.release(o.request_id, o.slot, o.generation, "aborted", 0, t)
                        released = True
                elif isinstance(o, Reject):
                    if not o.revoked:  # a revocation notice (lease cancelled / worker removed) rejects nothing
                        tally.rejections[o.reason] = tally.rejections.get(o.reason, 0) + 1
                    if conn is not None and conn.alive:
                        if not o.revoked:
                            conn.inflight -= 1
                        self.send(conn, rejected_frame(o))
            outcomes = self.scheduler.drain_cleanup(t) if released else []

    def admitted_frame(self, o: Admit) -> p.Admitted:
        """The `Admitted` frame of an admission (worker URL and rank count added)."""
        w = o.worker
        return p.Admitted(
            o.request_id,
            w.worker_id,
            w.dp_rank,
            o.slot,
            o.generation,
            o.overlap_blocks,
            o.cached_tokens,
            o.queued_us,
            self.worker_urls.get(w.worker_id, ""),
            self.scheduler.ledger.ranks_of(w.worker_id) or 1,
        )

    def send_reject(self, conn: Connection, request_id: str, reason: str, detail: str, policy_class: str) -> None:
        rejections = self.tally.rejections
        rejections[reason] = rejections.get(reason, 0) + 1
        self.send(conn, p.Rejected(request_id, reason, detail, policy_class))


_HASH_DTYPE = np.dtype("<u8")  # a dtype object: np.frombuffer parses a dtype string on every call (~0.6 µs)


def spec_from_enqueue(f: p.Enqueue, owner: int, t: int) -> RequestSpec:
    """The core's `RequestSpec` of an `Enqueue` frame from connection `owner`, received at `t` (µs).
    `block_hashes` is a read-only uint64 view of the frame's bytes (no copy)."""
    return RequestSpec(
        request_id=f.request_id,
        isl_tokens=f.isl_tokens,
        block_hashes=np.frombuffer(f.block_hashes, _HASH_DTYPE),
        policy_class=f.policy_class,
        priority=f.priority,
        strict_priority=f.strict_priority,
        session_id=f.session_id,
        expected_osl=f.expected_osl,
        pinned=WorkerKey(*f.pinned) if f.pinned else None,
        allowed_workers=frozenset(f.allowed_workers) if f.allowed_workers is not None else None,
        do_not_queue=f.do_not_queue,
        deadline_us=t + f.deadline_ms * 1000 if f.deadline_ms is not None else None,
        lora_name=f.lora_name,
        owner=owner,
        excluded_workers=frozenset(f.excluded_workers) if f.excluded_workers else None,
    )


def rejected_frame(o: Reject) -> p.Rejected:
    """The `Rejected` frame of a rejection record."""
    return p.Rejected(o.request_id, o.reason, o.detail, o.policy_class, o.limit_kind, o.current, o.limit)
