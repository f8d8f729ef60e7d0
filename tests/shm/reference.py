"""The shm kernels' rules, written once more in plain Python for reading; the property tests in
tests/shm/ hold the compiled kernels to this module (docs/DESIGN.md §3.1, §3.5, §4.12; docs/ROUTING.md).

Each function has the name and the signature of the kernel whose rule it states, so a test calls both
the same way and compares every output and every array written. It is written for clarity, not speed:
plain loops over Python ints and floats, one helper per idea, no numpy beyond indexing the arrays it
is given. Floating-point sums are written in the kernels' order (the kv cost total left to right, the
recent-work mean in numpy's pairwise order) so results agree bit for bit.

Sections: the per-worker refcount table; projection and cost; the progress and state words; the
approximate overlap index; the `kv` selector's terms; booking events; admission.
"""

from __future__ import annotations

import math

from kvsched.shm.admit_kernels import (
    BUSY,
    OUT_CACHED,
    OUT_EVICTED,
    OUT_GENERATION,
    OUT_OVERLAP,
    OUT_PICK0,
    OUT_ROW,
    OUT_SNAPSHOT,
    OUT_TIES,
    UNDECIDED,
    P,
)
from kvsched.shm.kernels import MAX_PROBE
from kvsched.shm.layout import SLOT_ADMITTED, SLOT_DISPATCHED, SLOT_FREE, SLOT_PREFILL_DONE
from kvsched.shm.mix import mix64
from kvsched.shm.overlap import WINDOW, overlap_insert
from kvsched.shm.select_kernels import PAIRWISE_BLOCK
from kvsched.shm.words import STATE_FLAGS, STATE_PREFILL_DONE

LOW32 = 0xFFFF_FFFF


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- the per-worker refcount table ---------------------------------------------------------------
# One row per worker: an open-addressing table (capacity a power of two) of hash -> refcount. A hash
# lives at the first slot, from mix64(hash) & mask onwards, that is empty or holds it; a lookup probes
# at most MAX_PROBE slots. A count of 0 marks an empty slot; deleting shifts later entries back so
# every lookup still finds its key before the first empty slot.


def _probe(keys_row, h: int):
    """The slots a lookup of `h` visits, in order."""
    mask = len(keys_row) - 1
    home = mix64(h) & mask
    for step in range(min(len(keys_row), MAX_PROBE)):
        yield (home + step) & mask


def _find(keys_row, counts_row, h: int) -> int:
    """The slot holding `h`, or -1."""
    for i in _probe(keys_row, h):
        if counts_row[i] == 0:
            return -1
        if int(keys_row[i]) == h:
            return i
    return -1


def _delete(keys_row, counts_row, hole: int) -> None:
    """Empty slot `hole`, then move back each later entry of the cluster that may live there."""
    mask = len(keys_row) - 1
    counts_row[hole] = 0
    j = hole
    for _ in range(mask):
        j = (j + 1) & mask
        if counts_row[j] == 0:
            return
        home = mix64(int(keys_row[j])) & mask
        if (j - home) & mask >= (j - hole) & mask:  # the hole lies between the entry's home and j
            keys_row[hole], counts_row[hole] = keys_row[j], counts_row[j]
            counts_row[j] = 0
            hole = j


def ref_add(keys_row, counts_row, hashes) -> int:
    """Take one reference on each hash. Returns how many became live (count 0 -> 1); a hash that
    finds no room within its probe window counts as live without being stored."""
    became = 0
    for h in map(int, hashes):
        for i in _probe(keys_row, h):
            if counts_row[i] == 0:
                keys_row[i], counts_row[i] = h, 1
                became += 1
                break
            if int(keys_row[i]) == h:
                counts_row[i] += 1
                break
        else:
            became += 1
    return became


def ref_remove(keys_row, counts_row, hashes) -> int:
    """Drop one reference on each hash. Returns how many died (count 1 -> 0, or not found)."""
    died = 0
    for h in map(int, hashes):
        i = _find(keys_row, counts_row, h)
        if i >= 0 and counts_row[i] > 1:
            counts_row[i] -= 1
            continue
        if i >= 0:
            _delete(keys_row, counts_row, i)
        died += 1
    return died


