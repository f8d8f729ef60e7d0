"""Test factories with keyword overrides (docs/DESIGN.md §10.5): entries, class configs, requests, schedulers."""

from __future__ import annotations

import itertools

from kvsched.config import ClassConfig
from kvsched.core.ordering import QueueEntry

_SEQ = itertools.count(1)


def make_entry(request_id: str | None = None, **overrides) -> QueueEntry:
    """A QueueEntry with a fresh enqueue_seq / arrival; override any field by keyword."""
    seq = next(_SEQ)
    fields = dict(request_id=request_id or f"r{seq}", enqueue_seq=seq, arrival_us=seq * 1000, cost=100, isl_tokens=100)
    fields.update(overrides)
    return QueueEntry(**fields)


def make_class(name: str = "default", **overrides) -> ClassConfig:
    """A ClassConfig; override any field by keyword."""
    return ClassConfig(name=name, **overrides)


def make_request(request_id: str = "r1", **overrides):
    """A RequestSpec (isl 100 tokens, no hashes); override any field by keyword."""
    import numpy as np

    from kvsched.core.types import RequestSpec

    fields = dict(request_id=request_id, isl_tokens=100)
    fields.update(overrides)
    if "block_hashes" in fields and not isinstance(fields["block_hashes"], np.ndarray):
        fields["block_hashes"] = np.asarray(fields["block_hashes"], dtype=np.uint64)
    return RequestSpec(**fields)


def make_config(classes=None, **overrides):
    """A Config with the given classes (default: one fcfs class busy above 100% of the token budget)."""
    from kvsched.config import Config, SelectorConfig

    fields = dict(selector=SelectorConfig(seed=0))
    if classes is not None:
        fields["classes"] = classes
        fields.setdefault("default_class", classes[0].name)
    fields.update(overrides)
    return Config(**fields)


def make_scheduler(
    config=None,
    workers=((1, 0),),
    total_kv_blocks: int = 1000,
    max_num_batched_tokens: int = 1000,
    max_workers: int = 8,
    max_slots: int = 64,
    owner_alive=None,
    **config_overrides,
):
    """A Scheduler over a private LedgerArrays with `workers` (worker_id, dp_rank) registered."""
    from kvsched.config import OverloadConfig
    from kvsched.core.create import create_scheduler
    from kvsched.core.ledger import Ledger
    from kvsched.core.types import WorkerKey
    from kvsched.shm.layout import LedgerArrays
    from kvsched.shm.overlap import OverlapIndex

    config = config or make_config(**config_overrides)
    arrays = LedgerArrays.private(max_workers, max_slots, 64, block_size=config.daemon.block_size)
    ledger = Ledger(arrays, overload=config.overload or OverloadConfig())
    s = create_scheduler(
        config, ledger=ledger, overlap=OverlapIndex(max_workers, 1024), owner_alive=owner_alive, add_workers=False
    )
    for wid, rank in workers:
        s.add_worker(WorkerKey(wid, rank), total_kv_blocks, max_num_batched_tokens)
    return s
