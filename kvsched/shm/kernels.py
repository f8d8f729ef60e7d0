"""Numba kernels over the ledger arrays (docs/DESIGN.md §3.5): refcount index, projection + cost, progress fold.

Every kernel is `@njit(cache=True, nogil=True)`, takes arrays and scalars only (dtypes fixed in
`layout.py`), writes results into caller-owned `out` arrays and allocates nothing. Each has a
counterpart with the same name and signature in the plain-Python reference, tests/shm/reference.py;
property tests require equal outputs. `shm.warm.warm_kernels()` compiles them all before READY.

Refcount index (one row per worker, `C` entries, C a power of two): open addressing with linear
probing from `mix64(hash) & (C-1)`, at most `MAX_PROBE` probes, backward-shift deletion (no
tombstones). An entry is occupied iff its count > 0, so any u64 (0 included) is a valid key.
Full window: `ref_add` counts the hash as newly live but does not store it, and `ref_remove` of a
hash it cannot find counts it as going 1 -> 0; the two mirror each other, so a booking always
returns exactly what it added and counts never go negative. A projection then sees such a block as
not live (one block over-estimated) — the documented graceful degradation.
"""

from __future__ import annotations

import numpy as np

from .kernel_cache import njit
from .layout import SLOT_ADMITTED, SLOT_DISPATCHED, SLOT_FREE, SLOT_PREFILL_DONE, LedgerArrays
from .mix import MIX_M1, MIX_M2, MIX_S1, MIX_S2, MIX_S3
from .words import STATE_FLAGS, STATE_PREFILL_DONE

MAX_PROBE = 128  # probes per lookup in the refcount index
_M1 = np.uint64(MIX_M1)
_M2 = np.uint64(MIX_M2)
_S1, _S2, _S3, _S32 = np.uint64(MIX_S1), np.uint64(MIX_S2), np.uint64(MIX_S3), np.uint64(32)
_LOW32 = np.uint64(0xFFFFFFFF)


@njit(cache=True, nogil=True)
def mix64(key):
    """splitmix64 finalizer (`mix.py`): u64 -> well-mixed u64 (dense small keys spread over the table)."""
    z = np.uint64(key)
    z = (z ^ (z >> _S1)) * _M1
    z = (z ^ (z >> _S2)) * _M2
    return z ^ (z >> _S3)


@njit(cache=True, nogil=True)
def _home(key, mask):
    return np.int64(mix64(key) & np.uint64(mask))


@njit(cache=True, nogil=True)
def _find(keys_row, counts_row, h, mask, limit):
    """Entry index holding `h`, or -1 (probe stops at an empty entry or after `limit`)."""
    i = _home(h, mask)
    for _ in range(limit):
        if counts_row[i] == 0:
            return -1
        if keys_row[i] == h:
            return i
        i = (i + 1) & mask
    return -1


@njit(cache=True, nogil=True)
def _delete(keys_row, counts_row, i, mask):
    """Empty entry `i` and shift later cluster members back (keeps every key reachable)."""
    counts_row[i] = 0
    j = i
    for _ in range(mask):
        j = (j + 1) & mask
        if counts_row[j] == 0:
            return
        k = _home(keys_row[j], mask)
        if ((j - k) & mask) >= ((j - i) & mask):
            keys_row[i] = keys_row[j]
            counts_row[i] = counts_row[j]
            counts_row[j] = 0
            i = j


@njit(cache=True, nogil=True)
def ref_add(keys_row, counts_row, hashes):
    """Increment the refcount of each hash in one worker's row.

    Args:
        keys_row: uint64[C], keys of one worker row (C a power of two).
        counts_row: int32[C], refcounts; 0 = empty entry.
        hashes: uint64[n], block hashes of one booking.
    Returns:
        int: how many hashes went 0 -> 1 (became live), including ones the full table could not store.
    """
    mask = keys_row.shape[0] - 1
    limit = min(keys_row.shape[0], MAX_PROBE)
    became = 0
    for k in range(hashes.shape[0]):
        h = hashes[k]
        i = _home(h, mask)
        placed = False
        for _ in range(limit):
            c = counts_row[i]
            if c == 0:
                keys_row[i] = h
                counts_row[i] = 1
                became += 1
                placed = True
                break
            if keys_row[i] == h:
                counts_row[i] = c + 1
                placed = True
                break
            i = (i + 1) & mask
        if not placed:
            became += 1
    return became