def ref_live_count(keys_row, counts_row, hashes) -> int:
    """Hashes that are live on the row."""
    return sum(1 for h in hashes if _find(keys_row, counts_row, int(h)) >= 0)


def ref_live_prefix(keys_row, counts_row, hashes) -> int:
    """Leading hashes that are live on the row (hashes are chained: the scan stops at the first miss)."""
    live = 0
    for h in hashes:
        if _find(keys_row, counts_row, int(h)) < 0:
            break
        live += 1
    return live


# ---- projection and cost -------------------------------------------------------------------------


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
) -> None:
    """Per row: the active blocks and prefill tokens if the request ran there, and their cost
    scale * max(0, (prefill + isl)/B - credit * overlap) + blocks; -1 / -1 / +inf on ineligible rows."""
    request_blocks = ceil_div(isl_tokens, block_size)
    for w in range(len(w_active_blocks)):
        if not eligible[w]:
            out_blocks[w], out_prefill[w], out_cost[w] = -1, -1, math.inf
            continue
        blocks = int(w_active_blocks[w]) + request_blocks - ref_live_prefix(ref_keys[w], ref_counts[w], hashes)
        overlap = int(overlap_blocks[w])
        prefill = int(w_active_prefill[w])
        out_blocks[w] = blocks
        out_prefill[w] = prefill + isl_tokens - min(isl_tokens, overlap * block_size)
        uncached = max(0.0, (prefill + isl_tokens) / block_size - overlap_credit * overlap)
        out_cost[w] = prefill_load_scale * uncached + blocks


# ---- the progress and state words ----------------------------------------------------------------
# A progress word is (generation << 32) | output tokens; a state word is (generation << 32) | flags
# (bit 0 dispatched, bit 1 prefill done). A word whose generation is not the slot's is stale and ignored.


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
) -> bool:
    """Raise the slot's output tokens to `n` (never lower them): its row gains the blocks the output
    fills, and the first output token ends the prefill. Returns whether anything changed."""
    old = int(s_output_tokens[slot])
    if n <= old:
        return False
    isl, row = int(s_isl[slot]), int(s_worker_row[slot])
    grown = ceil_div(isl + n, block_size) - ceil_div(isl + old, block_size)
    w_active_blocks[row] += grown
    s_extra_blocks[slot] += grown
    s_output_tokens[slot] = n
    if n > 0:
        w_active_prefill[row] -= s_prefill[slot]
        s_prefill[slot] = 0
        s_state[slot] = max(int(s_state[slot]), SLOT_PREFILL_DONE)
    return True


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
) -> int:
    """Apply every booked slot's current progress word. Returns the slots that changed."""
    changed = 0
    for s in range(len(progress)):
        word = int(progress[s])
        if s_state[s] == SLOT_FREE or word >> 32 != int(s_generation[s]):
            continue
        changed += apply_output_tokens(
            s,
            word & LOW32,
            s_state,
            s_worker_row,
            s_isl,
            s_prefill,
            s_output_tokens,
            s_extra_blocks,
            w_active_blocks,
            w_active_prefill,
            block_size,
        )
    return changed


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
) -> int:
    """Apply the state and progress words of slots [0, n_slots) that are booked on a valid row.

    A new state word is remembered in `seen_state`; if current and flagged, the slot is dispatched
    (listed in `out_dispatched` the first time its generation shows a flag) and, with the prefill-done
    flag, its prefill ends. Then its progress word is applied. out_counts = [slots changed, slots
    newly dispatched, rows whose active blocks or prefill moved]; out_rows lists those rows ascending.
    Returns the slots changed."""
    n_rows = len(w_active_blocks)
    before = [(int(w_active_blocks[w]), int(w_active_prefill[w])) for w in range(n_rows)]
    changed = dispatched = 0
    for s in range(n_slots):
        row, gen = int(s_worker_row[s]), int(s_generation[s])
        if s_state[s] == SLOT_FREE or not 0 <= row < n_rows:
            continue
        new, old = int(state[s]), int(seen_state[s])
        if new != old:
            seen_state[s] = new
            flags = new & STATE_FLAGS
            if new >> 32 == gen and flags:
                if not (old >> 32 == gen and old & STATE_FLAGS):
                    out_dispatched[dispatched] = s
                    dispatched += 1
                if s_state[s] == SLOT_ADMITTED:
                    s_state[s] = SLOT_DISPATCHED
                if flags & STATE_PREFILL_DONE and s_state[s] < SLOT_PREFILL_DONE:
                    w_active_prefill[row] -= s_prefill[s]
                    s_prefill[s] = 0
                    s_state[s] = SLOT_PREFILL_DONE
                    changed += 1
        word = int(progress[s])
        if word >> 32 == gen:
            changed += apply_output_tokens(
                s,
                word & LOW32,
                s_state,
                s_worker_row,
                s_isl,
                s_prefill,
                s_output_tokens,
                s_extra_blocks,
                w_active_blocks,
                w_active_prefill,
                block_size,
            )
    moved = [w for w in range(n_rows) if (int(w_active_blocks[w]), int(w_active_prefill[w])) != before[w]]
    out_rows[: len(moved)] = moved
    out_counts[0], out_counts[1], out_counts[2] = changed, dispatched, len(moved)
    return changed


