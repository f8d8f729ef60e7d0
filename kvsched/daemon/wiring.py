"""Build the daemon's state from the config: shared-memory segments, ledger, overlap index, selector
and the Scheduler, plus the workers declared in `[[workers]]`. No I/O beyond creating segments."""

from __future__ import annotations

import logging
import time

from ..config import Config
from ..core.types import WorkerKey

log = logging.getLogger(__name__)

OVERLAP_CAPACITY_PER_WORKER = 1 << 15  # approximate-index entries budgeted per worker row


def overlap_capacity(max_workers: int) -> int:
    """Entries of the overlap index: `OVERLAP_CAPACITY_PER_WORKER` per row (rows past 64 share the
    budget of 64), rounded up to a power of two as the open-addressing table requires."""
    want = OVERLAP_CAPACITY_PER_WORKER * max(1, min(max_workers, 64))
    return 1 << (want - 1).bit_length()


def segment_capacities(cfg: Config) -> dict[str, int]:
    """The capacities written in (and validated against) the ledger header."""
    from ..shm.layout import default_ref_capacity

    d = cfg.daemon
    return {
        "max_workers": d.max_workers,
        "max_slots": d.max_slots,
        "max_blocks_per_request": d.max_blocks_per_request,
        "ref_capacity": default_ref_capacity(d.max_workers, d.max_slots, d.max_blocks_per_request),
        "block_size": d.block_size,
    }


def open_segments(cfg: Config):
    """Create this instance's segments, or re-attach them after a restart.

    Returns:
        (Segments, restarted): restarted is True when existing segments were re-attached (the
        ledger is then rebuilt from its slot table under a new epoch).
    Raises:
        ShmLayoutError: existing segments with another layout or capacities (use `--purge`).
    """
    from ..shm.layout import attach_segments, create_segments

    caps = segment_capacities(cfg)
    epoch = time.time_ns() // 1000
    try:
        segs = create_segments(cfg.daemon.instance, epoch=epoch, **caps)
        return segs, False
    except FileExistsError:
        segs = attach_segments(cfg.daemon.instance, expect=caps, writable_ledger=True)
        segs.ledger.epoch = epoch
        log.info("re-attached existing segments instance=%s epoch=%d", cfg.daemon.instance, epoch)
        return segs, True


def build_scheduler(cfg: Config, segments, restarted: bool):
    """Wire Ledger + OverlapIndex + selector into a Scheduler and register the configured workers."""
    from ..core.ledger import Ledger
    from ..core.scheduler import Scheduler
    from ..core.selector import create_selector
    from ..shm.overlap import OverlapIndex

    ledger = Ledger(segments.ledger, segments.progress, cfg.overload)
    overlap = OverlapIndex(cfg.daemon.max_workers, overlap_capacity(cfg.daemon.max_workers))
    scheduler = Scheduler(cfg, ledger, overlap, create_selector(cfg.selector))
    if restarted:
        n = scheduler.restore_after_restart(time.monotonic_ns() // 1000, cfg.daemon.liveness_timeout_ms * 1000)
        log.info("re-adopted leases from the slot table count=%d grace_ms=%d", n, cfg.daemon.liveness_timeout_ms)
    for w in cfg.workers:
        for rank in range(w.dp_size):
            key = WorkerKey(w.worker_id, rank)
            if ledger.row_of(key) is None:
                scheduler.add_worker(key, w.total_kv_blocks, w.max_num_batched_tokens)
    return scheduler
