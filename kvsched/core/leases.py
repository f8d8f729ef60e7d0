"""LeaseTable: every live request (waiting or leased), by id, by slot and by owner, and the rules
of who may touch, claim or adopt one.

Ownership rules (docs/PROTOCOL.md "Daemon → router (data socket)"; docs/DESIGN.md §5.4, §5.6):
* only the owner of a request may update or release it (`owner_of`);
* a reconnected client may take over a request owned by the daemon itself (`DAEMON_OWNER`: leases
  re-adopted from the slot table after a restart), by itself, by an owner known gone
  (`owner_alive` False), or by an earlier connection of the same process (`same_process`: same pid,
  host and PID namespace, as a client's reconnect is) — `may_take_over`;
* a restarted daemon adopts each booking of the slot table as an orphan lease (owner
  `DAEMON_OWNER`); orphans nobody claims within the grace period are released (`expired_orphans`),
  so nothing admitted is lost and nothing is booked twice.

Pure and synchronous like the rest of the core.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..protocol import LeaseRow
from .live import DEFERRED, GONE, LEASED, READY, Live
from .ordering import QueueEntry
from .types import DAEMON_OWNER, Admit, RequestSpec

if TYPE_CHECKING:
    from .ledger import Ledger
    from .policy_feed import PolicyFeed
    from .waiting_share import WaitingShares

_SLOT_STATES = {1: "admitted", 2: "dispatched", 3: "prefill_done"}  # slot state -> `LeaseRow.state`


@dataclass(frozen=True, slots=True)
class OrphanCounts:
    """Leases re-adopted from the slot table after a restart (owner `DAEMON_OWNER`).

    Attributes:
        adopted: orphan leases adopted at start.
        released: orphans nobody claimed, released at the grace deadline (0 before it).
        deadline_us: when unclaimed orphans are released (µs, scheduler clock), or None.
    """

    adopted: int
    released: int = 0
    deadline_us: int | None = None

    @property
    def claimed(self) -> int:
        """Orphans a reconnected client claimed before the deadline (meaningful once released)."""
        return self.adopted - self.released


class LeaseTable:
    """request_id -> Live; slot -> Live (leased); owner -> request ids.

    `by_owner[o]` is a dict of ids (values None), not a set: it keeps the order the requests became
    `o`'s, so an owner's requests are walked in that order — deterministic, and, for a dead router's
    whole queue, in the order they were allocated, which makes the walk several times faster than a
    set's hash order over the same objects (`bench/bench_cancel_owner.py`).

    Args:
        ledger: the `Ledger` (slot table reads for adoption).
        shares: the `WaitingShares` (waiting requests are counted per owner).
        feed: the `PolicyFeed` (aborted requests tell their policy).
        owner_alive: owner id -> False when the requester is known gone.
        same_process: (owner a, owner b) -> True when both connections belong to one process.
    Invariant: `by_slot` holds exactly the LEASED entries of `live`; every id of `by_owner[o]` is in
    `live` with owner o.
    """

    def __init__(
        self,
        ledger: Ledger,
        shares: WaitingShares,
        feed: PolicyFeed,
        owner_alive: Callable[[int], bool],
        same_process: Callable[[int, int], bool],
    ) -> None:
        self.ledger, self.shares, self.feed = ledger, shares, feed
        self.owner_alive = owner_alive
        self.same_process = same_process
        self.live: dict[str, Live] = {}
        self.by_slot: dict[int, Live] = {}
        self.by_owner: dict[int, dict[str, None]] = {}  # owner -> its request ids, in arrival order
        self.orphans: OrphanCounts | None = None
        self._orphan_report: OrphanCounts | None = None

    # ---- membership --------------------------------------------------------------------------
    def register(self, live: Live) -> None:
        """Make `live` known (by id, by owner, and by slot when it is born a lease)."""
        self.live[live.spec.request_id] = live
        if live.state == LEASED:
            self.by_slot[live.slot] = live
        ids = self.by_owner.get(live.spec.owner)
        if ids is None:
            self.by_owner[live.spec.owner] = {live.spec.request_id: None}
        else:
            ids[live.spec.request_id] = None

    def drop(self, live: Live, abort: bool) -> None:
        """Forget a live request (its queue entry / lease must already be gone). Its id waits for the
        policies' cleanup; with `abort`, a tracked request's policy is told Aborted. Its entry's
        `payload` is cleared (read `entry.payload` before dropping it)."""
        rid = live.spec.request_id
        if self.live.get(rid) is live:
            del self.live[rid]
            self.feed.cleanup_ids.add(rid)  # reusable once this cleanup reaches the policies
            ids = self.by_owner.get(live.spec.owner)
            if ids is not None:
                ids.pop(rid, None)
                if not ids:
                    del self.by_owner[live.spec.owner]
        if live.share_key is not None:
            self.shares.remove(live)
        self._retire(live, abort)

    def drop_owner(self, owner: int) -> tuple[list[Live], list[QueueEntry]]:
        """Forget every live request of `owner` (its router is gone) as `drop(live, abort=True)` of each
        would, in the same order, with the maps and waiting counts changed in bulk (a dead flooder's
        whole queue: `WaitingShares.forget_owner`). Returns (its leases, the queue entries of its waiting
        requests): the caller frees those bookings and removes those entries."""
        ids = self.by_owner.pop(owner, None)
        if not ids:
            return [], []
        live_map = self.live
        lives = [live_map.pop(rid) for rid in ids]
        self.feed.cleanup_ids.update(ids)  # reusable once this cleanup reaches the policies
        self.shares.forget_owner(owner)
        leased: list[Live] = []
        waiting: list[QueueEntry] = []
        for live in lives:
            if live.state == LEASED:
                leased.append(live)
            else:
                waiting.append(live.entry)
            self._retire(live, True)
        return leased, waiting

    def _retire(self, live: Live, abort: bool) -> None:
        """The rest of `drop`, once `live` is out of the id and owner maps and uncounted."""
        if live.state == LEASED:
            self.by_slot.pop(live.slot, None)
        live.state = GONE
        if abort and live.tracked:
            self.feed.aborted(live)
        live.wrote = None
        live.entry.payload = None  # breaks the live <-> entry cycle: both are freed by refcount, no GC pass

    def leased(self, live: Live, slot: int, generation: int) -> None:
        """A registered waiting request was admitted: it holds the lease (slot, generation) now and is
        no longer counted among its owner's waiting requests."""
        if live.share_key is not None:
            self.shares.remove(live)
        live.state, live.slot, live.generation = LEASED, slot, generation
        self.by_slot[slot] = live

    def unlease(self, live: Live) -> None:
        """A lease given back (`requeue`): the request waits again, ready, counted among its owner's
        waiting requests; what its admission wrote to the overlap indexes is forgotten (the caller
        withdrew it)."""
        self.by_slot.pop(live.slot, None)
        live.state, live.slot, live.generation, live.wrote = READY, -1, 0, None
        self.shares.add(live)

    def lease(self, request_id: str, slot: int, generation: int) -> Live:
        """The leased request (request_id, slot, generation). Raises KeyError when there is none."""
        live = self.by_slot.get(slot)
        if live is None or live.spec.request_id != request_id or live.generation != generation:
            raise KeyError(f"no lease ({request_id!r}, slot={slot}, generation={generation})")
        return live

    @property
    def waiting(self) -> bool:
        """True while some request waits (ready or deferred). O(1)."""
        return len(self.live) > len(self.by_slot)

    def waiting_lives(self) -> Iterator[Live]:
        """Every waiting (ready or deferred) request."""
        return (live for live in self.live.values() if live.state in (READY, DEFERRED))

    def note_dispatched(self, slots: Iterable[int]) -> bool:
        """The routers stored `dispatched` for these slots (a word fold): each lease's tracked policy is
        told Dispatched, at most once. True when some policy was told."""
        told = False
        by_slot, feed = self.by_slot, self.feed
        for slot in slots:
            live = by_slot.get(slot)
            if live is not None and live.tracked and not live.told_dispatched:
                feed.dispatched(live)
                told = True
        return told

    # ---- classes (a profile reload) ----------------------------------------------------------
    def leased_classes(self) -> set[int]:
        """Class indexes that hold a lease."""
        return {live.entry.class_idx for live in self.by_slot.values()}

    def renumber_classes(self, remap: dict[int, int]) -> None:
        """A profile reload renumbered the classes (old index -> new): the leases follow (a waiting
        request's index is set by the queue that holds it, `PolicyQueue.reconfigured`)."""
        for live in self.by_slot.values():
            live.entry.class_idx = remap.get(live.entry.class_idx, live.entry.class_idx)

    def lease_rows(
        self,
        class_names: list[str],
        now_us: int,
        worker_id: int | None = None,
        policy_class: str | None = None,
        limit: int = 1000,
    ) -> list[LeaseRow]:
        """Up to `limit` live leases for the admin socket, optionally of one worker id / one class
        (`class_names`: the profile's, by class index). O(leases)."""
        out = []
        ledger = self.ledger
        for slot, live in self.by_slot.items():
            info = ledger.slot_info(slot)
            key = ledger.key_of(info.row)
            name = class_names[live.entry.class_idx]
            if (worker_id is not None and key.worker_id != worker_id) or (policy_class not in (None, name)):
                continue
            out.append(
                LeaseRow(
                    request_id=live.spec.request_id,
                    worker_id=key.worker_id,
                    dp_rank=key.dp_rank,
                    slot=slot,
                    generation=info.generation,
                    policy_class=name,
                    isl_tokens=info.isl,
                    cached_tokens=info.cached,
                    output_tokens=info.output_tokens,
                    age_s=max(0, now_us - info.admit_us) / 1e6,
                    state=_SLOT_STATES.get(info.state, "free"),
                )
            )
            if len(out) >= limit:
                break
        return out

    # ---- ownership ---------------------------------------------------------------------------
    def owner_of(self, request_id: str) -> int | None:
        """Owner id of a live request (waiting or leased), or None when it is not live."""
        live = self.live.get(request_id)
        return None if live is None else live.spec.owner

    def owned_count(self, owner: int) -> int:
        """Live requests (waiting or leased) owned by `owner`."""
        return len(self.by_owner.get(owner, ()))

    def may_take_over(self, request_id: str, claimant: int) -> bool:
        """May `claimant` claim `request_id` (Reattach, a re-sent Enqueue)? True when it is not live,
        or is owned by the daemon, the claimant itself, an owner known gone or an earlier connection
        of the claimant's process (module docstring)."""
        owner = self.owner_of(request_id)
        if owner is None or owner in (DAEMON_OWNER, claimant):
            return True
        return not self.owner_alive(owner) or self.same_process(owner, claimant)

    def set_owner(self, live: Live, owner: int) -> None:
        old = live.spec.owner
        rid = live.spec.request_id
        ids = self.by_owner.get(old)
        if ids is not None:
            ids.pop(rid, None)
            if not ids:
                del self.by_owner[old]
        counted = live.share_key is not None
        self.shares.remove(live)
        live.spec.owner = owner
        if counted:
            self.shares.add(live)
        self.by_owner.setdefault(owner, {})[rid] = None

    def adopt_lease(self, request_id: str, slot: int, generation: int, owner: int) -> bool:
        """Give the lease (request_id, slot, generation) to `owner` (a reconnected client).
        False when no such lease is live (it was released: the client must treat it as lost)."""
        live = self.by_slot.get(slot)
        if live is None or live.spec.request_id != request_id or live.generation != generation:
            return False
        self.set_owner(live, owner)
        return True

    def adopt_waiting(self, request_id: str, owner: int) -> Admit | bool:
        """A reconnected client re-sends an Enqueue for `request_id`. If the request is still live
        (queued, or admitted but the answer was lost in the outage) it now belongs to `owner`: returns
        the `Admit` to send again for a lease, True for a waiting request, False when it is not live."""
        live = self.live.get(request_id)
        if live is None:
            return False
        self.set_owner(live, owner)
        if live.state != LEASED:
            return True
        ledger = self.ledger
        info = ledger.slot_info(live.slot)
        return Admit(
            request_id,
            owner,
            ledger.key_of(info.row),
            live.slot,
            live.generation,
            info.cached // ledger.block_size,
            info.cached,
            max(0, info.admit_us - info.enqueue_us),
            live.spec.policy_class,
        )

    # ---- orphans (restart) -------------------------------------------------------------------
    def adopt_slot_table(
        self, class_names: list[str], default_class: int, seq: Iterator[int], now_us: int, grace_us: int
    ) -> OrphanCounts:
        """Adopt every booking of the ledger's slot table as an orphan lease (owner `DAEMON_OWNER`).

        Args:
            class_names: the profile's class names (a booking's class index outside them → default).
            default_class: index of the default class; seq: the scheduler's enqueue_seq counter.
            now_us / grace_us: orphans are released at now_us + grace_us unless claimed.
        """
        count = 0
        for slot in self.ledger.live_slots():
            info = self.ledger.slot_info(slot)
            c = info.class_idx if 0 <= info.class_idx < len(class_names) else default_class
            spec = RequestSpec(
                request_id=info.request_id, isl_tokens=max(1, info.isl), policy_class=class_names[c], owner=DAEMON_OWNER
            )
            entry = QueueEntry(
                info.request_id,
                next(seq),
                info.enqueue_us,
                0,
                0,
                max(1, info.isl - info.cached),
                max(1, info.isl),
                None,
                c,
            )
            live = Live(spec, entry, state=LEASED, slot=slot, generation=info.generation)
            entry.payload = live
            self.register(live)
            count += 1
        self.orphans = OrphanCounts(count, 0, now_us + grace_us if count else None)
        return self.orphans

    def credit_stall(self, stall_us: int) -> None:
        """The daemon read nothing for `stall_us` µs: the orphans' grace deadline moves by as much
        (the Reattach frames sent meanwhile sit unread; docs/DESIGN.md §5.4)."""
        o = self.orphans
        if o is not None and o.deadline_us is not None:
            self.orphans = OrphanCounts(o.adopted, o.released, o.deadline_us + stall_us)

    def expired_orphans(self, now_us: int) -> list[Live]:
        """The orphan leases still unclaimed once the grace deadline passed (once; [] otherwise).
        The caller releases them; `take_orphan_report` then reports the counts once."""
        o = self.orphans
        if o is None or o.deadline_us is None or now_us < o.deadline_us:
            return []
        gone = [self.live[rid] for rid in list(self.by_owner.get(DAEMON_OWNER, ()))]
        self.orphans = self._orphan_report = OrphanCounts(o.adopted, len(gone), None)
        return gone

    def take_orphan_report(self) -> OrphanCounts | None:
        """The counts of the grace deadline that passed since the last call (for the log), or None."""
        report, self._orphan_report = self._orphan_report, None
        return report