def words_changed(n_slots, progress, state, seen_progress, seen_state) -> bool:
    """Whether a state or progress word of slots [0, n_slots) differs from the one seen; if so, the
    progress words from the first such slot on are marked seen."""
    for s in range(n_slots):
        if state[s] != seen_state[s] or progress[s] != seen_progress[s]:
            seen_progress[s:n_slots] = progress[s:n_slots]
            return True
    return False


# ---- the approximate overlap index ---------------------------------------------------------------


def overlap_depth(keys, used, perm, ttlm, ttl_exp, hashes, now_us, scratch, out) -> None:
    """out[row] = leading hashes the row holds: permanently, or through a TTL entry not yet expired.
    An entry is found within WINDOW slots of its home, mix64(hash) & mask (`scratch` is unused here)."""
    mask = len(keys) - 1

    def entry(h: int) -> int:
        home = mix64(h) & mask
        for step in range(min(len(keys), WINDOW)):
            i = (home + step) & mask
            if used[i] and int(keys[i]) == h:
                return i
        return -1

    def holds(e: int, row: int) -> bool:
        word, bit = divmod(row, 64)
        permanent = (int(perm[e, word]) >> bit) & 1
        by_ttl = int(ttl_exp[e]) > now_us and (int(ttlm[e, word]) >> bit) & 1
        return bool(permanent or by_ttl)

    entries = [entry(int(h)) for h in hashes]
    for row in range(len(out)):
        depth = 0
        for e in entries:
            if e < 0 or not holds(e, row):
                break
            depth += 1
        out[row] = depth


# ---- the kv selector's terms (docs/ROUTING.md) ---------------------------------------------------


def pairwise_sum(a, lo: int, n: int) -> float:
    """a[lo:lo+n].sum() in numpy's order: up to PAIRWISE_BLOCK values, 8 running sums combined as a tree,
    then the rest (one running sum below 8 values); above it, the two halves (split at a multiple of 8)."""
    if n > PAIRWISE_BLOCK:
        half = n // 2 - (n // 2) % 8
        return pairwise_sum(a, lo, half) + pairwise_sum(a, lo + half, n - half)
    if n < 8:
        total = 0.0
        for i in range(n):
            total += float(a[lo + i])
        return total
    acc = [float(a[lo + j]) for j in range(8)]
    whole = n - n % 8
    for i in range(8, whole, 8):
        for j in range(8):
            acc[j] += float(a[lo + i + j])
    total = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]))
    for i in range(whole, n):
        total += float(a[lo + i])
    return total


