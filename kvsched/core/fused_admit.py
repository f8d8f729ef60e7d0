"""FusedAdmission: the immediate admission of the default configuration in one kernel call.

`Admitter.admit_fast` is `FusedAdmission.admit`: `shm.admit_packed.admit_kv_packed` (`admit_kv` with its
fixed arrays given as one table: overlap → busy rule → cost snapshot → projection → kv terms and argmin
→ booking → overlap record → recent work), then the lease's records. It decides exactly as
`Admitter.admit_one` does: the kernel composes the same kernels `admit_one` calls, and whenever the
decision is not a unique finite minimum (ties draw from the selector's RNG), the class is busy, or
anything else the kernel does not cover applies, it books nothing and the caller takes the Python path
(tests/core/test_fused_admission.py runs both paths on the same operations).

This runs for every immediate admission, where each Python call costs ~0.2-0.4 µs on the project's
VM (docs/BENCHMARKS.md §4b), so `admit` is one function: the memo checks of the placeable mask, the
kernel's parameters and argument table, and the overlap view's approximate-only test are written out
in it (each names the method it stands for), and the kernel is called through its compiled entry
point (`shm.bind.entry_point`: numba's per-call type resolution skipped) when the hashes are a
C-contiguous uint64 vector, the only layout that entry point reads correctly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Protocol

import numpy as np

from ..shm.admit_kernels import (
    OUT_CACHED,
    OUT_EVICTED,
    OUT_GENERATION,
    OUT_LEN,
    OUT_OVERLAP,
    OUT_SNAPSHOT,
    UNDECIDED,
    P,
    pack_kv_params,
)
from ..shm.admit_packed import admit_kv_packed, pack_admit_arrays
from ..shm.bind import entry_point
from ..shm.overlap import INT64_MAX
from .live import LEASED, Live
from .ordering import QueueEntry
from .types import Admit, RequestSpec

if TYPE_CHECKING:
    from ..config import SelectorConfig
    from ..protocol import WorkerKey
    from .class_queue import PolicyClassQueue
    from .explain_ring import ExplainRing
    from .leases import LeaseTable
    from .ledger import Ledger
    from .overlap_view import OverlapView
    from .selector import WorkerSelector


class AdmitterParts(Protocol):
    """What the fused path reads and writes of its `admitter.Admitter` (the one implementation, which
    builds a `FusedAdmission` of itself: stated here so this module does not import it)."""

    ledger: Ledger
    view: OverlapView
    selector: WorkerSelector
    leases: LeaseTable
    explain: ExplainRing
    elig: np.ndarray
    placeable: np.ndarray
    decisions_total: int

    @property
    def selector_cfg(self) -> SelectorConfig: ...
    def placeable_mask(
        self, pinned: WorkerKey | None, allowed: frozenset[int] | None, drained_count: bool = False
    ) -> int: ...
    def fleet_ids(self) -> tuple: ...


_U64 = np.dtype(np.uint64)  # the block hashes' dtype (an `is` test first: ~0.3 µs less than `!=`)
_ONE_WORD = (_U64.itemsize,)  # the strides of a C-contiguous uint64 vector (1-D)
_ENTRY: list = []  # admit_kv_packed's compiled entry point, resolved once per process (`_admit_entry`)


def _admit_entry() -> Callable[..., int]:
    """`admit_kv_packed`'s entry point for the daemon's argument types (read-only uint64 hashes as decoded
    from a frame, int64 scalars, the float64 params and the int64 table): the overload
    `shm.admit_kernels.warm_admit_kernels` compiles. A writable vector is read alike (numba's
    unboxing checks the item size only, and the kernel never writes the hashes)."""
    if not _ENTRY:
        hashes = np.frombuffer(bytes(8), dtype=np.uint64)
        _ENTRY.append(
            entry_point(
                admit_kv_packed,
                (hashes, 0, 0, 0, 0, 0, 0, 0, 0, 1.0, 0, 0, 0, np.zeros(1), 0, 0, np.zeros(4, np.int64)),
            )
        )
    return _ENTRY[0]


class FusedAdmission:
    """The fused immediate path of one `Admitter` (module docstring).

    Args:
        adm: the `Admitter`; its ledger, overlap view, selector, lease table and explain ring are read
            and written here.
    Attributes:
        params: class index -> (its `ClassConfig`, `admit_kv`'s float64 params); emptied by `reset`.
        scratch: float64[4, W], the kernel's work space; out: int64[OUT_LEN], what it reports back.
    """

    def __init__(self, adm: AdmitterParts) -> None:
        self.adm = adm
        w = adm.ledger.arrays.max_workers
        self.params: dict[int, tuple] = {}
        self.scratch = np.zeros((4, w), np.float64)
        self.out = np.zeros(OUT_LEN, np.int64)
        self._key: tuple | None = None  # the objects the table describes (`kernel_arrays`)
        self._arrays: tuple = ()  # the arrays themselves, kept alive beside their table
        self._args: tuple = ()  # (block_size, stride, table)
        self._kernel = None  # `_admit_entry()`, bound on first use

    def reset(self) -> None:
        """Forget the packed params (the selector, the `[selector]` table or a class changed)."""
        self.params = {}

    def __getstate__(self) -> dict:
        """Copies and pickles drop the argument table (`shm.argtable`: it holds this process's addresses
        of the original arrays) and the kernel's entry point; the copy builds its own on first use."""
        return {**self.__dict__, "_key": None, "_arrays": (), "_args": (), "_kernel": None}

    def params_of(self, cq: PolicyClassQueue) -> np.ndarray:
        """`admit_kv`'s params for class `cq` (packed again when its config or the `[selector]` table changes)."""
        got = self.params.get(cq.index)
        if got is None or got[0] is not cq.config:
            adm = self.adm
            p = pack_kv_params(adm.selector, adm.selector_cfg, cq.config)
            p[P["inv_bs"]] = 1.0 / float(adm.ledger.block_size)
            got = self.params[cq.index] = (cq.config, p)
        return got[1]

    def _objects(self) -> tuple:
        adm = self.adm
        view = adm.view
        return adm.explain, adm.selector.recent, adm.ledger.arrays, view.approx, view.depth_out, adm.elig

    def kernel_arrays(self) -> tuple:
        """`admit_kv_packed`'s last arguments: (block_size, stride, the table of `admit_kv`'s 41 fixed
        arrays). Built once, again when one of the objects it reads is replaced (explain ring, the
        selector's recent-work array, ledger arrays, approximate index, depth or eligibility array);
        the arrays stay referenced beside the table while it holds their addresses (`shm.argtable`)."""
        key = self._objects()
        k = self._key
        if k is not None and all(a is b for a, b in zip(k, key)):
            return self._args
        ring, recent, a, ix, depth, elig = key
        adm = self.adm
        arrays = (
            elig,
            adm.placeable,
            ix.keys,
            ix.used,
            ix.perm,
            ix.ttlm,
            ix.ttl_exp,
            ix.scratch,
            depth,
            a.w_generation,
            a.w_active_blocks,
            a.w_active_prefill,
            a.w_active_requests,
            a.w_max_batched_tokens,
            a.ref_keys,
            a.ref_counts,
            a.arena,
            a.s_state,
            a.s_generation,
            a.s_worker_row,
            a.s_worker_generation,
            a.s_isl,
            a.s_cached,
            a.s_prefill,
            a.s_expected_osl,
            a.s_output_tokens,
            a.s_extra_blocks,
            a.s_class,
            a.s_enqueue_us,
            a.s_admit_us,
            a.s_arena_off,
            a.s_arena_len,
            a.s_owner_pid,
            recent,
            self.scratch,
            ring.elig,
            ring.depth,
            ring.blocks,
            ring.prefill,
            ring.terms,
            self.out,
        )
        ledger = adm.ledger
        self._args = (ledger.block_size, ledger.stride, pack_admit_arrays(arrays))
        self._key, self._arrays = key, arrays
        return self._args

    def admit(self, spec: RequestSpec, cq: PolicyClassQueue, seq: Iterator[int], now_us: int) -> Admit | None:
        """Admit `spec` at once with one `admit_kv` kernel call, or None: nothing changed, the caller
        decides by the Python path (module docstring).

        The caller has checked: `Admitter.fused`, `eligible_mask` > 0 into the admitter's `elig`, an
        unpinned request, a class (`cq`) without an admission policy and without a ready backlog. `seq`
        is the enqueue_seq counter (drawn only when the request is admitted).
        """
        hashes, isl, adm = spec.block_hashes, spec.isl_tokens, self.adm
        sel = adm.selector
        dt = hashes.dtype
        if (dt is not _U64 and dt != _U64) or not sel.kernel_may_decide(isl) or not adm.leases.owner_alive(spec.owner):
            return None
        ledger, view, ring, rid = adm.ledger, adm.view, adm.explain, spec.request_id
        try:
            slot = ledger.take_slot(rid)
        except ValueError:  # the Python path raises it
            return None
        if slot is None:  # slot table full: the Python path rejects
            return None
        slot = slot[0]
        adm.placeable_mask(None, spec.allowed_workers)  # memoised: usually a hit
        own_depth = view.approx_only()
        if not own_depth:
            view.depth(hashes, now_us)
        params = self.params.get(cq.index)  # `params_of`, its memo checked here
        params = params[1] if params is not None and params[0] is cq.config else self.params_of(cq)
        k = self._key  # `kernel_arrays`, its memo checked here
        if (
            k is not None
            and k[0] is ring
            and k[1] is sel.recent
            and k[2] is ledger.arrays
            and k[3] is view.approx
            and k[4] is view.depth_out
            and k[5] is adm.elig
        ):
            args = self._args
        else:
            args = self.kernel_arrays()
        kernel = self._kernel
        if kernel is None:
            kernel = self._kernel = _admit_entry()
        if hashes.strides != _ONE_WORD:  # not a C-contiguous vector: the entry point would misread it
            kernel = admit_kv_packed
        recent_at = sel.recent_at_us
        expected = spec.expected_osl
        row = kernel(
            hashes,
            isl,
            now_us,
            slot,
            -1 if expected is None else expected,
            cq.index,
            now_us,
            spec.owner,
            min(now_us + view.ttl_us, INT64_MAX - 1),
            sel.decay(now_us),
            1 if now_us > recent_at else 0,
            0 if own_depth else 1,
            ring.head,
            params,
            args[0],
            args[1],
            args[2],
        )  # not `*args`: no tuple built
        if own_depth:
            view.drop_memo()  # the kernel wrote depth_out
        if row < 0:
            ledger.give_back(slot)
            if row == UNDECIDED:
                ring.lose_head()
            return None
        # the Python half: maps, lease, overlap versions, explain record
        out = self.out.tolist()
        gen, ob, cached = out[OUT_GENERATION], out[OUT_OVERLAP], out[OUT_CACHED]
        ledger.booked(slot, rid, row)
        if now_us > recent_at and sel.recent_weight > 0.0:
            sel.recent_at_us = now_us
        if sel.home_weight > 0.0 and cached > 0 and cached >= sel.home_min_cached_share * isl:
            sel.note_home(row, isl, isl - cached, now_us)  # what `admitted` counts (its condition, checked first)
        entry = QueueEntry(
            rid, next(seq), now_us, spec.priority, spec.strict_priority, out[OUT_SNAPSHOT], isl, None, cq.index
        )
        live = Live(spec, entry, LEASED, slot, gen)
        entry.payload = live
        adm.leases.register(live)  # a lease already: indexed by slot too
        if len(hashes):
            approx = view.approx
            approx.version += 1
            approx.evictions += out[OUT_EVICTED]
            approx_d = ob if own_depth else int(view.approx_depth[row])
            live.wrote = (
                (row, hashes, approx_d, -1)
                if view.speculative is None  # `record_speculative` with no index
                else view.record_speculative(hashes, row, now_us, approx_d)
            )
        ring.commit(rid, row, now_us, adm.fleet_ids())
        adm.decisions_total += 1
        return Admit(rid, spec.owner, ledger.rows.key_of(row), slot, gen, ob, cached, 0, cq.name)
