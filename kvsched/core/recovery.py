"""Ownership and recovery of leases: who may touch a request, aborting everything a dead router or
an operator cancels, re-adoption after a daemon restart, reattachment after a client reconnect.

A restarted daemon finds its leases in the shared-memory slot table. `restore_after_restart` turns
each into a live lease owned by the daemon itself (owner 0, an *orphan*) and rebuilds the aggregates
from the slot table; a client that reconnects claims its leases with `adopt_lease` (the
`Reattach` frame). Orphans nobody claims within the grace period (the liveness timeout) are released
by `tick`, so nothing admitted is lost and nothing is booked twice.

Mixed into `Scheduler`; pure and synchronous like the rest of the core.
"""

from __future__ import annotations

from .dispatch import LEASED, Live
from .ordering import QueueEntry
from .types import Admit, Reject, RequestSpec

ORPHAN = 0  # owner id of leases re-adopted from the slot table, until a client claims them


class Recovery:
    """Ownership queries and restart/reattach operations over the Scheduler's maps."""

    _orphan_deadline_us: int | None = None
    orphans_released = 0  # set by _expire_orphans, read and reset by the actor (for its log line)

    def owner_of(self, request_id: str) -> int | None:
        """Owner id of a live request (waiting or leased), or None when it is not live."""
        live = self._live.get(request_id)
        return None if live is None else live.spec.owner

    def owned_count(self, owner: int) -> int:
        """Live requests (waiting or leased) owned by `owner`."""
        return len(self._by_owner.get(owner, ()))

    def cancel_owner(self, owner: int, now_us: int) -> None:
        """Router death: every lease and waiting request of `owner` is aborted (batched)."""
        for rid in list(self._by_owner.get(owner, ())):
            live = self._live[rid]
            if live.state == LEASED:
                self.release(rid, live.slot, live.generation, "aborted", 0, now_us)
            else:
                self.release(rid, -1, 0, "cancelled", 0, now_us)

    def cancel(self, request_id: str, now_us: int) -> list[Reject] | None:
        """Admin cancel: remove a waiting request or abort a lease; None when unknown.

        Returns one `Reject("cancelled")` for the owner: for a waiting request it is the answer to its
        Enqueue; for a lease it is a revocation notice (`revoked=True`) telling the holder to stop.
        """
        live = self._live.get(request_id)
        if live is None:
            return None
        cls_name = self.pq.classes[live.entry.class_idx].name
        leased = live.state == LEASED
        if leased:
            self.release(request_id, live.slot, live.generation, "aborted", 0, now_us)
        else:
            self.release(request_id, -1, 0, "cancelled", 0, now_us)
        reject = self._reject(live.spec, "cancelled", "cancelled by an operator", cls_name)
        if leased:
            reject = Reject(reject.request_id, reject.owner, reject.reason, "lease revoked by an operator",
                            reject.policy_class, revoked=True)
        return [reject]

    def restore_after_restart(self, now_us: int, grace_us: int) -> int:
        """Adopt every booking of the slot table as an orphan lease; returns how many.

        Every router word (progress and state) is folded first, so a `dispatched` / `prefill_done` /
        output-token store made while no daemon ran counts; then the aggregates are recomputed from
        the slot table (the previous process may have died between two writes). Orphans are
        released by `tick` at `now_us + grace_us` unless claimed first.
        """
        ledger = self.ledger
        ledger.fold_progress(every_slot=True)
        ledger.take_dispatched()  # no policy tracks an orphan
        ledger.rebuild_aggregates()
        n_classes = len(self.pq.classes)
        count = 0
        for slot in ledger.live_slots():
            info = ledger.slot_info(slot)
            c = info.class_idx if 0 <= info.class_idx < n_classes else self._default
            spec = RequestSpec(request_id=info.request_id, isl_tokens=max(1, info.isl),
                               policy_class=self.pq.classes[c].name, owner=ORPHAN)
            entry = QueueEntry(info.request_id, next(self._seq), info.enqueue_us, 0, 0,
                               max(1, info.isl - info.cached), max(1, info.isl), None, c)
            live = Live(spec, entry, state=LEASED, slot=slot, generation=info.generation)
            entry.payload = live
            self._register(live)
            self._by_slot[slot] = live
            count += 1
        self._orphan_deadline_us = now_us + grace_us if count else None
        return count

    def adopt_lease(self, request_id: str, slot: int, generation: int, owner: int, now_us: int) -> bool:
        """Give the lease (request_id, slot, generation) to `owner` (a reconnected client).
        False when no such lease is live (it was released: the client must treat it as lost)."""
        live = self._by_slot.get(slot)
        if live is None or live.spec.request_id != request_id or live.generation != generation:
            return False
        self._set_owner(live, owner)
        return True

    def adopt_waiting(self, request_id: str, owner: int) -> Admit | bool:
        """A reconnected client re-sends an Enqueue for `request_id`. If the request is still live
        (queued, or admitted but the answer was lost in the outage) it now belongs to `owner`: returns
        the `Admit` to send again for a lease, True for a waiting request, False when it is not live
        (the Enqueue is then processed normally)."""
        live = self._live.get(request_id)
        if live is None:
            return False
        self._set_owner(live, owner)
        if live.state != LEASED:
            return True
        info = self.ledger.slot_info(live.slot)
        return Admit(request_id, owner, self.ledger.key_of(info.row), live.slot, live.generation,
                     info.cached // self.ledger.block_size, info.cached, max(0, info.admit_us - info.enqueue_us),
                     live.spec.policy_class)

    def _set_owner(self, live: Live, owner: int) -> None:
        old = live.spec.owner
        rid = live.spec.request_id
        ids = self._by_owner.get(old)
        if ids is not None:
            ids.discard(rid)
            if not ids:
                del self._by_owner[old]
        counted = live.share_key is not None
        self._shares.remove(live)
        live.spec.owner = owner
        if counted:
            self._shares.add(live)
        self._by_owner.setdefault(owner, set()).add(rid)

    def _expire_orphans(self, now_us: int) -> int:
        """Release the orphan leases nobody claimed within the grace period; returns how many."""
        if self._orphan_deadline_us is None or now_us < self._orphan_deadline_us:
            return 0
        self._orphan_deadline_us = None
        orphans = list(self._by_owner.get(ORPHAN, ()))
        self.orphans_released = len(orphans)  # the actor logs it
        for rid in orphans:
            live = self._live[rid]
            if live.state == LEASED:
                self.release(rid, live.slot, live.generation, "aborted", 0, now_us)
        return len(orphans)