def _pick(total, pick) -> int:
    """The first row of least total and how many rows share it; -1 if a total is NaN."""
    if any(math.isnan(t) for t in total):
        pick[0], pick[1] = -1, 0
        return -1
    least = min(total)
    best = list(total).index(least)
    pick[0], pick[1] = best, sum(1 for t in total if t == least)
    return best


def kv_cost_terms(
    prefill_tokens,
    blocks,
    active_prefill,
    max_batched,
    eligible,
    overlap,
    recent,
    decay,
    active_requests,
    isl_tokens,
    params,
    extra,
    scratch,
    terms,
    total,
    pick,
) -> int:
    """The `kv` rule: per row the terms prefill, active blocks, lead, recent, interference (and home when
    `terms` has a sixth row), their total and its argmin (`_pick`). Ineligible rows: +inf, then 0s.
    `params` holds the selector's keys by name (`P`); `extra` row 0 the decayed home counts, row 1 the
    predicted TTFT (µs). `scratch` is the kernel's work space, unused here."""
    k = {name: float(params[i]) for name, i in P.items()}
    n = len(eligible)
    rows = [w for w in range(n) if eligible[w]]
    with_home = len(terms) > 5
    for w in range(n):
        terms[0, w] = math.inf
        for t in range(1, len(terms)):
            terms[t, w] = 0.0
    inv_bs, prefill_weight = k["inv_bs"], k["prefill_weight"]
    ttft = [float(extra[1, w]) for w in range(n)]
    # recent work per row, decayed to now (rows past the end of `recent` have none)
    recent_now = {w: float(recent[w]) * decay for w in rows if w < len(recent)}
    # the request's own uncached prefill on each row
    own = {w: max(int(prefill_tokens[w]) - int(active_prefill[w]), 0) for w in rows}

    for w in rows:
        if k["prefill_seconds_ref_us"] > 0.0:  # predicted seconds, as tokens at the reference rate
            terms[0, w] = ttft[w] / k["prefill_seconds_ref_us"] * (prefill_weight * inv_bs)
        else:
            terms[0, w] = float(prefill_tokens[w]) * (prefill_weight * inv_bs)
        if k["active_blocks_weight"] != 0.0:
            terms[1, w] = float(blocks[w]) * k["active_blocks_weight"]
        if w in recent_now and k["recent_weight"] != 0.0:
            terms[3, w] = recent_now[w] * (k["recent_weight"] * inv_bs)

    if rows and k["interference_weight"] != 0.0:
        # the request's own uncached prefill times the requests already running there ...
        slows = {w: float(own[w] * int(active_requests[w])) * (k["interference_weight"] * inv_bs) for w in rows}
        if k["interference_cap_prompts"] > 0.0:  # ... measured from the least, and capped
            cap = k["interference_cap_prompts"] * prefill_weight * float(isl_tokens) * inv_bs
            least = min(slows.values())
            slows = {w: min(v - least, cap) for w, v in slows.items()}
        for w, v in slows.items():
            terms[4, w] = v

    if rows and with_home:  # long prompts go where few conversations return
        h = {w: float(extra[0, w]) for w in rows}
        mean = pairwise_sum([h[w] for w in rows], 0, len(rows)) / len(rows)
        if mean > 0.0:
            least = min(h.values())
            scale = k["home_weight"] * prefill_weight / k["block_size"] / mean
            for w in rows:
                if own[w] >= k["home_min_prefill_tokens"]:
                    terms[5, w] = float(own[w]) * (h[w] - least) * scale

    if rows and k["lead_bonus"] > 0.0:
        depths = [int(overlap[w]) for w in rows]
        first = max(depths)
        top = rows[depths.index(first)]
        second = sorted(depths)[-2] if len(rows) > 1 else 0
        if first > 0 and first > second:  # one row leads on cached prefix: a bonus unless it is saturated
            others = [w for w in rows if w != top]
            saturated = float(active_prefill[top]) > k["lead_release_steps"] * float(max_batched[top])
            if not saturated and k["lead_release_requests_ratio"] > 0.0 and others:
                mean_requests = (float(sum(int(active_requests[w]) for w in rows)) - float(active_requests[top])) / len(
                    others
                )
                saturated = float(active_requests[top]) > k["lead_release_requests_ratio"] * max(mean_requests, 1.0)
            if not saturated and len(recent) and k["lead_release_recent_ratio"] > 0.0 and others:
                recent_rows = [recent_now.get(w, 0.0) for w in rows]
                mean_recent = (pairwise_sum(recent_rows, 0, len(rows)) - recent_now.get(top, 0.0)) / len(others)
                saturated = recent_now.get(top, 0.0) > k["lead_release_recent_ratio"] * mean_recent
            if not saturated:
                gap = float(first - max(0, second))
                bonus = k["lead_bonus"] * min(gap, k["lead_cap_blocks"])
                extra_us = k["lead_max_extra_ttft_s"] * 1e6
                if k["lead_max_extra_ttft_s"] > 0.0 and others and ttft[top] <= min(ttft[w] for w in others) + extra_us:
                    # predicted TTFT close enough to the best other row's: the lead row wins by `bonus`
                    def base(w: int) -> float:
                        b = float(terms[0, w]) + float(terms[1, w]) + float(terms[3, w]) + float(terms[4, w])
                        return b + float(terms[5, w]) if with_home else b

                    terms[2, top] = -(max(0.0, base(top) - min(base(w) for w in others)) + bonus)
                else:
                    if k["lead_max_wait_steps"] > 0.0:  # never more than the extra wait the lead may cost
                        steps_wait = k["lead_max_wait_steps"] * float(max_batched[top]) * inv_bs
                        wait = max(steps_wait, k["lead_max_wait_per_lead"] * gap)
                        bonus = min(bonus, prefill_weight * wait)
                    terms[2, top] = -bonus

    for w in range(n):
        t = float(terms[0, w]) + float(terms[1, w]) + float(terms[2, w]) + float(terms[3, w]) + float(terms[4, w])
        total[w] = t + float(terms[5, w]) if with_home else t
    return _pick([float(t) for t in total], pick)