@njit(cache=True, nogil=True)
def ref_remove(keys_row, counts_row, hashes):
    """Decrement the refcount of each hash (the inverse of `ref_add` for the same hashes).

    Returns:
        int: how many hashes went 1 -> 0, counting hashes not found (see module docstring).
    """
    mask = keys_row.shape[0] - 1
    limit = min(keys_row.shape[0], MAX_PROBE)
    died = 0
    for k in range(hashes.shape[0]):
        i = _find(keys_row, counts_row, hashes[k], mask, limit)
        if i < 0:
            died += 1
        elif counts_row[i] > 1:
            counts_row[i] -= 1
        else:
            _delete(keys_row, counts_row, i, mask)
            died += 1
    return died


@njit(cache=True, nogil=True)
def project_and_cost(
    w_active_blocks,
    w_active_prefill,
    eligible,
    ref_keys,
    ref_counts,
    hashes,
    isl_tokens,
    block_size,
    overlap_blocks,
    prefill_load_scale,
    overlap_credit,
    out_blocks,
    out_prefill,
    out_cost,
):
    """Projected load and selection cost of one request on every worker row (one call per decision).

    Args:
        w_active_blocks: int64[W], active unique blocks per row.
        w_active_prefill: int64[W], outstanding prefill tokens per row.
        eligible: uint8[W], nonzero where the request may run.
        ref_keys / ref_counts: uint64[W, C] / int32[W, C], refcount index.
        hashes: uint64[n], the request's chained block hashes.
        isl_tokens: prompt tokens (>= 1); block_size: tokens per block (B).
        overlap_blocks: int32[W], prefix blocks cached on each row (from the overlap index).
        prefill_load_scale / overlap_credit: float, weights of docs/DESIGN.md §4.12.
        out_blocks: int64[W], written: active + ceil(isl/B) - live prefix on the row; -1 if ineligible.
            The live prefix is the number of leading hashes live on the row: hashes are chained, so
            a live block implies its whole prefix is live and the scan stops at the first miss
            (docs/DESIGN.md §3.1, live-prefix dedup); one probe for a row that shares nothing.
        out_prefill: int64[W], written: active prefill + isl - min(isl, overlap*B) tokens; -1 if ineligible.
        out_cost: float64[W], written: scale*max(0, (prefill+isl)/B - credit*overlap) + out_blocks;
            +inf if ineligible.
    Source: docs/DESIGN.md §4.12 Selection cost (terms: docs/ROUTING.md).
    """
    n_rows = w_active_blocks.shape[0]
    mask = ref_keys.shape[1] - 1
    limit = min(ref_keys.shape[1], MAX_PROBE)
    for w in range(n_rows):
        out_blocks[w] = 0  # live-prefix accumulator first
        if eligible[w] == 0:
            continue
        for k in range(hashes.shape[0]):  # chained hashes: stop at the first block not live here
            if _find(ref_keys[w], ref_counts[w], hashes[k], mask, limit) < 0:
                break
            out_blocks[w] += 1
    request_blocks = (isl_tokens + block_size - 1) // block_size
    for w in range(n_rows):
        if eligible[w] == 0:
            out_blocks[w] = -1
            out_prefill[w] = -1
            out_cost[w] = np.inf
            continue
        blocks = w_active_blocks[w] + request_blocks - out_blocks[w]
        ob = overlap_blocks[w]
        cached = min(isl_tokens, ob * block_size)
        out_blocks[w] = blocks
        out_prefill[w] = w_active_prefill[w] + isl_tokens - cached
        pre = (w_active_prefill[w] + isl_tokens) / block_size - overlap_credit * ob
        if pre < 0.0:
            pre = 0.0
        out_cost[w] = prefill_load_scale * pre + blocks


@njit(cache=True, nogil=True)
def apply_output_tokens(
    slot,
    n,
    s_state,
    s_worker_row,
    s_isl,
    s_prefill,
    s_output_tokens,
    s_extra_blocks,
    w_active_blocks,
    w_active_prefill,
    block_size,
):
    """Set one booked slot's output tokens to `n` (>= 0) and adjust its worker's aggregates.

    The count only moves forward: `n` <= the current count is ignored (a late or reordered progress
    report never books fewer tokens). Decode blocks = ceil((isl + n)/B) - ceil(isl/B); n > 0 clears
    the slot's outstanding prefill from `w_active_prefill` and moves the slot to state 3 (prefill_done).
    Returns:
        bool: True if anything changed.
    """
    old = s_output_tokens[slot]
    if n <= old:
        return False
    isl = s_isl[slot]
    row = s_worker_row[slot]
    delta = (isl + n + block_size - 1) // block_size - (isl + old + block_size - 1) // block_size
    w_active_blocks[row] += delta
    s_extra_blocks[slot] += delta
    s_output_tokens[slot] = n
    if n > 0:
        w_active_prefill[row] -= s_prefill[slot]
        s_prefill[slot] = 0
        if s_state[slot] < SLOT_PREFILL_DONE:
            s_state[slot] = SLOT_PREFILL_DONE
    return True


