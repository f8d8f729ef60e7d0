"""PolicyFeed: admission-policy events buffered until `drain_cleanup`, and the request ids whose
cleanup has not reached the policies yet (docs/DESIGN.md §4.9: an id is reusable only once its
policy has been told).

Releases arrive one frame at a time; the policies are told once per wake, in arrival order, so a
burst of releases costs one `notify` pass and one dispatch pass (`Intake.tell_policies`).
"""

from __future__ import annotations

from .admission import Aborted, Completed, Dispatched, Event
from .live import Live


class PolicyFeed:
    """Buffered (class index, event) pairs and the ids being cleaned up.

    Attributes:
        events: list of (class index, `Dispatched` / `Completed` / `Aborted`), oldest first.
        cleanup_ids: ids released or rejected since the policies were last told (an Enqueue of one
            of them is `duplicate_request` until then).
    """

    __slots__ = ("cleanup_ids", "events")

    def __init__(self) -> None:
        self.events: list[tuple[int, Event]] = []
        self.cleanup_ids: set[str] = set()

    def dispatched(self, live: Live) -> None:
        """The backend accepted a tracked request: `Dispatched`, at most once per lease."""
        if live.tracked and not live.told_dispatched:
            live.told_dispatched = True
            self.events.append((live.entry.class_idx, Dispatched(live.spec.request_id)))

    def completed(self, live: Live, context_tokens: int) -> None:
        """A tracked request finished normally with `context_tokens` (prompt + output): `Completed`."""
        if live.tracked:
            self.events.append((live.entry.class_idx, Completed(live.spec.request_id, context_tokens)))

    def aborted(self, live: Live) -> None:
        """A tracked request ended otherwise (released aborted, cancelled, timed out, its worker or
        router gone): `Aborted`."""
        if live.tracked:
            self.events.append((live.entry.class_idx, Aborted(live.spec.request_id)))

    def rejected(self, live: Live) -> None:
        """A request rejected after its policy decided: `Aborted`, and its id waits for the cleanup."""
        if live.tracked:
            self.events.append((live.entry.class_idx, Aborted(live.spec.request_id)))
            self.cleanup_ids.add(live.spec.request_id)

    def take(self) -> list[tuple[int, Event]]:
        """The buffered events, oldest first; the buffer is empty afterwards."""
        events, self.events = self.events, []
        return events

    def cleaned(self) -> None:
        """The policies were told (or had nothing to hear): every id being cleaned up is reusable."""
        self.cleanup_ids.clear()

    def remap(self, remap: dict[int, int]) -> None:
        """Class indexes renumbered by a profile reload; events of removed classes are dropped."""
        self.events = [(remap[c], e) for c, e in self.events if c in remap]
