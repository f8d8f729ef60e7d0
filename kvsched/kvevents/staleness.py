"""When a worker row's KV-event stream is stale (pure: the caller passes its clock in).

A stale row's event-fed entries are not trusted: the scheduler credits that worker from the
approximate index instead (docs/KV_EVENTS.md, "Staleness"). Staleness needs evidence that events
were or are being lost, never silence: vLLM publishes nothing while an engine is idle, and an idle
engine's cache is still what its last events said. A row is stale once one of these has lasted
`stale_after_s`:

* **disconnected**: the SUB socket reported a disconnect (a closed connection, or a ZMTP heartbeat
  timeout: a dead process, a stopped one, a partitioned host) and no handshake has completed since;
  a row on which no handshake has completed since it was subscribed counts as disconnected from then;
* **gap unfilled**: seqs the live stream skipped that replay has not restored, seqs replay could no
  longer supply included (`KvEventApplier.unfilled`).

It is fresh again as soon as neither holds: a handshake completes, replay fills the gap, or the row's
index is rebuilt from a known state (the engine cleared its cache, or restarted).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StreamHealth:
    """Evidence of loss on one row's event stream, and the staleness rule over it.

    Times are seconds of one monotonic clock, the caller's. Create with `subscribed`.
    Invariant: `down_since_s` is None exactly while the latest connection event is a handshake.
    """

    stale_after_s: float  # how long a disconnect or an unfilled gap is tolerated (s), > 0
    down_since_s: float | None  # disconnected since (s); None = connected
    gap_since_s: float | None = None  # some seq unfilled since (s); None = nothing unfilled

    @classmethod
    def subscribed(cls, stale_after_s: float, now_s: float) -> StreamHealth:
        """A row whose SUB socket was just connected: no handshake yet, nothing unfilled.

        Raises:
            ValueError: stale_after_s is not > 0.
        """
        if not stale_after_s > 0:
            raise ValueError(f"stale_after_s must be > 0, got {stale_after_s!r}")
        return cls(stale_after_s, now_s)

    def connected(self) -> None:
        """A handshake with the publisher completed: the disconnected state ends."""
        self.down_since_s = None

    def disconnected(self, now_s: float) -> None:
        """The connection to the publisher was lost at `now_s` (s); a second report while still
        disconnected keeps the first time."""
        if self.down_since_s is None:
            self.down_since_s = now_s

    def gap(self, unfilled: bool, now_s: float) -> None:
        """Whether the row has unfilled seqs as of `now_s` (s); the time a gap opened is kept
        until it closes."""
        if not unfilled:
            self.gap_since_s = None
        elif self.gap_since_s is None:
            self.gap_since_s = now_s

    def stale(self, now_s: float) -> bool:
        """True once the row has been disconnected, or had a gap unfilled, for `stale_after_s`."""
        return any(
            since is not None and now_s - since >= self.stale_after_s for since in (self.down_since_s, self.gap_since_s)
        )
