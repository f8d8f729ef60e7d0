"""PolicyFeed: admission-policy events buffered until `drain_cleanup`, and the request ids whose
cleanup has not reached the policies yet (docs/DESIGN.md §4.9: an id is reusable only once its
policy has been told).

Releases arrive one frame at a time; the policies are told once per wake, in arrival order, so a
burst of releases costs one `notify` pass and one dispatch pass (`tell_policies`).
"""

from __future__ import annotations

from .admission import Aborted, Completed, Dispatched, Event, MakeReady
from .leases import DEFERRED, READY


class PolicyFeed:
    """Buffered (class index, event) pairs and the ids being cleaned up.

    Attributes:
        events: list of (class index, `Dispatched` / `Completed` / `Aborted`), oldest first.
        cleanup_ids: ids released or rejected since the policies were last told (an Enqueue of one
            of them is `duplicate_request` until then).
    """

    __slots__ = ("events", "cleanup_ids")

    def __init__(self) -> None:
        self.events: list[tuple[int, Event]] = []
        self.cleanup_ids: set[str] = set()

    def dispatched(self, live) -> None:  # noqa: ANN001 - a leases.Live
        """The backend accepted a tracked request: `Dispatched`, at most once per lease."""
        if live.tracked and not live.told_dispatched:
            live.told_dispatched = True
            self.events.append((live.entry.class_idx, Dispatched(live.spec.request_id)))

    def completed(self, live, context_tokens: int) -> None:  # noqa: ANN001
        if live.tracked:
            self.events.append((live.entry.class_idx, Completed(live.spec.request_id, context_tokens)))

    def aborted(self, live) -> None:  # noqa: ANN001
        if live.tracked:
            self.events.append((live.entry.class_idx, Aborted(live.spec.request_id)))

    def rejected(self, live) -> None:  # noqa: ANN001
        """A request rejected after its policy decided: `Aborted`, and its id waits for the cleanup."""
        if live.tracked:
            self.events.append((live.entry.class_idx, Aborted(live.spec.request_id)))
            self.cleanup_ids.add(live.spec.request_id)

    def take(self) -> list[tuple[int, Event]]:
        """The buffered events, oldest first; the buffer is empty afterwards."""
        events, self.events = self.events, []
        return events

    def remap(self, remap: dict[int, int]) -> None:
        """Class indexes renumbered by a profile reload; events of removed classes are dropped."""
        self.events = [(remap[c], e) for c, e in self.events if c in remap]


def tell_policies(sched, now_us: int) -> bool:  # noqa: ANN001 - a Scheduler
    """Tell each class's admission policy its buffered events (oldest first) and apply the
    `MakeReady` answers; the cleaned-up ids become reusable. Returns True when a request moved
    (a dispatch pass is due)."""
    feed, moved = sched.feed, False
    while feed.events:
        events = feed.take()
        fleet = sched.admitter.fleet()
        classes = sched.pq.classes
        for c, event in events:
            policy = classes[c].admission if c < len(classes) else None
            if policy is not None:
                moved |= apply_make_ready(sched, c, policy.notify(event, fleet, now_us), now_us)
    feed.cleanup_ids.clear()
    return moved


def apply_make_ready(sched, c: int, answers: list[MakeReady], now_us: int) -> bool:  # noqa: ANN001
    """Apply a class policy's `MakeReady` answers: a deferred request becomes ready (in its own place
    or an exact, valid placement); a ready one moves to a worker lane at most once; unknown or
    duplicate ids are ignored. Returns True when a request moved."""
    moved = False
    cq = sched.pq.classes[c]
    for mr in answers:
        live = sched.lease_table.live.get(mr.request_id)
        if live is None or live.entry.class_idx != c or live.state not in (READY, DEFERRED):
            continue
        placement = mr.placement
        if placement is not None and not sched.intake.placement_ok(live.spec, placement, cq.name):
            placement = None  # invalid: a deferred request is released to its own place
        if placement is not None:
            if live.state == READY and live.entry.placement is not None:
                continue  # already in a worker lane: ignored
            live.entry.cost = sched.admitter.snapshot_cost(live.spec, placement, now_us)  # before re-keying
        elif live.state == READY:
            continue  # already ready: duplicate answer, ignored
        if cq.make_ready(mr.request_id, placement) is not None:
            live.state = READY
            moved = True
    return moved
