"""What an existing ledger segment holds when its layout version is not ours (daemon start).

Layout version 2 changed only the progress segment (a state word per slot after the progress
words); the ledger's fields are the same in versions 1 and 2, so the slot table of a version-1
ledger can be read to count its live leases. The daemon replaces older segments that hold no live
lease and refuses to start over ones that do (their routers still write version-1 words), naming
`kvsched-daemon --purge`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from .layout import (
    H_BLOCK_SIZE,
    H_MAGIC,
    H_MAX_BLOCKS,
    H_MAX_SLOTS,
    H_MAX_WORKERS,
    H_REF_CAPACITY,
    H_VERSION,
    HEADER_WORDS,
    MAGIC,
    LedgerArrays,
)
from .segments import _untrack, ledger_name, mapped_view

COMPATIBLE_LEDGER_VERSIONS = (1, 2)  # ledger fields unchanged between these versions


@dataclass(frozen=True)
class FoundLayout:
    """An existing ledger segment: its layout `version` (0 = no kvsched magic) and its live leases
    (-1 when the slot table cannot be read)."""

    version: int
    live_leases: int


def inspect_ledger(instance: str) -> FoundLayout | None:
    """Read the header (and, for a readable version, the slot table) of `instance`'s ledger.

    Returns:
        None when no ledger segment exists; else a `FoundLayout`.
    """
    try:
        shm = SharedMemory(name=ledger_name(instance))
    except FileNotFoundError:
        return None
    _untrack(shm)
    try:
        if shm.size < HEADER_WORDS * 8:
            return FoundLayout(0, -1)
        h = np.frombuffer(mapped_view(shm), dtype=np.uint64, count=HEADER_WORDS).copy()
        if int(h[H_MAGIC]) != MAGIC:
            return FoundLayout(0, -1)
        version = int(h[H_VERSION])
        if version not in COMPATIBLE_LEDGER_VERSIONS:
            return FoundLayout(version, -1)
        try:
            arrays = LedgerArrays(
                mapped_view(shm),
                max_workers=int(h[H_MAX_WORKERS]),
                max_slots=int(h[H_MAX_SLOTS]),
                max_blocks_per_request=int(h[H_MAX_BLOCKS]),
                ref_capacity=int(h[H_REF_CAPACITY]),
                block_size=int(h[H_BLOCK_SIZE]),
            )
        except Exception:
            return FoundLayout(version, -1)
        live = int(np.count_nonzero(arrays.s_state))
        del arrays
        return FoundLayout(version, live)
    finally:
        with contextlib.suppress(BufferError):
            shm.close()
