"""Numpy and pure-Python twins of the kernels in `kernels.py` and `overlap.py` (docs/DESIGN.md §3.5).

Naming: `numpy_twin.<kernel>` and `python_twin.<kernel>` have the kernel's name and signature and
write the same outputs (property tests in tests/shm/test_kernels.py; ratios in bench/bench_kernels.py).
Covered: mix64, ref_add, ref_remove, ref_live_count, ref_live_prefix, project_and_cost, apply_output_tokens,
fold_progress, fold_words, words_changed, overlap_depth, (from reference_select.py) pairwise_sum, kv_cost_terms,
count_busy, credit_rows, and (from reference_booking.py) slot_dispatched, slot_prefill_done,
slot_output_tokens, release_booking, and (from reference_admit.py) reserve_slot, admit_kv,
credited_depth. The numpy twins vectorise over workers/hashes/slots where the algorithm
allows; inserts and deletes in the open-addressing table are sequential by nature, so their numpy
twins only vectorise each probe window.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from . import reference_admit as _admit
from . import reference_booking as _booking
from . import reference_select as _select
from .kernels import MAX_PROBE
from .layout import SLOT_ADMITTED, SLOT_DISPATCHED, SLOT_FREE, SLOT_PREFILL_DONE
from .mix import mix64 as _py_mix64
from .mix import mix64_array
from .overlap import WINDOW
from .words import STATE_FLAGS, STATE_PREFILL_DONE

_U = np.uint64


# --------------------------------------------------------------------------------------------
# pure Python
# --------------------------------------------------------------------------------------------


def _py_find(keys_row, counts_row, h: int, mask: int, limit: int) -> int:
    i = _py_mix64(h) & mask
    for _ in range(limit):
        if int(counts_row[i]) == 0:
            return -1
        if int(keys_row[i]) == h:
            return i
        i = (i + 1) & mask
    return -1


def _py_delete(keys_row, counts_row, i: int, mask: int) -> None:
    counts_row[i] = 0
    j = i
    for _ in range(mask):
        j = (j + 1) & mask
        if int(counts_row[j]) == 0:
            return
        k = _py_mix64(int(keys_row[j])) & mask
        if ((j - k) & mask) >= ((j - i) & mask):
            keys_row[i] = keys_row[j]
            counts_row[i] = counts_row[j]
            counts_row[j] = 0
            i = j


def _py_ref_add(keys_row, counts_row, hashes) -> int:
    mask = keys_row.shape[0] - 1
    limit = min(keys_row.shape[0], MAX_PROBE)
    became = 0
    for h in (int(x) for x in hashes):
        i = _py_mix64(h) & mask
        for _ in range(limit):
            c = int(counts_row[i])
            if c == 0:
                keys_row[i] = h
                counts_row[i] = 1
                became += 1
                break
            if int(keys_row[i]) == h:
                counts_row[i] = c + 1
                break
            i = (i + 1) & mask
        else:
            became += 1
    return became


def _py_ref_remove(keys_row, counts_row, hashes) -> int:
    mask = keys_row.shape[0] - 1
    limit = min(keys_row.shape[0], MAX_PROBE)
    died = 0
    for h in (int(x) for x in hashes):
        i = _py_find(keys_row, counts_row, h, mask, limit)
        if i < 0:
            died += 1
        elif int(counts_row[i]) > 1:
            counts_row[i] -= 1
        else:
            _py_delete(keys_row, counts_row, i, mask)
            died += 1
    return died


def _py_ref_live_count(keys_row, counts_row, hashes) -> int:
    mask = keys_row.shape[0] - 1
    limit = min(keys_row.shape[0], MAX_PROBE)
    return sum(1 for h in hashes if _py_find(keys_row, counts_row, int(h), mask, limit) >= 0)


def _py_ref_live_prefix(keys_row, counts_row, hashes) -> int:
    mask = keys_row.shape[0] - 1
    limit = min(keys_row.shape[0], MAX_PROBE)
    live = 0
    for h in hashes:
        if _py_find(keys_row, counts_row, int(h), mask, limit) < 0:
            break
        live += 1
    return live


def _py_project_and_cost(
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
) -> None:
    request_blocks = (isl_tokens + block_size - 1) // block_size
    for w in range(w_active_blocks.shape[0]):
        if not eligible[w]:
            out_blocks[w] = -1
            out_prefill[w] = -1
            out_cost[w] = float("inf")
            continue
        live = _py_ref_live_prefix(ref_keys[w], ref_counts[w], hashes)
        blocks = int(w_active_blocks[w]) + request_blocks - live
        ob = int(overlap_blocks[w])
        prefill = int(w_active_prefill[w])
        out_blocks[w] = blocks
        out_prefill[w] = prefill + isl_tokens - min(isl_tokens, ob * block_size)
        pre = max(0.0, (prefill + isl_tokens) / block_size - overlap_credit * ob)
        out_cost[w] = prefill_load_scale * pre + blocks


def _py_apply_output_tokens(
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
) -> bool:
    old = int(s_output_tokens[slot])
    if n <= old:
        return False
    isl = int(s_isl[slot])
    row = int(s_worker_row[slot])
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


def _py_fold_progress(
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
) -> int:
    changed = 0
    for s in range(progress.shape[0]):
        if s_state[s] == SLOT_FREE:
            continue
        word = int(progress[s])
        if word >> 32 != int(s_generation[s]):
            continue
        if _py_apply_output_tokens(
            s,
            word & 0xFFFFFFFF,
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


def _py_fold_words(
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
) -> int:
    n_rows = w_active_blocks.shape[0]
    before = [
        (int(w_active_blocks[w]), int(w_active_prefill[w])) for w in range(n_rows)
    ]  # rows changed: compared after
    changed = k = 0
    for s in range(n_slots):
        st = int(s_state[s])
        row = int(s_worker_row[s])
        if st == SLOT_FREE or not 0 <= row < n_rows:
            continue
        gen = int(s_generation[s])
        sw, old = int(state[s]), int(seen_state[s])
        if sw != old:
            seen_state[s] = sw
            flags = sw & STATE_FLAGS
            if sw >> 32 == gen and flags:
                if not (old >> 32 == gen and old & STATE_FLAGS):
                    out_dispatched[k] = s
                    k += 1
                if st == SLOT_ADMITTED:
                    st = s_state[s] = SLOT_DISPATCHED
                if flags & STATE_PREFILL_DONE and st < SLOT_PREFILL_DONE:
                    w_active_prefill[row] -= s_prefill[s]
                    s_prefill[s] = 0
                    s_state[s] = SLOT_PREFILL_DONE
                    changed += 1
        pw = int(progress[s])
        if pw >> 32 == gen and _py_apply_output_tokens(
            s,
            pw & 0xFFFFFFFF,
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
    moved = [w for w in range(n_rows) if (int(w_active_blocks[w]), int(w_active_prefill[w])) != before[w]]
    out_rows[: len(moved)] = moved
    out_counts[0], out_counts[1], out_counts[2] = changed, k, len(moved)
    return changed


def _py_words_changed(n_slots, progress, state, seen_progress, seen_state) -> bool:
    for s in range(n_slots):
        if int(state[s]) != int(seen_state[s]) or int(progress[s]) != int(seen_progress[s]):
            seen_progress[s:n_slots] = progress[s:n_slots]
            return True
    return False


def _py_overlap_depth(keys, used, perm, ttlm, ttl_exp, hashes, now_us, scratch, out) -> None:
    mask = keys.shape[0] - 1
    limit = min(keys.shape[0], WINDOW)
    entries = []
    for h in (int(x) for x in hashes):
        i = _py_mix64(h) & mask
        found = -1
        for _ in range(limit):
            if used[i] and int(keys[i]) == h:
                found = i
                break
            i = (i + 1) & mask
        entries.append(found)
    for r in range(out.shape[0]):
        wd, bit = divmod(r, 64)
        d = 0
        for e in entries:
            if e < 0:
                break
            held = (int(perm[e, wd]) >> bit) & 1 or (int(ttl_exp[e]) > now_us and (int(ttlm[e, wd]) >> bit) & 1)
            if not held:
                break
            d += 1
        out[r] = d


# --------------------------------------------------------------------------------------------
# numpy
# --------------------------------------------------------------------------------------------


def _np_mix64(keys: np.ndarray) -> np.ndarray:
    return mix64_array(np.asarray(keys, dtype=np.uint64).reshape(-1))


def _np_window(keys_row, counts_row, h: int, mask: int, limit: int):
    pos = (int(_np_mix64(np.array([h], np.uint64))[0] & _U(mask)) + np.arange(limit)) & mask
    return pos, counts_row[pos], keys_row[pos]


def _np_ref_add(keys_row, counts_row, hashes) -> int:
    mask = keys_row.shape[0] - 1
    limit = min(keys_row.shape[0], MAX_PROBE)
    became = 0
    for h in np.asarray(hashes, np.uint64):
        pos, c, k = _np_window(keys_row, counts_row, int(h), mask, limit)
        stop = np.flatnonzero((c == 0) | (k == h))
        if stop.size == 0:
            became += 1
            continue
        i = pos[stop[0]]
        if c[stop[0]] == 0:
            keys_row[i] = h
            counts_row[i] = 1
            became += 1
        else:
            counts_row[i] += 1
    return became


def _np_ref_remove(keys_row, counts_row, hashes) -> int:
    mask = keys_row.shape[0] - 1
    limit = min(keys_row.shape[0], MAX_PROBE)
    died = 0
    for h in np.asarray(hashes, np.uint64):
        pos, c, k = _np_window(keys_row, counts_row, int(h), mask, limit)
        stop = np.flatnonzero((c == 0) | (k == h))
        if stop.size == 0 or c[stop[0]] == 0:
            died += 1
        elif c[stop[0]] > 1:
            counts_row[pos[stop[0]]] -= 1
        else:
            _py_delete(keys_row, counts_row, int(pos[stop[0]]), mask)
            died += 1
    return died


def _np_live_matrix(ref_keys, ref_counts, rows, hashes, prefix: bool = False) -> np.ndarray:
    """int64[len(rows)]: hashes live on each of `rows` (vectorised probing, all rows x hashes);
    with `prefix`, only the leading run of live hashes counts."""
    found = _np_found_matrix(ref_keys, ref_counts, rows, hashes)
    if prefix:
        return np.cumprod(found, axis=1).sum(axis=1).astype(np.int64)
    return found.sum(axis=1).astype(np.int64)


def _np_found_matrix(ref_keys, ref_counts, rows, hashes) -> np.ndarray:
    """bool[len(rows), n]: whether each hash is live on each row."""
    mask = ref_keys.shape[1] - 1
    limit = min(ref_keys.shape[1], MAX_PROBE)
    h = np.asarray(hashes, np.uint64)
    live = np.zeros((len(rows), h.size), bool)
    if h.size == 0 or len(rows) == 0:
        return live
    homes = (_np_mix64(h) & _U(mask)).astype(np.int64)
    pending = np.ones((len(rows), h.size), bool)
    r = rows[:, None]
    for p in range(limit):
        pos = (homes + p) & mask
        c = ref_counts[r, pos[None, :]]
        hit = pending & (c != 0) & (ref_keys[r, pos[None, :]] == h[None, :])
        live |= hit
        pending &= (c != 0) & ~hit
        if not pending.any():
            break
    return live


def _np_ref_live_count(keys_row, counts_row, hashes) -> int:
    return int(_np_live_matrix(keys_row[None, :], counts_row[None, :], np.zeros(1, np.int64), hashes)[0])


def _np_ref_live_prefix(keys_row, counts_row, hashes) -> int:
    return int(_np_live_matrix(keys_row[None, :], counts_row[None, :], np.zeros(1, np.int64), hashes, True)[0])


def _np_project_and_cost(
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
) -> None:
    rows = np.flatnonzero(eligible)
    live = _np_live_matrix(ref_keys, ref_counts, rows, hashes, prefix=True)
    request_blocks = (isl_tokens + block_size - 1) // block_size
    out_blocks[:] = -1
    out_prefill[:] = -1
    out_cost[:] = np.inf
    blocks = w_active_blocks[rows] + request_blocks - live
    ob = overlap_blocks[rows].astype(np.int64)
    prefill = w_active_prefill[rows]
    out_blocks[rows] = blocks
    out_prefill[rows] = prefill + isl_tokens - np.minimum(isl_tokens, ob * block_size)
    pre = np.maximum(0.0, (prefill + isl_tokens) / block_size - overlap_credit * ob)
    out_cost[rows] = prefill_load_scale * pre + blocks


def _np_fold_progress(
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
) -> int:
    gen = progress >> _U(32)
    n = (progress & _U(0xFFFFFFFF)).astype(np.int64)
    idx = np.flatnonzero((s_state != SLOT_FREE) & (gen == s_generation) & (n > s_output_tokens))
    if idx.size == 0:
        return 0
    isl, old, new, rows = s_isl[idx], s_output_tokens[idx], n[idx], s_worker_row[idx]
    delta = (isl + new + block_size - 1) // block_size - (isl + old + block_size - 1) // block_size
    np.add.at(w_active_blocks, rows, delta)
    s_extra_blocks[idx] += delta
    s_output_tokens[idx] = new
    first = idx[new > 0]
    np.subtract.at(w_active_prefill, s_worker_row[first], s_prefill[first])
    s_prefill[first] = 0
    s_state[first] = np.maximum(s_state[first], SLOT_PREFILL_DONE)
    return int(idx.size)


def _np_fold_words(
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
) -> int:
    n = int(n_slots)
    blocks_before, prefill_before = w_active_blocks.copy(), w_active_prefill.copy()
    st, rows, gen = s_state[:n], s_worker_row[:n], s_generation[:n].astype(np.uint64)
    ok = (st != SLOT_FREE) & (rows >= 0) & (rows < w_active_blocks.shape[0])
    sw, old = state[:n].copy(), seen_state[:n].copy()
    moved = ok & (sw != old)
    seen_state[:n] = np.where(moved, sw, old)
    flags = sw & _U(STATE_FLAGS)
    live = moved & ((sw >> _U(32)) == gen) & (flags != 0)
    had = ((old >> _U(32)) == gen) & ((old & _U(STATE_FLAGS)) != 0)
    newly = np.flatnonzero(live & ~had)
    out_dispatched[: newly.size] = newly
    st[live & (st == SLOT_ADMITTED)] = SLOT_DISPATCHED
    done = np.flatnonzero(live & ((flags & _U(STATE_PREFILL_DONE)) != 0) & (st < SLOT_PREFILL_DONE))
    np.subtract.at(w_active_prefill, rows[done], s_prefill[done])
    s_prefill[done] = 0
    st[done] = SLOT_PREFILL_DONE
    # the progress words, as `fold_progress` folds them, restricted to the folded (valid) slots
    pw = progress[:n]
    tokens = (pw & _U(0xFFFFFFFF)).astype(np.int64)
    idx = np.flatnonzero(ok & ((pw >> _U(32)) == gen) & (tokens > s_output_tokens[:n]))  # tokens only move forward
    if idx.size:
        isl, old_n, new_n, r = s_isl[idx], s_output_tokens[idx], tokens[idx], rows[idx]
        delta = (isl + new_n + block_size - 1) // block_size - (isl + old_n + block_size - 1) // block_size
        np.add.at(w_active_blocks, r, delta)
        s_extra_blocks[idx] += delta
        s_output_tokens[idx] = new_n
        first = idx[new_n > 0]
        np.subtract.at(w_active_prefill, s_worker_row[first], s_prefill[first])
        s_prefill[first] = 0
        st[first] = np.maximum(st[first], SLOT_PREFILL_DONE)
    changed = int(done.size + idx.size)
    moved = np.flatnonzero((w_active_blocks != blocks_before) | (w_active_prefill != prefill_before))
    out_rows[: moved.size] = moved
    out_counts[0], out_counts[1], out_counts[2] = changed, newly.size, moved.size
    return changed


def _np_words_changed(n_slots, progress, state, seen_progress, seen_state) -> bool:
    if np.array_equal(state[:n_slots], seen_state[:n_slots]) and np.array_equal(
        progress[:n_slots], seen_progress[:n_slots]
    ):
        return False
    differs = (state[:n_slots] != seen_state[:n_slots]) | (progress[:n_slots] != seen_progress[:n_slots])
    s = int(np.argmax(differs))
    seen_progress[s:n_slots] = progress[s:n_slots]
    return True


def _np_overlap_depth(keys, used, perm, ttlm, ttl_exp, hashes, now_us, scratch, out) -> None:
    h = np.asarray(hashes, np.uint64)
    if h.size == 0:
        out[:] = 0
        return
    mask = keys.shape[0] - 1
    limit = min(keys.shape[0], WINDOW)
    win = ((_np_mix64(h) & _U(mask)).astype(np.int64)[:, None] + np.arange(limit)) & mask
    match = (used[win] != 0) & (keys[win] == h[:, None])
    e = np.where(match.any(axis=1), win[np.arange(h.size), match.argmax(axis=1)], -1)
    present = np.zeros((h.size, perm.shape[1]), np.uint64)
    ok = e >= 0
    ent = e[ok]
    present[ok] = perm[ent] | np.where((ttl_exp[ent] > now_us)[:, None], ttlm[ent], _U(0))
    bits = np.unpackbits(present.view(np.uint8), axis=1, bitorder="little")[:, : out.shape[0]]
    out[:] = np.cumprod(bits, axis=0, dtype=np.int64).sum(axis=0)


_NAMES = (
    "mix64",
    "ref_add",
    "ref_remove",
    "ref_live_count",
    "ref_live_prefix",
    "project_and_cost",
    "apply_output_tokens",
    "fold_progress",
    "fold_words",
    "words_changed",
    "overlap_depth",
)

python_twin = SimpleNamespace(**{name: globals()[f"_py_{name}"] for name in _NAMES})
numpy_twin = SimpleNamespace(**{name: globals().get(f"_np_{name}", globals()[f"_py_{name}"]) for name in _NAMES})
for _mod in (_select, _booking, _admit):  # the selection, booking and admission kernels' twins
    for _name in _mod.NAMES:
        setattr(python_twin, _name, getattr(_mod, f"_py_{_name}"))
        setattr(numpy_twin, _name, getattr(_mod, f"_np_{_name}"))
