"""Build the daemon's state from the config: shared-memory segments, ledger, overlap indexes, selector
and the Scheduler, plus the workers declared in `[[workers]]`; and the KV-event subscriber that feeds
the event indexes (`build_kv_subscriber`) with its metrics hook (`kv_metrics_tick`). No I/O beyond
creating segments (the subscriber connects in its `start()`)."""

from __future__ import annotations

import logging
import os
import time

import msgspec
import numpy as np

from ..config import Config
from ..core.create import add_config_workers, create_scheduler
from ..core.ledger import Ledger
from ..core.overlap_view import overlap_capacity
from ..core.types import Admit, RequestSpec, WorkerKey
from ..errors import ShmLayoutError
from ..kvevents.hash_check import HashCheck
from ..shm.kv_index import kv_index_nbytes, open_kv_index, reconcile_rows
from ..shm.layout import LAYOUT_VERSION, LedgerArrays, default_ref_capacity, progress_nbytes
from ..shm.overlap import OverlapIndex
from ..shm.segments import (
    attach_segments,
    create_segments,
    kv_index_name,
    ledger_name,
    ledger_uninitialised,
    progress_name,
    unlink_segments,
)
from ..shm.space import SHM_DIR, check_free_space
from ..shm.upgrade import inspect_ledger
from .kv_events import KvEventSubscriber
from .ratelimit import RateLimitedLog

log = logging.getLogger(__name__)

# KV-event messages read per SUB wake: each costs a decode and an index update (`bench/bench_kv_events.py`),
# so one wake holds the actor's loop briefly and scheduling frames interleave with a heavy event stream.
KV_EVENT_FRAME_BUDGET = 64
# Longest the daemon holds READY for the catch-up replays of restored KV-event rows (s): a replay of
# a whole 10,000-batch ring buffer takes well under a second here; an engine that does not answer
# must not delay the start (its row keeps its restored entries, and turns stale if it stays unconnected).
KV_CATCH_UP_WAIT_S = 1.0


def segment_capacities(cfg: Config) -> dict[str, int]:
    """The capacities written in (and validated against) the ledger header."""
    d = cfg.daemon
    return {
        "max_workers": d.max_workers,
        "max_slots": d.max_slots,
        "max_blocks_per_request": d.max_blocks_per_request,
        "ref_capacity": default_ref_capacity(d.max_workers, d.max_slots, d.max_blocks_per_request),
        "block_size": d.block_size,
    }


def segment_sizes(cfg: Config) -> dict[str, int]:
    """Bytes of each segment of this instance for the configured capacities (name -> bytes)."""
    caps = segment_capacities(cfg)
    inst = cfg.daemon.instance
    return {
        ledger_name(inst): LedgerArrays.nbytes(
            caps["max_workers"], caps["max_slots"], caps["max_blocks_per_request"], caps["ref_capacity"]
        ),
        progress_name(inst): progress_nbytes(caps["max_slots"]),
        kv_index_name(inst): kv_index_nbytes(cfg.daemon.max_workers, overlap_capacity(cfg.daemon.max_workers)),
    }


def segment_bytes(cfg: Config) -> int:
    """Bytes of /dev/shm all of this instance's segments take: the lower bound for a container's
    shm size or a memory-backed /dev/shm volume (docs/DEPLOY.md "Shared memory")."""
    return sum(segment_sizes(cfg).values())


