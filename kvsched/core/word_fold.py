"""WordFold: the routers' shared-memory words folded into the ledger's slots and aggregates.

A local router stores its lease's progress word (output tokens) and state word (`dispatched`,
`prefill_done`) into shared memory (`kvsched.shm.progress`, `kvsched.shm.words`); the daemon folds
them on every wake and on its fold timer, with the same effect as `Update` frames (docs/PROTOCOL.md,
"Shared memory"). Most wakes find nothing new, so a fold first asks `kernels.words_changed` (5
arguments) and only then runs `kernels.fold_words` (its 15 arrays as one table:
`shm.booking_packed.fold_words_packed`); both are called through their compiled entry points
(`shm.bind.entry_point`). Without state words (older layouts, the simulator
with progress words only) the progress words alone are folded by `kernels.fold_progress`.

Pure: no I/O, no clock. The slot range to fold ([0, n_slots): the ledger's high-water mark of used
slots, or the whole table after a restart) comes from the caller.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..shm.bind import entry_point
from ..shm.booking_packed import fold_words_packed, pack_fold_arrays
from ..shm.kernels import fold_progress, words_changed
from ..shm.layout import LedgerArrays
from .worker_rows import WorkerRows


class WordFold:
    """Folds the progress and state words of one ledger.

    Args:
        arrays: the ledger views (slot table and per-worker aggregates, updated in place).
        rows: the ledger's `WorkerRows` (overload flags are re-checked after a fold that changed load).
        progress: uint64[max_slots] progress words, or None (nothing to fold).
        state: uint64[max_slots] state words, or None (progress words only).
    """

    def __init__(
        self, arrays: LedgerArrays, rows: WorkerRows, progress: np.ndarray | None, state: np.ndarray | None
    ) -> None:
        self.arrays, self.rows, self.progress, self.state = arrays, rows, progress, state
        s, w = arrays.max_slots, arrays.max_workers
        self._seen_state = np.zeros(s, np.uint64)  # state word last folded per slot
        self._seen_progress = np.zeros(s, np.uint64)  # progress word last seen per slot (`words_changed`)
        self._dispatched = np.zeros(s, np.int64)  # fold_words output: slots newly dispatched
        self._counts = np.zeros(3, np.int64)  # fold_words output: [slots changed, dispatched, rows]
        self._rows = np.zeros(w, np.int64)  # fold_words output: rows changed
        self._prev_blocks = np.zeros(w, np.int64)  # aggregates before a progress-only fold
        self._prev_prefill = np.zeros(w, np.int64)
        self._fold: Callable[..., int] | None = None  # entry points, bound on the first fold (`_bind`)
        self._test: Callable[..., bool] | None = None
        if progress is not None and state is not None:
            a = arrays
            args = (
                progress,
                state,
                self._seen_state,
                *a.load,
                arrays.block_size,
                self._dispatched,
                self._counts,
                self._rows,
            )
            self._fold_args = args
            self._test_args = (progress, state, self._seen_progress, self._seen_state)

    def _bind(self) -> tuple[Callable[..., int], Callable[..., bool]]:
        """Resolve both kernels' entry points (first fold: the kernels load or compile then) and return them
        (fold, test); the fold
        takes its 15 arrays as one table (`shm.booking_packed.fold_words_packed`), built here once."""
        a = self._fold_args  # the arrays stay referenced here beside their table (`shm.argtable`)
        self._fold_call = (a[12], pack_fold_arrays((*a[:12], *a[13:])))  # (block_size, table)
        self._fold = fold = entry_point(fold_words_packed, (0, *self._fold_call))
        self._test = test = entry_point(words_changed, (0, *self._test_args))
        return fold, test

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles drop the fold's argument table (`shm.argtable`: this process's addresses
        of the original arrays); the copy binds its own on its first fold."""
        state = dict(self.__dict__)
        state.pop("_fold_call", None)
        state["_fold"] = state["_test"] = None
        return state

    def fold_progress(self, n_slots: int) -> int:
        """Fold both words of slots [0, n_slots) (`kernels.fold_words`), or every progress word when
        there are no state words (`kernels.fold_progress`). Slots whose `dispatched` flag appeared
        are kept for `take_dispatched()`. Returns the slots whose load changed."""
        if self.progress is None:
            return 0
        a = self.arrays
        if self.state is not None:
            fold = self._fold
            if fold is None:
                fold = self._bind()[0]
            changed = fold(n_slots, *self._fold_call)
        else:
            changed = fold_progress(self.progress, *a.load, a.block_size)
        if changed and self.rows.overload_rules:
            self.rows.update_overload_all()
        return int(changed)

    def fold(self, n_slots: int) -> tuple[list[int], list[int]]:
        """Fold slots [0, n_slots) and take what changed: (rows whose capacity changed — active blocks
        or active prefill tokens — ascending, so only their blocked lanes are re-checked; slots whose
        `dispatched` flag appeared, as `take_dispatched` returns them).

        With state words, a wake that finds no word changed costs one `words_changed` call."""
        if self.state is None or self.progress is None:
            return self.fold_progress_rows(n_slots), self.take_dispatched()
        fold, test = self._fold, self._test
        if fold is None or test is None:
            fold, test = self._bind()
        if not test(n_slots, *self._test_args):
            return [], []
        changed = fold(n_slots, *self._fold_call)
        _, k, n_rows = self._counts.tolist()
        if changed and self.rows.overload_rules:
            self.rows.update_overload_all()
        rows = self._rows[:n_rows].tolist() if n_rows else []
        if not k:
            return rows, []
        self._counts[1] = 0  # taken (`take_dispatched`)
        return rows, self._dispatched[:k].tolist()

    def fold_progress_rows(self, n_slots: int) -> list[int]:
        """Fold (as `fold_progress`); returns the rows whose capacity changed (active blocks or active
        prefill tokens), ascending, so only their blocked lanes are re-checked."""
        if self.progress is None:
            return []
        a = self.arrays
        if self.state is not None:
            if not self.fold_progress(n_slots):
                return []
            rows: list[int] = self._rows[: int(self._counts[2])].tolist()
            return rows
        np.copyto(self._prev_blocks, a.w_active_blocks)
        np.copyto(self._prev_prefill, a.w_active_prefill)
        if not self.fold_progress(n_slots):
            return []
        return np.flatnonzero(
            (self._prev_blocks != a.w_active_blocks) | (self._prev_prefill != a.w_active_prefill)
        ).tolist()

    def take_dispatched(self) -> list[int]:
        """Slots whose `dispatched` flag the last fold saw appear (once per generation)."""
        k = int(self._counts[1])
        if k == 0:
            return []
        self._counts[1] = 0
        slots: list[int] = self._dispatched[:k].tolist()
        return slots