def count_busy(active_prefill, max_batched, eligible, threshold, threshold_frac) -> int:
    """Eligible rows whose active prefill exceeds `threshold` tokens (if >= 0) or `threshold_frac` of
    the row's step budget (if >= 0)."""

    def busy(w: int) -> bool:
        prefill = int(active_prefill[w])
        over_tokens = threshold >= 0 and prefill > threshold
        over_frac = threshold_frac >= 0.0 and prefill > threshold_frac * float(max_batched[w])
        return over_tokens or over_frac

    return sum(1 for w in range(len(eligible)) if eligible[w] and busy(w))


def credit_rows(
    approx, device, offload, spec, event_fed, w_flags, stale_flag, offload_credit, has_offload, spec_raw, out
) -> None:
    """Credited overlap per row: the approximate depth on unfed or stale rows; else the deeper of the
    device and speculative depths, plus `offload_credit` per block only the offload tier holds."""
    for w in range(len(out)):
        spec_raw[w] = spec[w]
        if not event_fed[w] or int(w_flags[w]) & stale_flag:
            out[w] = approx[w]
            continue
        base = max(int(device[w]), int(spec[w]))
        credit = float(base)
        if has_offload and offload_credit > 0:
            credit += offload_credit * float(max(0, int(offload[w]) - base))
        out[w] = math.floor(credit)


# ---- booking events (a slot is named by (slot, generation); a stale name changes nothing) --------


def _booked_row(slot, generation, s_state, s_generation, s_worker_row, n_rows) -> int:
    """The row of the booking named (slot, generation), or -1 if that booking is not live."""
    if not (0 <= slot < len(s_state)) or s_state[slot] == SLOT_FREE or int(s_generation[slot]) != generation:
        return -1
    row = int(s_worker_row[slot])
    return row if 0 <= row < n_rows else -1