@njit(cache=True, nogil=True)
def fold_progress(
    progress,
    s_state,
    s_generation,
    s_worker_row,
    s_isl,
    s_prefill,
    s_output_tokens,
    s_extra_blocks,
    w_active_blocks,
    w_active_prefill,
    block_size,
):
    """Fold progress words (generation << 32 | output tokens) into slots and worker aggregates.

    Args:
        progress: uint64[S], progress words; a word whose generation != s_generation is ignored.
        s_*: slot table arrays (layout.py dtypes), length S; free slots (state 0) are skipped.
        w_active_blocks / w_active_prefill: int64[W], updated in place.
        block_size: tokens per block.
    Returns:
        int: number of slots whose output tokens changed (moved forward; lower words are ignored).
    """
    changed = 0
    for s in range(progress.shape[0]):
        if s_state[s] == SLOT_FREE:
            continue
        word = progress[s]
        if (word >> _S32) != s_generation[s]:
            continue
        n = np.int64(word & _LOW32)
        if apply_output_tokens(
            s,
            n,
            s_state,
            s_worker_row,
            s_isl,
            s_prefill,
            s_output_tokens,
            s_extra_blocks,
            w_active_blocks,
            w_active_prefill,
            block_size,
        ):
            changed += 1
    return changed


_FLAGS = np.uint64(STATE_FLAGS)  # state word flags: bit 0 dispatched, bit 1 prefill_done (see words.py)
_PREFILL_DONE_FLAG = np.uint64(STATE_PREFILL_DONE)


@njit(cache=True, nogil=True)
def fold_words(
    n_slots,
    progress,
    state,
    seen_state,
    s_state,
    s_generation,
    s_worker_row,
    s_isl,
    s_prefill,
    s_output_tokens,
    s_extra_blocks,
    w_active_blocks,
    w_active_prefill,
    block_size,
    out_dispatched,
    out_counts,
    out_rows,
):
    """Fold both words of each slot (state word, then progress word) into the slots and aggregates.

    The state word (generation << 32 | flags; bit 0 dispatched, bit 1 prefill_done, which implies
    dispatched) moves an admitted slot to dispatched (state 2) and, with prefill_done, takes the
    slot's outstanding prefill off its worker (state 3), exactly as `Update(dispatched)` /
    `Update(prefill_done)` frames do; the progress word is folded as in `fold_progress`. A word
    whose generation differs from the slot's is ignored; states never move backwards.

    Args:
        n_slots: fold slots [0, n_slots) (the daemon passes its high-water mark of used slots).
        progress / state: uint64[S], the routers' progress and state words.
        seen_state: uint64[S], the state word last folded per slot (daemon-private; updated here).
            A slot's `dispatched` is reported once per generation: when its flags first appear.
        s_*: slot table arrays (layout.py dtypes), length S; free slots (state 0) and slots whose
            worker row is out of range are skipped.
        w_active_blocks / w_active_prefill: int64[W], updated in place.
        block_size: tokens per block.
        out_dispatched: int64[S], written: slots whose dispatched flag appeared in this call, first
            `out_counts[1]` entries (the caller tells the admission policy).
        out_counts: int64[3], written: [slots whose load changed, slots newly dispatched, rows
            whose `w_active_blocks` or `w_active_prefill` changed].
        out_rows: int64[W], written: the rows whose aggregates changed, ascending, first
            `out_counts[2]` entries (the caller re-checks only their blocked lanes).
    Returns:
        int: slots whose load changed (prefill freed or output tokens moved).
    Source: docs/PROTOCOL.md, "Shared memory" (the state word) and the `Update` frame's kinds.
    """
    n_rows = w_active_blocks.shape[0]
    changed = 0
    k = 0
    out_rows[:] = 0  # per-row marks first, compacted into the ascending row list at the end
    for s in range(n_slots):
        st = s_state[s]
        if st == SLOT_FREE:
            continue
        row = s_worker_row[s]
        if row < 0 or row >= n_rows:
            continue
        gen = np.uint64(s_generation[s])
        sw = state[s]
        old = seen_state[s]
        if sw != old:
            seen_state[s] = sw
            if (sw >> _S32) == gen and (sw & _FLAGS) != 0:
                had = (old & _FLAGS) if (old >> _S32) == gen else np.uint64(0)
                if had == 0:
                    out_dispatched[k] = s
                    k += 1
                if st == SLOT_ADMITTED:
                    s_state[s] = SLOT_DISPATCHED
                    st = SLOT_DISPATCHED
                if (sw & _PREFILL_DONE_FLAG) != 0 and st < SLOT_PREFILL_DONE:
                    if s_prefill[s] != 0:
                        out_rows[row] = 1
                    w_active_prefill[row] -= s_prefill[s]
                    s_prefill[s] = 0
                    s_state[s] = SLOT_PREFILL_DONE
                    changed += 1
        pw = progress[s]
        if (pw >> _S32) == gen:
            blocks, prefill = w_active_blocks[row], w_active_prefill[row]
            if apply_output_tokens(
                s,
                np.int64(pw & _LOW32),
                s_state,
                s_worker_row,
                s_isl,
                s_prefill,
                s_output_tokens,
                s_extra_blocks,
                w_active_blocks,
                w_active_prefill,
                block_size,
            ):
                changed += 1
                if w_active_blocks[row] != blocks or w_active_prefill[row] != prefill:
                    out_rows[row] = 1
    n_changed_rows = 0
    for w in range(n_rows):  # blocks only grow and prefill only shrinks here: a marked row changed
        if out_rows[w] != 0:
            out_rows[n_changed_rows] = w
            n_changed_rows += 1
    out_counts[0] = changed
    out_counts[1] = k
    out_counts[2] = n_changed_rows
    return changed


