"""The actor's periodic tick (every `progress_fold_ms`): the loop's lag and stalls, the scheduler's
timed work, restart-orphan and placement reports, dead-router reaping, once-a-second gauges and the
registered callbacks (docs/DESIGN.md §8, docs/OPERATIONS.md for the metrics and log lines).

The `Ticker` owns its timer and its schedule (the last tick's time, the next liveness and gauge
times) and the `on_tick` / `on_second` callback lists; it drives the actor through its public
methods (`fold_words`, `deliver`, `after_tick`). Nothing here runs on the per-frame path; the policy
stays in the Scheduler.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from .connections import ConnectionTable
from .metrics import Metrics
from .ratelimit import RateLimitedLog
from .tally import WakeTally, now_us

if TYPE_CHECKING:
    from ..config import DaemonConfig
    from ..core.scheduler import Scheduler

log = logging.getLogger("kvsched.daemon.actor")  # the actor's log lines, under the actor's logger name

LIVENESS_EVERY_US = 100_000  # dead-router check and the metric tally's flush (µs)
GAUGES_EVERY_US = 1_000_000  # gauges + `on_second` callbacks (µs)


class TickedActor(Protocol):
    """What a `Ticker` uses of the actor that owns it (`daemon.actor.Actor` is the one implementation;
    stated here so that this module does not import the actor, which imports it)."""

    loop: asyncio.AbstractEventLoop
    cfg: DaemonConfig
    scheduler: Scheduler
    conns: ConnectionTable
    metrics: Metrics
    tally: WakeTally
    warn: RateLimitedLog
    stopped: bool

    def fold_words(self) -> bool: ...
    def deliver(self, outcomes: list, t: int) -> None: ...
    def after_tick(self) -> None: ...


class Ticker:
    """The actor's periodic timer and what it runs. `start()` once the actor reads; `stop()` at the end.

    Args:
        actor: the `Actor` it drives (scheduler, connections, metrics, tally, warn, `fold_words`,
            `deliver`, `after_tick`, `stopped`).
    Attributes:
        on_tick: callbacks run after every tick (e.g. the watchdog ping).
        on_second: callbacks run once a second, with the gauges (e.g. kv-event counters).
    """

    def __init__(self, actor: TickedActor) -> None:
        self.actor = actor
        self.period_s = actor.cfg.progress_fold_ms / 1000
        self.on_tick: list[Callable[[], None]] = []
        self.on_second: list[Callable[[], None]] = []
        self._timer: asyncio.TimerHandle | None = None
        self._last_tick_s = 0.0
        self._next_liveness_us = 0
        self._next_gauges_us = 0

    def start(self) -> None:
        """Arm the first tick, one period from now."""
        self._last_tick_s = now_us() / 1_000_000
        self._schedule()

    def stop(self) -> None:
        """Cancel the armed tick."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        self._timer = self.actor.loop.call_later(self.period_s, self.fire)

    def fire(self) -> None:
        """The timer callback: `observe_lag` and `periodic_work` at one clock reading, then the next
        tick and the actor's `after_tick`."""
        if self.actor.stopped:
            return
        t = now_us()  # one clock reading for the lag and the reaper: a stall after it shows in the next lag
        self.observe_lag(t)
        try:
            self.periodic_work(t)
        finally:
            self._schedule()
            self.actor.after_tick()

    def observe_lag(self, t: int) -> None:
        """Record the loop's lag behind the tick's schedule at `t` (µs). A lag long enough to read
        nothing is credited to the routers' liveness and to a restart's re-attach grace (not the
        routers' silence)."""
        a = self.actor
        now_s = t / 1_000_000
        lag_s = max(0.0, now_s - self._last_tick_s - self.period_s)
        a.tally.loop_lag_s.append(lag_s)  # written with the tally's other samples
        self._last_tick_s = now_s
        if a.conns.credit_stall(int(lag_s * 1_000_000), t):  # read nothing that long: nobody's silence
            a.scheduler.credit_stall(int(lag_s * 1_000_000))  # nor part of a restart's re-attach grace
            a.warn.warning("loop-stall", "actor loop stalled seconds=%.2f; not counted as the routers' silence", lag_s)

    def periodic_work(self, t: int) -> None:
        """One tick's work at `t` (µs): fold the routers' words, `Scheduler.tick`, the orphan report
        and placement notices, dead routers every `LIVENESS_EVERY_US`, gauges and `on_second` every
        `GAUGES_EVERY_US`, one `drain_cleanup`, deliver every outcome, `on_tick`. The metric tally is
        written every `LIVENESS_EVERY_US` (and by the actor's wakes whenever `FLUSH_SAMPLES` samples
        are pending): writing it costs ~25 µs however little it holds, too much for every 10 ms tick."""
        a = self.actor
        sched = a.scheduler
        a.fold_words()  # counted here; the tick's own fold then finds nothing new
        outcomes = sched.tick(t)
        orphans = sched.take_orphan_report()
        if orphans is not None and orphans.released:
            log.warning(
                "released leases nobody re-attached after the restart count=%d claimed=%d",
                orphans.released,
                orphans.claimed,
            )
        for note in sched.take_notices():
            a.warn.warning("invalid-placement", "%s (ignored so far: %d)", note, sched.invalid_placements)
        flush = t >= self._next_liveness_us
        if flush:
            self._next_liveness_us = t + LIVENESS_EVERY_US
            self.reap_dead(t)
        if t >= self._next_gauges_us:
            self._next_gauges_us = t + GAUGES_EVERY_US
            a.metrics.refresh(sched, t)  # queue, lease and worker gauges from the scheduler's introspection
            for cb in self.on_second:
                cb()
        outcomes += sched.drain_cleanup(t)
        a.deliver(outcomes, t)
        if flush:
            a.tally.flush()
        else:
            a.tally.flush_if_full()
        for cb in self.on_tick:
            cb()

    def reap_dead(self, t: int) -> None:
        """Close every connection silent past the liveness timeout (or whose process died) at `t` (µs)
        and abort what its router owned (`Scheduler.cancel_owner`); refresh the connections gauge."""
        a = self.actor
        for conn in a.conns.find_dead(t):
            owned = a.scheduler.owned_count(conn.owner)
            # A router that closed cleanly owns nothing (there is no goodbye frame): not a warning.
            (log.warning if owned else log.info)(
                "router gone owner=%d client=%s pid=%d silent_ms=%d aborted_requests=%d",
                conn.owner,
                conn.client_name,
                conn.hello_pid,
                (t - conn.last_seen_us) // 1000,
                owned,
            )
            a.metrics.dead_connections.inc()
            a.conns.close_dead(conn)
            a.scheduler.cancel_owner(conn.owner, t)
        a.metrics.connections.set(len(a.conns))
