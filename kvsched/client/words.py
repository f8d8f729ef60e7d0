"""`SlotWords`: a router's mapping of the daemon's progress segment, written by plain stores.

A router on the daemon's host maps the progress segment read-write (the ledger read-only) once the
`Welcome` names it, and then reports a lease's `dispatched` / `prefill_done` and output tokens with
one aligned 8-byte store each into its slot's state and progress words (`kvsched.shm.words`,
`kvsched.shm.progress`): no frame, no syscall. The daemon folds changed words on its next wake and on
its `fold_interval_ms` timer. When the segment cannot be mapped (a remote host, permissions, a layout
this package does not know) nothing is mapped and the client sends `Update` frames instead
(docs/PROTOCOL.md "Shared memory (local routers)").
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import numpy as np

from ..shm.progress import write_progress
from ..shm.segments import Segments, attach_segments, ledger_instance
from ..shm.words import STATE_DISPATCHED, STATE_PREFILL_DONE, write_state

log = logging.getLogger(__name__)


class SlotWords:
    """The progress segment as this router maps it (or not).

    Attributes:
        progress: uint64[max_slots] progress words (generation << 32 | output tokens), or None.
        state: uint64[max_slots] state words (generation << 32 | flags), or None.
    """

    __slots__ = ("_segments", "progress", "state")

    def __init__(self) -> None:
        self._segments: Segments | None = None
        self.progress: np.ndarray[Any, np.dtype[np.uint64]] | None = None
        self.state: np.ndarray[Any, np.dtype[np.uint64]] | None = None

    @property
    def mapped(self) -> bool:
        """True while both word arrays are mapped."""
        return self.progress is not None and self.state is not None

    def attach(self, shm_ledger: str, daemon_epoch: int | None = None) -> bool:
        """Map the segments of the daemon whose ledger is `shm_ledger` (`Welcome.shm_ledger`).

        A second call while mapped keeps the mapping when its ledger header carries `daemon_epoch`
        (`Welcome.daemon_epoch`: every daemon stamps its epoch into the header of the segments it
        creates or re-attaches). Another epoch there means the daemon created new segments under the
        same names (its predecessor unlinked the old ones when it stopped with no lease live): the
        old mapping is dropped and the new segments mapped, else stores would land in an unlinked
        segment nobody reads. Never raises: any failure to map is logged and leaves the words
        unmapped (the caller falls back to frames).

        Returns:
            True when the words are mapped after the call.
        """
        if self._segments is not None:
            if daemon_epoch is None or int(self._segments.ledger.epoch) == daemon_epoch:
                return self.mapped
            self.close()

        instance = ledger_instance(shm_ledger)
        if instance is None:
            return False
        try:
            self._segments = attach_segments(instance, writable_ledger=False)
            self.progress = self._segments.progress
            self.state = self._segments.state
        except Exception as exc:  # remote host, permissions, a layout we do not know: fall back to frames
            log.info("progress segment not mapped (using Update frames) reason=%s", exc)
            self.progress = self.state = None
        return self.mapped

    def store_progress(self, slot: int, generation: int, output_tokens: int) -> bool:
        """Store a lease's output tokens (one 8-byte store). False (nothing stored) when unmapped."""
        if self.progress is None:
            return False
        write_progress(self.progress, slot, generation, output_tokens)
        return True

    def store_state(self, slot: int, generation: int, kind: Literal["dispatched", "prefill_done"]) -> bool:
        """Add `kind` to a lease's state word (one 8-byte store). False (nothing stored) when unmapped."""
        if self.state is None:
            return False
        write_state(self.state, slot, generation, STATE_PREFILL_DONE if kind == "prefill_done" else STATE_DISPATCHED)
        return True

    def close(self) -> None:
        """Drop the arrays and unmap the segments (idempotent)."""
        self.progress = self.state = None
        if self._segments is not None:
            self._segments.close()
            self._segments = None