def slot_dispatched(slot, generation, s_state, s_generation) -> bool:
    """The booking reached its worker: ADMITTED -> DISPATCHED. Returns whether the booking is live."""
    if not (0 <= slot < len(s_state)) or s_state[slot] == SLOT_FREE or int(s_generation[slot]) != generation:
        return False
    if s_state[slot] == SLOT_ADMITTED:
        s_state[slot] = SLOT_DISPATCHED
    return True


def slot_prefill_done(slot, generation, s_state, s_generation, s_worker_row, s_prefill, w_active_prefill) -> int:
    """The booking's prefill ended: its row's prefill drops by the slot's. Returns the row, or -1."""
    row = _booked_row(slot, generation, s_state, s_generation, s_worker_row, len(w_active_prefill))
    if row < 0:
        return -1
    w_active_prefill[row] -= s_prefill[slot]
    s_prefill[slot] = 0
    s_state[slot] = SLOT_PREFILL_DONE
    return row


def slot_output_tokens(
    slot,
    generation,
    n,
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
    """The booking produced `n` output tokens (`apply_output_tokens`). Returns the row if it changed, or -1."""
    row = _booked_row(slot, generation, s_state, s_generation, s_worker_row, len(w_active_blocks))
    if row < 0:
        return -1
    grew = apply_output_tokens(
        slot,
        max(0, int(n)),
        s_state,
        s_worker_row,
        s_isl,
        s_prefill,
        s_output_tokens,
        s_extra_blocks,
        w_active_blocks,
        w_active_prefill,
        block_size,
    )
    return row if grew else -1


def release_booking(
    slot,
    generation,
    s_state,
    s_generation,
    s_worker_row,
    s_arena_off,
    s_arena_len,
    s_extra_blocks,
    s_prefill,
    arena,
    ref_keys,
    ref_counts,
    w_active_blocks,
    w_active_prefill,
    w_active_requests,
) -> int:
    """End the booking: drop its hashes' references, take its blocks (those that died and its output
    blocks), prefill and request off its row, free the slot. Returns the row, or -1 if not live."""
    row = _booked_row(slot, generation, s_state, s_generation, s_worker_row, len(w_active_blocks))
    if row < 0:
        return -1
    start = int(s_arena_off[slot])
    hashes = [int(h) for h in arena[start : start + int(s_arena_len[slot])]]
    died = ref_remove(ref_keys[row], ref_counts[row], hashes)
    w_active_blocks[row] -= died + int(s_extra_blocks[slot])
    w_active_prefill[row] -= s_prefill[slot]
    w_active_requests[row] -= 1
    s_state[slot] = SLOT_FREE
    s_prefill[slot] = s_extra_blocks[slot] = s_arena_len[slot] = 0
    return row


# ---- admission -----------------------------------------------------------------------------------


def reserve_slot(
    slot,
    row,
    isl_tokens,
    hashes,
    cached_tokens,
    expected_osl,
    class_idx,
    enqueue_us,
    now_us,
    owner_pid,
    block_size,
    stride,
    w_generation,
    w_active_blocks,
    w_active_prefill,
    w_active_requests,
    ref_keys,
    ref_counts,
    arena,
    s_state,
    s_generation,
    s_worker_row,
    s_worker_generation,
    s_isl,
    s_cached,
    s_prefill,
    s_expected_osl,
    s_output_tokens,
    s_extra_blocks,
    s_class,
    s_enqueue_us,
    s_admit_us,
    s_arena_off,
    s_arena_len,
    s_owner_pid,
) -> int:
    """Book the request in free `slot` on `row`. The slot keeps its first hashes (at most `stride`, at
    most one per prompt block) in its arena range and references them on the row; the row gains the
    blocks that became live plus the prompt blocks without a kept hash, isl - cached prefill tokens and
    one request. Returns the booking's generation (the slot's last + 1; 2**32 - 1 wraps to 1)."""
    generation = int(s_generation[slot]) % LOW32 + 1
    request_blocks = ceil_div(int(isl_tokens), int(block_size))
    kept = min(len(hashes), int(stride), request_blocks)
    start = int(slot) * int(stride)
    arena[start : start + kept] = hashes[:kept]
    became = ref_add(ref_keys[row], ref_counts[row], arena[start : start + kept])
    cached = max(0, min(int(cached_tokens), int(isl_tokens)))
    extra = request_blocks - kept

    s_worker_row[slot], s_worker_generation[slot] = row, w_generation[row]
    s_isl[slot], s_cached[slot], s_prefill[slot] = isl_tokens, cached, isl_tokens - cached
    s_expected_osl[slot], s_output_tokens[slot], s_extra_blocks[slot] = expected_osl, 0, extra
    s_class[slot], s_enqueue_us[slot], s_admit_us[slot], s_owner_pid[slot] = class_idx, enqueue_us, now_us, owner_pid
    s_arena_off[slot], s_arena_len[slot] = start, kept
    w_active_blocks[row] += became + extra
    w_active_prefill[row] += isl_tokens - cached
    w_active_requests[row] += 1
    s_generation[slot] = generation
    s_state[slot] = SLOT_ADMITTED
    return generation


def admit_kv(
    hashes,
    isl_tokens,
    now_us,
    slot,
    expected_osl,
    class_idx,
    enqueue_us,
    owner_pid,
    expiry_us,
    decay,
    decay_recent,
    depth_given,
    ring_i,
    params,
    block_size,
    stride,
    eligible,
    placeable,
    ov_keys,
    ov_used,
    ov_perm,
    ov_ttlm,
    ov_ttl_exp,
    ov_scratch,
    depth,
    w_generation,
    w_active_blocks,
    w_active_prefill,
    w_active_requests,
    w_max_batched,
    ref_keys,
    ref_counts,
    arena,
    s_state,
    s_generation,
    s_worker_row,
    s_worker_generation,
    s_isl,
    s_cached,
    s_prefill,
    s_expected_osl,
    s_output_tokens,
    s_extra_blocks,
    s_class,
    s_enqueue_us,
    s_admit_us,
    s_arena_off,
    s_arena_len,
    s_owner_pid,
    recent,
    scratch,
    ring_elig,
    ring_depth,
    ring_blocks,
    ring_prefill,
    ring_terms,
    out,
) -> int:
    """One immediate admission with the kv selector, in order:

    1. the class is busy (enough eligible rows over its busy threshold): BUSY, nothing written;
    2. overlap depth per row (unless given), the cost snapshot (uncached tokens on the deepest
       placeable row), projection and cost, the kv terms and their argmin (explain ring row `ring_i`);
    3. no unique finite minimum on an eligible row: UNDECIDED, nothing booked;
    4. else book the slot on that row, record the hashes in the approximate index (the
       `overlap_insert` kernel: the index's own tests state its rule), add the uncached prompt to the
       row's recent work, and return the row."""
    n_eligible = sum(1 for e in eligible if e)
    threshold, threshold_frac = float(params[P["busy_threshold"]]), float(params[P["busy_threshold_frac"]])
    if (threshold >= 0.0 or threshold_frac >= 0.0) and n_eligible > 0:
        busy = count_busy(
            w_active_prefill, w_max_batched, eligible, int(threshold) if threshold >= 0.0 else -1, threshold_frac
        )
        if busy >= float(params[P["busy_worker_ratio"]]) * n_eligible - 1e-9:
            return BUSY

    if not depth_given:
        overlap_depth(ov_keys, ov_used, ov_perm, ov_ttlm, ov_ttl_exp, hashes, now_us, ov_scratch, depth)
    placeable_rows = [w for w in range(len(placeable)) if placeable[w]]
    deepest = 0
    if len(hashes) and placeable_rows:
        deepest = min(max(int(depth[w]) for w in placeable_rows) * int(block_size), int(isl_tokens))
    out[OUT_SNAPSHOT] = max(1, int(isl_tokens) - deepest)

    blocks, prefill, terms, total = ring_blocks[ring_i], ring_prefill[ring_i], ring_terms[ring_i], scratch[2]
    project_and_cost(
        w_active_blocks,
        w_active_prefill,
        eligible,
        ref_keys,
        ref_counts,
        hashes,
        isl_tokens,
        block_size,
        depth,
        params[P["prefill_load_scale"]],
        params[P["overlap_credit"]],
        blocks,
        prefill,
        scratch[3],
    )
    best = kv_cost_terms(
        prefill,
        blocks,
        w_active_prefill,
        w_max_batched,
        eligible,
        depth,
        recent,
        decay,
        w_active_requests,
        isl_tokens,
        params,
        scratch,
        scratch,
        terms,
        total,
        out[OUT_PICK0 : OUT_TIES + 1],
    )
    ring_elig[ring_i] = eligible
    ring_depth[ring_i] = depth
    if best < 0 or out[OUT_TIES] != 1 or not eligible[best] or not math.isfinite(total[best]):
        return UNDECIDED

    row = int(best)
    overlap = int(depth[row])
    cached = min(int(isl_tokens), overlap * int(block_size))
    generation = reserve_slot(
        slot,
        row,
        isl_tokens,
        hashes,
        cached,
        expected_osl,
        class_idx,
        enqueue_us,
        now_us,
        owner_pid,
        block_size,
        stride,
        w_generation,
        w_active_blocks,
        w_active_prefill,
        w_active_requests,
        ref_keys,
        ref_counts,
        arena,
        s_state,
        s_generation,
        s_worker_row,
        s_worker_generation,
        s_isl,
        s_cached,
        s_prefill,
        s_expected_osl,
        s_output_tokens,
        s_extra_blocks,
        s_class,
        s_enqueue_us,
        s_admit_us,
        s_arena_off,
        s_arena_len,
        s_owner_pid,
    )
    evicted = 0
    if len(hashes):
        evicted = overlap_insert(ov_keys, ov_used, ov_perm, ov_ttlm, ov_ttl_exp, hashes, row, now_us, expiry_us)
    if params[P["recent_weight"]] > 0.0:
        if decay_recent:
            recent *= decay
        recent[row] += max(0, int(isl_tokens) - cached)
    out[OUT_ROW], out[OUT_GENERATION], out[OUT_EVICTED] = row, generation, evicted
    out[OUT_OVERLAP], out[OUT_CACHED] = overlap, cached
    return row


def credited_depth(
    hashes,
    now_us,
    has_offload,
    offload_credit,
    stale_flag,
    a_keys,
    a_used,
    a_perm,
    a_ttlm,
    a_ttl_exp,
    d_keys,
    d_used,
    d_perm,
    d_ttlm,
    d_ttl_exp,
    o_keys,
    o_used,
    o_perm,
    o_ttlm,
    o_ttl_exp,
    s_keys,
    s_used,
    s_perm,
    s_ttlm,
    s_ttl_exp,
    scratch,
    approx_depth,
    dev_depth,
    off_depth,
    spec_depth,
    event_fed,
    w_flags,
    spec_raw,
    out,
) -> None:
    """The depth of `hashes` in the approximate, device, offload (if any) and speculative indexes,
    then the credited overlap per row (`credit_rows`)."""
    overlap_depth(a_keys, a_used, a_perm, a_ttlm, a_ttl_exp, hashes, now_us, scratch, approx_depth)
    overlap_depth(d_keys, d_used, d_perm, d_ttlm, d_ttl_exp, hashes, now_us, scratch, dev_depth)
    if has_offload:
        overlap_depth(o_keys, o_used, o_perm, o_ttlm, o_ttl_exp, hashes, now_us, scratch, off_depth)
    overlap_depth(s_keys, s_used, s_perm, s_ttlm, s_ttl_exp, hashes, now_us, scratch, spec_depth)
    credit_rows(
        approx_depth,
        dev_depth,
        off_depth,
        spec_depth,
        event_fed,
        w_flags,
        stale_flag,
        offload_credit,
        bool(has_offload),
        spec_raw,
        out,
    )