def open_segments(cfg: Config):
    """Create this instance's segments, or re-attach them after a restart; every page reserved.

    Before creating anything the free space of /dev/shm is checked against the segments still to
    create (`kvsched.shm.space`); the KV-index segment is kept only when the ledger was re-attached.

    Returns:
        (Segments, restarted): restarted is True when existing segments were re-attached (the
        ledger is then rebuilt from its slot table under a new epoch). `Segments.kv_index` holds the
        KV-index segment; `Segments.kv_index_restored` says whether its contents were kept.
    Existing segments of an older layout version (see `kvsched.shm.upgrade`) are replaced when they
    hold no live lease; with live leases the start is refused. A ledger whose header was never
    written (an earlier start killed while creating the segments, `ledger_uninitialised`) is
    replaced with a WARNING, with whatever progress / KV-index segment it left.
    Raises:
        ShmLayoutError: existing segments with another layout or capacities (use `--purge`), or
            older-layout segments that still hold live leases.
        ShmSpaceError: /dev/shm has no room for the segments (the message names both sizes).
    """
    caps = segment_capacities(cfg)
    epoch = time.time_ns() // 1000
    _replace_uninitialised(cfg.daemon.instance)  # a start killed while creating them: nothing to keep
    _replace_old_layout(cfg.daemon.instance)  # before the room check: replaced segments need room again
    check_free_space({name: n for name, n in segment_sizes(cfg).items() if not os.path.exists(f"{SHM_DIR}/{name}")})
    try:
        segs = create_segments(cfg.daemon.instance, epoch=epoch, **caps)
        restarted = False
    except FileExistsError:
        try:
            segs = attach_segments(cfg.daemon.instance, expect=caps, writable_ledger=True)
        except ShmLayoutError as exc:  # another capacity, a bad header: say what to do about it
            raise ShmLayoutError(
                f"{exc}\n  the shared-memory segments left by an earlier run of instance {cfg.daemon.instance} do "
                "not fit this config: start it with the values they were made with, or run `kvsched-daemon "
                f"--instance {cfg.daemon.instance} --purge` first (that drops the leases they hold)"
            ) from None
        segs.ledger.epoch = epoch
        log.info("re-attached existing segments instance=%s epoch=%d", cfg.daemon.instance, epoch)
        restarted = True
    try:
        segs.kv_index, segs.kv_index_restored = open_kv_index(
            cfg.daemon.instance, cfg.daemon.max_workers, overlap_capacity(cfg.daemon.max_workers), restore=restarted
        )
    except BaseException:
        segs.close()
        if not restarted:
            segs.unlink()
        raise
    return segs, restarted


def _replace_uninitialised(instance: str) -> None:
    """Unlink `instance`'s segments when its ledger's header was never written (magic 0 or shorter
    than the magic: a start killed between creating the ledger and stamping its header). Such a
    ledger holds no lease, so no `--purge` is needed; a valid header is left to `attach_segments`."""
    if ledger_uninitialised(instance):
        log.warning(
            "replacing segment %s: its header was never written (an earlier start was killed while "
            "creating the segments), so it holds no lease instance=%s",
            ledger_name(instance),
            instance,
        )
        unlink_segments(instance)


def _replace_old_layout(instance: str) -> None:
    """Unlink `instance`'s segments when they have an older layout version and no live lease.

    Raises:
        ShmLayoutError: older-layout segments with live leases (message names `--purge`).
    """
    found = inspect_ledger(instance)
    if found is None or found.version in (0, LAYOUT_VERSION) or found.version > LAYOUT_VERSION:
        return  # none, not ours, current, or newer: attach_segments reports what does not match
    if found.live_leases == 0:
        log.warning(
            "replacing segments of layout version %d (no live lease) instance=%s version=%d",
            found.version,
            instance,
            LAYOUT_VERSION,
        )
        unlink_segments(instance)
        return
    leases = "an unreadable slot table" if found.live_leases < 0 else f"{found.live_leases} live leases"
    raise ShmLayoutError(
        f"shared-memory segments of instance {instance!r} have layout version {found.version} with {leases}; "
        f"this daemon uses layout version {LAYOUT_VERSION}. Stop the routers that hold them, then run "
        f"`kvsched-daemon --purge --instance {instance}` and start again"
    )