@njit(cache=True, nogil=True)
def words_changed(n_slots, progress, state, seen_progress, seen_state):
    """Has any router word of slots [0, n_slots) changed since the daemon last saw it? The cheap
    test before `fold_words` (5 arguments instead of 17: the daemon folds on every wake, and most
    wakes find nothing new).

    A state word is compared with `seen_state` (which `fold_words` keeps); a progress word with
    `seen_progress`, which this kernel keeps: when it finds a change at slot s it copies
    progress[s:n_slots] (the words before s are equal) into `seen_progress` BEFORE the caller folds,
    so a store landing after the copy differs from it and is found by the next call (none is lost;
    a store folded early is folded again, a no-op).

    Args:
        n_slots: slots to test (the daemon's high-water mark of used slots).
        progress / state: uint64[S], the routers' words; seen_progress / seen_state: uint64[S],
            daemon-private.
    Returns:
        bool: True when some word differs (then call `fold_words`).
    """
    for s in range(n_slots):
        if state[s] != seen_state[s] or progress[s] != seen_progress[s]:
            for t in range(s, n_slots):
                seen_progress[t] = progress[t]
            return True
    return False


def warm_ledger_kernels() -> None:
    """Compile (or load from NUMBA_CACHE_DIR) this module's kernels for the argument types the ledger
    uses, on tiny arrays (called by `shm.warm.warm_kernels`)."""
    a = LedgerArrays.private(2, 2, 4, 16, 4)
    hashes = np.arange(3, dtype=np.uint64)
    ro_hashes = np.frombuffer(hashes.tobytes(), dtype="<u8")  # read-only, as decoded from frames
    for h in (hashes, ro_hashes):
        ref_add(a.ref_keys[0], a.ref_counts[0], h)
        ref_remove(a.ref_keys[0], a.ref_counts[0], h)
        elig = np.ones(2, np.uint8)
        ob = np.zeros(2, np.int32)
        ob_, op_, oc_ = np.zeros(2, np.int64), np.zeros(2, np.int64), np.zeros(2, np.float64)
        project_and_cost(
            a.w_active_blocks, a.w_active_prefill, elig, a.ref_keys, a.ref_counts, h, 5, 4, ob, 1.0, 1.0, ob_, op_, oc_
        )
    progress = np.zeros(2, np.uint64)
    fold_progress(progress, *a.load, 4)
    fold_words(
        2,
        progress,
        progress.copy(),
        progress.copy(),
        *a.load,
        4,
        np.zeros(2, np.int64),
        np.zeros(3, np.int64),
        np.zeros(2, np.int64),
    )
    words_changed(2, progress, progress.copy(), progress.copy(), progress.copy())
    apply_output_tokens(
        0,
        0,
        a.s_state,
        a.s_worker_row,
        a.s_isl,
        a.s_prefill,
        a.s_output_tokens,
        a.s_extra_blocks,
        a.w_active_blocks,
        a.w_active_prefill,
        4,
    )
