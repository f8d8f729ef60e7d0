"""`create_scheduler`: the one way to build a `Scheduler` — the daemon (shared-memory ledger and
KV-index segment), its warm-up, the virtual-time simulator and the tests all call it.

Pure: it allocates private arrays when no ledger is given, never a segment or a socket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..config import Config
from ..shm.layout import LedgerArrays
from ..shm.overlap import OverlapIndex
from .ledger import Ledger
from .overlap_view import ApproxIndex, overlap_capacity
from .scheduler import Scheduler
from .selector import WorkerSelector, create_selector
from .types import WorkerKey


def create_scheduler(
    config: Config,
    *,
    ledger: Ledger | None = None,
    overlap: OverlapIndex | ApproxIndex | None = None,
    event_device: OverlapIndex | None = None,
    event_offload: OverlapIndex | None = None,
    events: bool = False,
    owner_alive: Callable[[int], bool] | None = None,
    same_process: Callable[[int, int], bool] | None = None,
    selector: WorkerSelector | None = None,
    add_workers: bool = True,
    speculative_ttl_s: float | None = None,
) -> Scheduler:
    """A Scheduler for `config`.

    Args:
        config: the whole config (classes, selector, overload, daemon sizes, workers).
        ledger: the `Ledger` to schedule over; None = private arrays sized by `config.daemon`
            (max_workers, max_slots, max_blocks_per_request, block_size), no router words.
        overlap: the approximate index (or a stand-in with the same methods); None = a private
            `OverlapIndex` of `overlap_capacity(max_workers)` entries.
        event_device / event_offload: KV-event-fed indexes (the daemon's live in the KV-index
            segment); with `events` and no `event_device`, a private device index is made.
        owner_alive: owner id -> False when the requester is known gone (default: always alive).
        same_process: (owner a, owner b) -> True for two connections of one process (default: never).
        selector: the `WorkerSelector`; None = `create_selector(config.selector)`.
        add_workers: register every rank of `config.workers` not registered yet (`add_config_workers`).
        speculative_ttl_s: TTL of the speculative entries (s); None = approx_ttl_s / 24.
    Raises:
        ValueError: a selector type that is not installed (`create_selector`), an unknown admission
            policy type, or more configured ranks than rows.
    """
    if ledger is None:
        d = config.daemon
        arrays = LedgerArrays.private(d.max_workers, d.max_slots, d.max_blocks_per_request, None, d.block_size)
        ledger = Ledger(arrays, progress=None, overload=config.overload)
    w = ledger.arrays.max_workers
    if overlap is None:
        overlap = OverlapIndex(w, overlap_capacity(w))
    if events and event_device is None:
        event_device = OverlapIndex(w, overlap_capacity(w))
    kwargs: dict[str, Any] = {}  # only the callbacks given: the Scheduler's defaults otherwise
    if owner_alive is not None:
        kwargs["owner_alive"] = owner_alive
    if same_process is not None:
        kwargs["same_process"] = same_process
    sched = Scheduler(
        config,
        ledger,
        overlap,
        selector if selector is not None else create_selector(config.selector),
        event_device=event_device,
        event_offload=event_offload,
        speculative_ttl_s=speculative_ttl_s,
        **kwargs,
    )
    if add_workers:
        add_config_workers(sched, config)
    return sched


def add_config_workers(sched: Scheduler, config: Config) -> list[WorkerKey]:
    """Register every rank of `config.workers` that the ledger does not hold yet (a restarted
    daemon's ledger keeps its rows). Returns the keys added, in config order."""
    added = []
    for w in config.workers:
        for rank in range(w.dp_size):
            key = WorkerKey(w.worker_id, rank)
            if sched.ledger.row_of(key) is None:
                sched.add_worker(key, w.total_kv_blocks, w.max_num_batched_tokens)
                added.append(key)
    return added