def build_scheduler(cfg: Config, segments, restarted: bool, conns=None):
    """Wire the segments' ledger and overlap indexes into a Scheduler (`create_scheduler`), re-adopt
    the slot table's leases after a restart, and register the configured workers.

    Three indexes of `overlap_capacity(max_workers)` entries: the approximate one (routing
    decisions, private) and the event-fed device and offload ones (in the KV-index segment, so they
    survive a restart), always built so that a worker added at runtime with an event endpoint can
    use them. All are pre-faulted here (see `OverlapIndex.prefault`): the daemon commits their memory
    at start instead of stalling requests. After the workers are registered, the KV-index rows are
    checked against the ledger's worker table (`reconcile_rows`: a row whose worker changed is cleared).
    `conns` (the actor's `ConnectionTable`) supplies `owner_alive` and `same_process`.
    """
    ledger = Ledger(segments.ledger, segments.progress, cfg.overload, state=segments.state)
    w, cap = cfg.daemon.max_workers, overlap_capacity(cfg.daemon.max_workers)
    overlap, device, offload = OverlapIndex(w, cap), segments.kv_index.device, segments.kv_index.offload
    for index in (overlap, device, offload):
        index.prefault()
    log.info("overlap indexes ready entries=%d bytes=%d", cap, 3 * overlap.nbytes)
    scheduler = create_scheduler(
        cfg,
        ledger=ledger,
        overlap=overlap,
        event_device=device,
        event_offload=offload,
        owner_alive=None if conns is None else conns.owner_alive,
        same_process=None if conns is None else conns.same_process,
        add_workers=False,
    )
    scheduler.speculative.prefault()
    if restarted:
        orphans = scheduler.restore_after_restart(time.monotonic_ns() // 1000, cfg.daemon.liveness_timeout_ms * 1000)
        log.info(
            "re-adopted leases from the slot table count=%d grace_ms=%d",
            orphans.adopted,
            cfg.daemon.liveness_timeout_ms,
        )
    add_config_workers(scheduler, cfg)
    a = segments.ledger
    cleared = reconcile_rows(segments.kv_index, a.w_present, a.w_worker_id, a.w_dp_rank, a.w_generation)
    if cleared:
        log.info("kv index rows cleared (worker changed while stopped) rows=%s", cleared)
    return scheduler


def build_kv_subscriber(scheduler, loop, ctx, sources: list, kv_index=None, restored_index: bool = False):
    """The `KvEventSubscriber` feeding the scheduler's event indexes from `sources`
    (`WorkerRegistry.kv_sources`: the configured ranks' and the restored runtime ones').

    Staleness goes to the ledger (`Ledger.set_stale`, shown by `kvsched workers`, read by the
    overlap combination). Built even without sources, so AddWorker can add some at runtime.
    `kv_index` (the KV-index segment) persists each row's applied seq; when `restored_index`, its rows
    with a seq start from it (catch-up replay at `start()`).
    """
    restored = {}
    if kv_index is not None and restored_index:
        restored = {s.row: int(kv_index.last_seq[s.row]) for s in sources if int(kv_index.last_seq[s.row]) >= 0}
    return KvEventSubscriber(
        loop,
        ctx,
        sources,
        scheduler.event_device,
        scheduler.event_offload,
        mark_stale=scheduler.ledger.set_stale,
        frame_budget=KV_EVENT_FRAME_BUDGET,
        store=kv_index,
        restored=restored,
    )


def install_hash_check(cfg: Config, subscriber, scheduler, metrics):
    """Check the engines' block hashes on first-of-chain BlockStored events (`kvevents/hash_check.py`):
    a rate-limited warning per worker, `kvsched_kv_hash_mismatches`, and the `hash_mismatch` flag of
    `kvsched workers`. Returns the `HashCheck`, or None when `daemon.kv_hash_check` is off."""
    if not cfg.daemon.kv_hash_check:
        return None
    check = HashCheck(cfg.daemon.kv_hash_seed, cfg.daemon.block_size)
    warn = RateLimitedLog(log, 60.0)

    def on_batch(row: int, batch, now_us: int) -> None:
        before = check.mismatches
        m = check.observe(row, batch, now_us)
        if check.mismatches > before:
            metrics.kv_hash_mismatches.inc(check.mismatches - before)
        if m is None:
            return
        try:
            key = scheduler.ledger.key_of(row)
        except (KeyError, IndexError, ValueError):
            return
        warn.warning(
            f"hash-{row}",
            "KV-event block hashes of worker=%d:%d differ from what routers send "
            "(block_hashes mode=vllm, kv_hash_seed=%r, block_size=%d): event=%#x expected=%#x event_block_size=%d;"
            " requests will get no cached overlap from this engine's events. Check the engine's "
            "PYTHONHASHSEED (it must equal [daemon] kv_hash_seed, the pool's one seed), "
            "--prefix-caching-hash-algo sha256_cbor, --block-size and the vLLM version (docs/VLLM.md)",
            key.worker_id,
            key.dp_rank,
            cfg.daemon.kv_hash_seed,
            cfg.daemon.block_size,
            m.event_hash,
            m.expected_hash,
            m.block_size,
        )

    subscriber.applier.on_batch = on_batch
    return check


# The subscriber's counters exported as labels: what could not be read (`kvsched_kv_events_skipped{reason}`)
# and stream incidents (`kvsched_kv_event_streams{kind}`)
KV_SKIPPED = ("malformed_frames", "malformed_batches", "malformed_events", "unknown_types", "unknown_fields")
KV_STREAM = ("gaps", "restarts", "replay_lost")
KV_SKIP_WARN_EVERY_S = 60.0  # one WARNING line at most this often while events cannot be read


def kv_metrics_tick(subscriber, metrics):
    """An `Actor.on_second` callback: add the subscriber's deltas to the counters (`applied`,
    `replayed`, `kvsched_kv_events_skipped{reason}`, `kvsched_kv_event_streams{kind}`), set the
    stale-workers gauge, and log one WARNING (at most every `KV_SKIP_WARN_EVERY_S`) while events
    cannot be read: an engine whose format kvsched cannot read otherwise just gives its worker no
    overlap (tests/daemon/test_kv_event_counters.py)."""
    last: dict[str, int] = {}
    warned_at = [float("-inf")]

    def delta(c: dict[str, int], name: str) -> int:
        d = c.get(name, 0) - last.get(name, 0)
        last[name] = c.get(name, 0)
        return d

    def tick() -> None:
        c = subscriber.counters()
        for name, counter in (("applied", metrics.kv_events_applied), ("replayed", metrics.kv_events_replayed)):
            d = delta(c, name)
            if d > 0:
                counter.inc(d)
        skipped = {name: d for name in KV_SKIPPED if (d := delta(c, name)) > 0}
        for name, d in skipped.items():
            metrics.kv_events_skipped.labels(reason=name).inc(d)
        for name in KV_STREAM:
            d = delta(c, name)
            if d > 0:
                metrics.kv_event_streams.labels(kind=name).inc(d)
        metrics.stale_workers.set(c["stale_workers"])
        now = time.monotonic()
        if skipped and now - warned_at[0] >= KV_SKIP_WARN_EVERY_S:
            warned_at[0] = now
            log.warning(
                "kv events could not be read (%s; kvsched_kv_events_skipped_total): check the engines' "
                "publisher format against docs/KV_EVENTS.md",
                ", ".join(f"{k}={v}" for k, v in skipped.items()),
            )

    return tick


def warm_decision_path(cfg: Config) -> None:
    """Run two requests (approximate and event-fed overlap) through a private scheduler built like
    the real one — same dtypes, read-only hashes as decoded from a frame — so every numba
    specialisation and lazily imported path of a decision is loaded before READY, not on the
    first real request."""
    bs = cfg.daemon.block_size
    arrays = LedgerArrays.private(
        max_workers=2, max_slots=4, max_blocks_per_request=8, ref_capacity=1024, block_size=bs
    )
    progress, state = np.zeros(4, np.uint64), np.zeros(4, np.uint64)
    ledger = Ledger(arrays, progress, cfg.overload, state=state)
    warm_cfg = msgspec.structs.replace(cfg, workers=[])
    sched = create_scheduler(
        warm_cfg,
        ledger=ledger,
        overlap=OverlapIndex(2, 1024),
        event_device=OverlapIndex(2, 1024),
        event_offload=OverlapIndex(2, 1024),
    )
    sched.add_worker(WorkerKey(0, 0), 1000, 1000)
    for fed in (False, True):
        sched.set_event_fed(0, fed)
        hashes = np.frombuffer(np.arange(1, 3, dtype="<u8").tobytes(), dtype="<u8")  # read-only, like a frame's
        spec = RequestSpec(request_id=f"warm-{fed}", isl_tokens=2 * bs, block_hashes=hashes)
        out = sched.enqueue(spec, 1)
        admit = out[0]
        if not isinstance(admit, Admit):
            raise RuntimeError(f"the warm-up request was rejected: {admit.reason} {admit.detail}")
        for kind, tokens in (("dispatched", None), ("prefill_done", None), ("progress", 1)):
            sched.update(admit.request_id, admit.slot, admit.generation, kind, tokens, 2)
        progress[admit.slot] = (admit.generation << 32) | 2
        state[admit.slot] = (admit.generation << 32) | 3
        sched.tick(3)
        sched.release(admit.request_id, admit.slot, admit.generation, "completed", 2 * bs + 2, 4)
        sched.drain_cleanup(4)
