"""The actor's periodic tick (every `progress_fold_ms`): the loop's lag and stalls, the scheduler's
timed work, restart-orphan and placement reports, dead-router reaping, once-a-second gauges and the
registered callbacks (docs/DESIGN.md §8, docs/OPERATIONS.md for the metrics and log lines).

Plain functions over the `actor.Actor`, which owns the timer and the state they read and write
(`_last_tick_s`, `_next_liveness_us`, `_next_gauges_us`, `on_tick`, `on_second`). Nothing here runs
on the per-frame path; the policy stays in the Scheduler.
"""

from __future__ import annotations

import logging

log = logging.getLogger("kvsched.daemon.actor")  # the actor's log lines, under the actor's logger name

LIVENESS_EVERY_US = 100_000  # dead-router check and the metric tally's flush (µs)
GAUGES_EVERY_US = 1_000_000  # gauges + `on_second` callbacks (µs)


def observe_lag(actor, t: int) -> None:
    """Record the loop's lag behind the tick's schedule at `t` (µs, one clock reading shared with the
    reaper: a stall after it shows in the next lag). A lag long enough to read nothing is credited
    to the routers' liveness and to a restart's re-attach grace (not the routers' silence)."""
    cfg = actor.cfg
    now_s = t / 1_000_000
    lag_s = max(0.0, now_s - actor._last_tick_s - cfg.progress_fold_ms / 1000)  # noqa: SLF001
    actor.tally.loop_lag_s.append(lag_s)  # written with the tally's other samples
    actor._last_tick_s = now_s  # noqa: SLF001
    if actor.conns.credit_stall(int(lag_s * 1_000_000), t):  # read nothing that long: nobody's silence
        actor.scheduler.credit_stall(int(lag_s * 1_000_000))  # nor part of a restart's re-attach grace
        actor.warn.warning("loop-stall", "actor loop stalled seconds=%.2f; not counted as the routers' silence", lag_s)


def periodic_work(actor, t: int) -> None:
    """One tick's work at `t` (µs): fold the routers' words, `Scheduler.tick`, the orphan report
    and placement notices, dead routers every `LIVENESS_EVERY_US`, gauges and `on_second` every
    `GAUGES_EVERY_US`, one `drain_cleanup`, deliver every outcome, `on_tick`. The metric tally is
    written every `LIVENESS_EVERY_US` (and by the actor's wakes whenever `FLUSH_SAMPLES` samples
    are pending): writing it has a fixed cost however little it holds, too much for every tick."""
    sched = actor.scheduler
    actor._fold()  # noqa: SLF001 - counted here; the tick's own fold then finds nothing new
    outcomes = sched.tick(t)
    orphans = sched.take_orphan_report()
    if orphans is not None and orphans.released:
        log.warning(
            "released leases nobody re-attached after the restart count=%d claimed=%d",
            orphans.released,
            orphans.claimed,
        )
    for note in sched.take_notices():
        actor.warn.warning("invalid-placement", "%s (ignored so far: %d)", note, sched.invalid_placements)
    flush = t >= actor._next_liveness_us  # noqa: SLF001
    if flush:
        actor._next_liveness_us = t + LIVENESS_EVERY_US  # noqa: SLF001
        reap_dead(actor, t)
    if t >= actor._next_gauges_us:  # noqa: SLF001
        actor._next_gauges_us = t + GAUGES_EVERY_US  # noqa: SLF001
        actor.metrics.refresh(sched, t)  # queue, lease and worker gauges from the scheduler's introspection
        for cb in actor.on_second:
            cb()
    outcomes += sched.drain_cleanup(t)
    actor._deliver(outcomes, t)  # noqa: SLF001
    if flush:
        actor.tally.flush()
    else:
        actor.tally.flush_if_full()
    for cb in actor.on_tick:
        cb()


def reap_dead(actor, t: int) -> None:
    """Close every connection silent past the liveness timeout (or whose process died) at `t` (µs)
    and abort what its router owned (`Scheduler.cancel_owner`); refresh the connections gauge."""
    for conn in actor.conns.find_dead(t):
        owned = actor.scheduler.owned_count(conn.owner)
        # A router that closed cleanly owns nothing (there is no goodbye frame): not a warning.
        (log.warning if owned else log.info)(
            "router gone owner=%d client=%s pid=%d silent_ms=%d aborted_requests=%d",
            conn.owner,
            conn.client_name,
            conn.hello_pid,
            (t - conn.last_seen_us) // 1000,
            owned,
        )
        actor.metrics.dead_connections.inc()
        actor.conns.close_dead(conn)
        actor.scheduler.cancel_owner(conn.owner, t)
    actor.metrics.connections.set(len(actor.conns))
