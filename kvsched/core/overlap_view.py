"""OverlapView: the prefix blocks of a request each worker row is credited with (docs/DESIGN.md §6.4).

The view owns up to four `OverlapIndex`es and combines them the same way for the cost snapshot and
for `admit_one`:

* the approximate index, learnt from routing decisions (TTL `selector.approx_ttl_s`);
* the event-fed device and offload indexes (KV events of the engines);
* the speculative index: routing decisions on event-fed rows, short TTL.

Rows without a KV-event source, and rows whose stream is stale (`FLAG_STALE`), use the approximate
index only. Event-fed rows that are fresh are credited max(device, speculative) +
`offload_overlap_credit` per offload-only block beyond it, floored; the long-TTL approximate entries
are NOT used for them (the events say what the engine really holds, evictions included; the
approximate index only guesses). The `credit_rows` kernel (`shm/select_kernels.py`) states the rule.

The speculative entry covers the time between the routing decision and the engine's BlockStored
(engine queueing + prefill + transport). Its TTL is `approx_ttl_s / 24` (5 s at the default 120 s):
long enough for a long prompt's prefill under load, short enough that a guess the engine never
confirms (rejected request, eviction) stops counting within seconds; tying it to `approx_ttl_s`
carries the replay's time scaling (`approx_ttl_s / speedup`) through. The credited overlap is
floored to whole blocks (the projection kernel takes int32 blocks).

A requeue withdraws what its own admission wrote (`withdraw`): the hashes past the row's prefix
depth in each index at admission time (the ones that admission added, not ones it only refreshed),
so a requeued request is never credited with blocks it never cached.

Source: Dynamo kv-router (approximate mode: the router's own decisions as the cache prediction;
KV events when the engines publish them).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from ..config import SelectorConfig
from ..shm.admit_packed import credited_depth_packed, pack_credited_arrays
from ..shm.layout import FLAG_STALE
from ..shm.overlap import OverlapIndex
from ..shm.select_kernels import credit_rows
from .ledger import Ledger

SPECULATIVE_CAPACITY = 1 << 16  # entries of the speculative index (short-lived; few are live at once)
SPECULATIVE_TTL_FRACTION = 1 / 24  # speculative TTL = approx_ttl_s * this (5 s at the default 120 s)
OVERLAP_CAPACITY_PER_WORKER = 1 << 14  # overlap-index entries budgeted per worker row (33 B each, per index)


def overlap_capacity(max_workers: int) -> int:
    """Entries of an overlap index: `OVERLAP_CAPACITY_PER_WORKER` per row (rows past 64 share the
    budget of 64), rounded up to a power of two as the open-addressing table requires."""
    want = OVERLAP_CAPACITY_PER_WORKER * max(1, min(max_workers, 64))
    return 1 << (want - 1).bit_length()


class ApproxIndex(Protocol):
    """What `OverlapView` asks of an approximate index that is not an `OverlapIndex` (a stand-in such
    as the simulator's index that learns nothing): the compiled paths run only over `OverlapIndex`es."""

    def insert(self, hashes: np.ndarray, row: int, now_us: int, ttl_us: int) -> None: ...
    def remove(self, hashes: np.ndarray, row: int) -> None: ...
    def clear_row(self, row: int) -> None: ...
    def depth(self, hashes: np.ndarray, now_us: int, out: np.ndarray) -> None: ...


class OverlapView:
    """The overlap indexes of one scheduler and the rule that credits them (module docstring).

    Args:
        ledger: the `Ledger` (its worker flags say which rows are stale; its `version` keys the memo).
        approx: the approximate index (routing decisions), or a stand-in with the `ApproxIndex` methods.
        device / offload: KV-event-fed indexes, or None when no worker publishes events.
        speculative: short-TTL index of decisions on event-fed rows (created when `device` is given
            and this is None).
        selector: the `[selector]` table (approx_ttl_s, offload_overlap_credit).
        speculative_ttl_s: TTL of the speculative entries (s); None = approx_ttl_s / 24.
    Attributes:
        depth_out: int32[max_workers], the credited depths of the last `depth` call (blocks).
        fused_approx: `approx` when it is an `OverlapIndex` (the compiled paths read its arrays), else None.
    Invariant: `depth(h, t)` twice with the same array object, time and unchanged indexes returns
    the same values without a second lookup (memo on identity, time and every index's version).
    """

    def __init__(
        self,
        ledger: Ledger,
        approx: OverlapIndex | ApproxIndex,
        *,
        device: OverlapIndex | None = None,
        offload: OverlapIndex | None = None,
        speculative: OverlapIndex | None = None,
        selector: SelectorConfig,
        speculative_ttl_s: float | None = None,
    ) -> None:
        w = ledger.arrays.max_workers
        self.ledger = ledger
        self.approx, self.device, self.offload = approx, device, offload
        if speculative is None and device is not None:
            speculative = OverlapIndex(w, SPECULATIVE_CAPACITY)
        self.speculative = speculative
        self._speculative_ttl_s = speculative_ttl_s
        self.depth_out = np.zeros(w, np.int32)
        self.approx_depth = np.zeros(w, np.int32)  # raw depths in the approximate index
        self._spec_raw = np.zeros(w, np.int32)  # raw depths in the speculative index
        self.event_fed = np.zeros(w, np.uint8)  # row -> 1 when a KV-event source feeds it
        self._n_fed = 0
        self._dev_depth = np.zeros(w, np.int32)
        self._off_depth = np.zeros(w, np.int32)
        self._spec_depth = np.zeros(w, np.int32)
        self._credited: tuple[Any, ...] | None = None  # (objects read, arrays, `credited_depth_packed`'s table)
        self._memo_of: np.ndarray | None = None  # the hashes array the memo is for (identity)
        self._memo_t = self._memo_v = -1  # its time (µs) and `_version()`
        # the approximate index when it is an `OverlapIndex` (the compiled paths read its arrays), else None
        self.fused_approx = approx if isinstance(approx, OverlapIndex) else None
        self._versioned = [ix for ix in (approx, device, offload, speculative) if isinstance(ix, OverlapIndex)]

        self._fused_depth = all(
            isinstance(ix, OverlapIndex) for ix in (approx, device, offload, speculative) if ix is not None
        )  # `credited_depth` reads every index's arrays
        self.configure(selector)

    def configure(self, selector: SelectorConfig) -> None:
        """(Re)read the TTLs (µs) and the offload credit from the `[selector]` table (start, reload)."""
        approx_s = selector.approx_ttl_s
        self.ttl_us = int(approx_s * 1_000_000)
        spec_s = self._speculative_ttl_s if self._speculative_ttl_s is not None else approx_s * SPECULATIVE_TTL_FRACTION
        self.spec_ttl_us = max(1, int(spec_s * 1_000_000))
        self.offload_credit = selector.offload_overlap_credit
        self._memo_of = None

    def set_event_fed(self, row: int, fed: bool) -> None:
        """Mark `row` as fed (or no longer fed) by a KV-event stream; unfed rows use the approximate index."""
        self.event_fed[row] = 1 if fed else 0
        self._n_fed = int(np.count_nonzero(self.event_fed))
        self._memo_of = None

    def forget_row(self, row: int) -> None:
        """Clear `row` from every index; it is no longer event-fed (a new source re-marks it)."""
        for idx in (self.approx, self.device, self.offload, self.speculative):
            if idx is not None:
                idx.clear_row(row)
        self.set_event_fed(row, False)

    def _version(self) -> int:
        """Sum of the ledger's and every index's version. Each only ever grows, so an equal sum
        means no index and no worker flag changed since the memo was taken."""
        v: int = self.ledger.version
        for idx in self._versioned:
            v += idx.version
        return v

    def __getstate__(self) -> dict[str, Any]:
        """Copies and pickles drop the argument tables (`shm.argtable`): they hold this process's
        addresses of the original arrays; the copy builds its own on first use."""
        return {**self.__dict__, "_credited": None}

    def depth(self, hashes: np.ndarray, now_us: int) -> np.ndarray:
        """int32[max_workers] (`depth_out`): overlap blocks to credit per row for `hashes` (uint64[n])
        at `now_us` (module docstring). Memoised: the cost snapshot and admit_one of an immediate
        admission ask for the same depths back to back."""
        v = self._version()
        if hashes is self._memo_of and now_us == self._memo_t and v == self._memo_v:
            return self.depth_out
        self._memo_of, self._memo_t, self._memo_v = hashes, now_us, v
        out = self.depth_out
        dev, sp = self.device, self.speculative  # a device index always comes with a speculative one
        ap = self.fused_approx
        if dev is None or sp is None or ap is None or self._n_fed == 0 or not self._fused_depth:
            self.approx.depth(hashes, now_us, self.approx_depth)
            out[:] = self.approx_depth
            if dev is None or sp is None or self._n_fed == 0:
                return out
            return self._depth_by_index(hashes, now_us, out, dev, sp)
        off = self.offload if self.offload is not None else dev
        # every index's depth, then stale / unfed rows: approximate only; the others: the credit of the
        # module docstring, floored (one kernel call)
        flags = self.ledger.arrays.w_flags
        got = self._credited
        if got is None or not all(x is y for x, y in zip(got[0], (ap, dev, off, sp, flags, out), strict=True)):
            arrays = (
                ap.keys,
                ap.used,
                ap.perm,
                ap.ttlm,
                ap.ttl_exp,
                dev.keys,
                dev.used,
                dev.perm,
                dev.ttlm,
                dev.ttl_exp,
                off.keys,
                off.used,
                off.perm,
                off.ttlm,
                off.ttl_exp,
                sp.keys,
                sp.used,
                sp.perm,
                sp.ttlm,
                sp.ttl_exp,
                ap.scratch,
                self.approx_depth,
                self._dev_depth,
                self._off_depth,
                self._spec_depth,
                self.event_fed,
                flags,
                self._spec_raw,
                out,
            )
            # the arrays stay referenced beside their table (its addresses: `shm.argtable`)
            got = self._credited = ((ap, dev, off, sp, flags, out), arrays, pack_credited_arrays(arrays))
        credited_depth_packed(
            np.asarray(hashes, dtype=np.uint64),
            int(now_us),
            0 if self.offload is None else 1,
            float(self.offload_credit),
            FLAG_STALE,
            got[2],
        )
        return out

    def _depth_by_index(
        self, hashes: np.ndarray, now_us: int, out: np.ndarray, device: OverlapIndex, speculative: OverlapIndex
    ) -> np.ndarray:
        """`depth` of event-fed rows index by index (an approximate index that is not an `OverlapIndex`)."""
        device.depth(hashes, now_us, self._dev_depth)
        off = None
        if self.offload is not None:
            self.offload.depth(hashes, now_us, self._off_depth)
            off = self._off_depth
        speculative.depth(hashes, now_us, self._spec_depth)
        credit_rows(
            self.approx_depth,
            self._dev_depth,
            self._off_depth,
            self._spec_depth,
            self.event_fed,
            self.ledger.arrays.w_flags,
            FLAG_STALE,
            float(self.offload_credit),
            off is not None,
            self._spec_raw,
            out,
        )
        return out

    def zero(self) -> np.ndarray:
        """`depth_out` set to 0 (a request without hashes); the memo is dropped."""
        self.depth_out[:] = 0
        self._memo_of = None
        return self.depth_out

    def approx_only(self) -> bool:
        """True when `depth` reads the approximate index alone (no event-fed row, or no device index)."""
        return self.device is None or self._n_fed == 0

    def drop_memo(self) -> None:
        """Forget the memo (a caller wrote `depth_out` itself: the fused admission kernel)."""
        self._memo_of = None

    def record(self, hashes: np.ndarray, row: int, now_us: int) -> tuple[Any, ...]:
        """Write an admission's hashes to the approximate index (and the speculative one for an
        event-fed row). Returns what `withdraw` removes on requeue: (row, hashes, approximate
        depth, speculative depth or -1) — the hashes past the row's prefix depth in each index,
        kept as depths and sliced only on a requeue. Needs `depth(hashes, now_us)` computed just
        before (admit_one's projection does it)."""
        approx_d = int(self.approx_depth[row])
        self.approx.insert(hashes, row, now_us, self.ttl_us)
        return self.record_speculative(hashes, row, now_us, approx_d)

    def record_speculative(self, hashes: np.ndarray, row: int, now_us: int, approx_d: int) -> tuple[Any, ...]:
        """`record` after the approximate insert was done (by `record`, or by the fused admission
        kernel, whose caller passes the row's approximate depth `approx_d` and bumps the index's
        version): the speculative index's part. Returns `record`'s value."""
        spec_d = -1
        if self.speculative is not None and self.event_fed[row]:
            if self.device is None:  # depth() computed no speculative depth
                self.speculative.depth(hashes, now_us, self._spec_raw)
            spec_d = int(self._spec_raw[row])
            self.speculative.insert(hashes, row, now_us, self.spec_ttl_us)
        return row, hashes, approx_d, spec_d

    def withdraw(self, wrote: tuple[Any, ...]) -> None:
        """A requeue: remove what one admission added (`record`'s value)."""
        row, hashes, approx_d, spec_d = wrote
        if len(hashes) > approx_d:
            self.approx.remove(hashes[approx_d:], row)
        if spec_d >= 0 and len(hashes) > spec_d and self.speculative is not None:
            self.speculative.remove(hashes[spec_d:], row)
