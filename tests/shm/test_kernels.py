"""Numba kernels == the plain-Python reference (tests/shm/reference.py) on hypothesis-generated states
(docs/DESIGN.md §3.5)."""

from __future__ import annotations

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvsched.shm import kernels
from kvsched.shm.booking_packed import fold_words_packed, pack_fold_arrays
from kvsched.shm.mix import mix64, mix64_array
from kvsched.shm.overlap import OverlapIndex, overlap_depth
from kvsched.shm.warm import warm_kernels
from tests.shm import reference

IMPLS = {"numba": kernels, "reference": reference}
FAST = settings(max_examples=60, deadline=None)

hash_lists = st.lists(st.integers(0, 40), min_size=0, max_size=12, unique=True)


def _table(cap):
    return np.zeros(cap, np.uint64), np.zeros(cap, np.int32)


def test_mix64_kernel_agrees_with_the_mixer_on_edge_keys():
    keys = np.array([0, 1, 2, 2**63, 2**64 - 1, 0xDEADBEEF], np.uint64)
    want = [int(kernels.mix64(k)) for k in keys]
    assert [mix64(int(k)) for k in keys] == want
    assert mix64_array(keys).tolist() == want


@FAST
@given(cap_log=st.integers(1, 6), ops=st.lists(st.tuples(st.booleans(), hash_lists), max_size=25), query=hash_lists)
@example(cap_log=1, ops=[(False, [1, 2]), (True, [0]), (False, []), (True, [0])], query=[])  # overflow, then room
def test_ref_ops_agree_and_balance_when_random_bookings(cap_log, ops, query):
    cap = 1 << cap_log
    tables = {name: _table(cap) for name in IMPLS}
    booked: list[np.ndarray] = []
    live_total = 0
    overflowed = False
    for add, hs in ops:
        if add or not booked:
            h = np.array(hs, np.uint64)
            res = {name: IMPLS[name].ref_add(*tables[name], h) for name in IMPLS}
            booked.append(h)
            live_total += res["numba"]
            stored_keys = set(tables["numba"][0][tables["numba"][1] > 0].tolist())
            overflowed |= not set(h.tolist()) <= stored_keys  # a hash the full table could not hold
        else:
            h = booked.pop(len(hs) % len(booked))
            res = {name: IMPLS[name].ref_remove(*tables[name], h) for name in IMPLS}
            live_total -= res["numba"]
        assert len(set(res.values())) == 1, res
        for name in IMPLS:
            assert np.array_equal(tables[name][0][tables[name][1] > 0], tables["numba"][0][tables["numba"][1] > 0])
            assert np.array_equal(tables[name][1], tables["numba"][1])
        assert (tables["numba"][1] >= 0).all()
        q = np.array(query, np.uint64)
        counts = {name: reference.ref_live_count(*tables[name], q) for name in IMPLS}
        assert len(set(counts.values())) == 1, counts
    # live_total equals distinct booked hashes whenever the table never overflowed (an add that
    # found the table full counts its hash live without storing it; the count is approximate from then on)
    distinct = len(set(int(x) for h in booked for x in h))
    assert live_total >= distinct
    if not overflowed:
        assert live_total == distinct
    for h in booked:
        kernels.ref_remove(*tables["numba"], h)
    assert not tables["numba"][1].any()


@FAST
@given(
    n_rows=st.integers(1, 6),
    cap_log=st.integers(2, 5),
    bookings=st.lists(st.tuples(st.integers(0, 5), hash_lists), max_size=12),
    hashes=hash_lists,
    extra_tokens=st.integers(1, 40),
    seed=st.integers(0, 2**32 - 1),
    scale=st.sampled_from([0.0, 0.5, 1.0, 3.0]),
    credit=st.sampled_from([0.0, 1.0, 2.5]),
)
def test_project_and_cost_agree_when_random_state(n_rows, cap_log, bookings, hashes, extra_tokens, seed, scale, credit):
    rng = np.random.default_rng(seed)
    cap, bs = 1 << cap_log, 4
    keys = np.zeros((n_rows, cap), np.uint64)
    counts = np.zeros((n_rows, cap), np.int32)
    for row, hs in bookings:
        kernels.ref_add(keys[row % n_rows], counts[row % n_rows], np.array(hs, np.uint64))
    active_blocks = rng.integers(0, 1000, n_rows).astype(np.int64)
    active_prefill = rng.integers(0, 5000, n_rows).astype(np.int64)
    eligible = rng.integers(0, 2, n_rows).astype(np.uint8)
    overlap = rng.integers(0, len(hashes) + 1, n_rows).astype(np.int32)
    h = np.array(hashes, np.uint64)
    isl = len(hashes) * bs + extra_tokens
    outs = {}
    for name, impl in IMPLS.items():
        ob, op, oc = np.zeros(n_rows, np.int64), np.zeros(n_rows, np.int64), np.zeros(n_rows, np.float64)
        impl.project_and_cost(
            active_blocks, active_prefill, eligible, keys, counts, h, isl, bs, overlap, scale, credit, ob, op, oc
        )
        outs[name] = (ob, op, oc)
    assert np.array_equal(outs["reference"][0], outs["numba"][0])
    assert np.array_equal(outs["reference"][1], outs["numba"][1])
    np.testing.assert_allclose(outs["reference"][2], outs["numba"][2], rtol=1e-12)
    ob, op, oc = outs["numba"]
    for w in range(n_rows):
        if not eligible[w]:
            assert ob[w] == -1 and op[w] == -1 and oc[w] == np.inf
        else:
            live = reference.ref_live_prefix(keys[w], counts[w], h)
            leading = 0
            for x in h:  # independent check: leading hashes that ref_live_count sees one by one
                if reference.ref_live_count(keys[w], counts[w], np.array([x], np.uint64)) == 0:
                    break
                leading += 1
            assert live == leading
            assert ob[w] == active_blocks[w] + -(-isl // bs) - live


@FAST
@given(
    n_slots=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
)
def test_fold_progress_agrees_when_random_words(n_slots, seed):
    rng = np.random.default_rng(seed)
    n_rows, bs = 3, 4
    state = rng.integers(0, 4, n_slots).astype(np.uint8)
    gen = rng.integers(1, 4, n_slots).astype(np.uint32)
    rows = rng.integers(0, n_rows, n_slots).astype(np.int32)
    isl = rng.integers(1, 50, n_slots).astype(np.int64)
    prefill = (isl * rng.integers(0, 2, n_slots)).astype(np.int64)
    out_tok = rng.integers(0, 3, n_slots).astype(np.int64)
    extra = rng.integers(0, 5, n_slots).astype(np.int64)
    word_gen = np.where(rng.random(n_slots) < 0.7, gen, gen + 1).astype(np.uint64)
    progress = (word_gen << np.uint64(32)) | rng.integers(0, 20, n_slots).astype(np.uint64)
    wb = rng.integers(100, 200, n_rows).astype(np.int64)
    wp = rng.integers(100, 200, n_rows).astype(np.int64)
    results = {}
    for name, impl in IMPLS.items():
        arrs = [a.copy() for a in (state, gen, rows, isl, prefill, out_tok, extra, wb, wp)]
        changed = impl.fold_progress(progress.copy(), *arrs[:7], arrs[7], arrs[8], bs)
        results[name] = (changed, arrs)
    assert results["reference"][0] == results["numba"][0]
    for got, want in zip(results["reference"][1], results["numba"][1], strict=True):
        assert np.array_equal(got, want)
    # stale words never change a slot
    stale = (word_gen != gen) | (state == 0)
    assert np.array_equal(results["numba"][1][5][stale], out_tok[stale])


class _OverlapModel:
    """Exact model of OverlapIndex without eviction: per-hash perm/ttl holder sets + one expiry."""

    def __init__(self):
        self.perm: dict[int, set[int]] = {}
        self.ttl: dict[int, set[int]] = {}
        self.exp: dict[int, int] = {}

    def _entry(self, h):
        if not (self.perm.get(h) or self.ttl.get(h)):
            self.perm[h], self.ttl[h], self.exp[h] = set(), set(), 0

    def insert(self, hs, row, now, ttl):
        for h in hs:
            self._entry(h)
            if ttl is None:
                self.perm[h].add(row)
            else:
                if self.exp[h] <= now:
                    self.ttl[h] = set()
                self.ttl[h].add(row)
                self.exp[h] = max(self.exp[h], now + ttl)

    def remove(self, hs, row):
        for h in hs:
            self.perm.get(h, set()).discard(row)
            self.ttl.get(h, set()).discard(row)

    def clear(self, row):
        self.remove(list(self.perm), row)

    def depth(self, hashes, now, n_rows):
        out = []
        for r in range(n_rows):
            d = 0
            for h in hashes:
                held = r in self.perm.get(h, ()) or (r in self.ttl.get(h, ()) and self.exp[h] > now)
                if not held:
                    break
                d += 1
            out.append(d)
        return out


@FAST
@given(
    n_rows=st.sampled_from([1, 3, 64, 70, 130]),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["perm", "ttl", "remove", "clear"]), st.integers(0, 129), hash_lists, st.integers(0, 100)
        ),
        max_size=20,
    ),
    query=st.lists(st.integers(0, 40), max_size=12, unique=True),
    now=st.integers(0, 150),
)
def test_overlap_depth_agrees_with_reference_and_model(n_rows, ops, query, now):
    idx = OverlapIndex(n_rows, 1024)  # large: no eviction, so the exact model applies
    model = _OverlapModel()
    for t, (kind, row, hs, ttl) in enumerate(ops):
        row %= n_rows
        h = np.array(hs, np.uint64)
        if kind == "perm":
            idx.insert(h, row, t, None)
            model.insert(hs, row, t, None)
        elif kind == "ttl":
            idx.insert(h, row, t, ttl + 1)
            model.insert(hs, row, t, ttl + 1)
        elif kind == "remove":
            idx.remove(h, row)
            model.remove(hs, row)
        else:
            idx.clear_row(row)
            model.clear(row)
    q = np.array(query, np.uint64)
    outs = {}
    for name, fn in (("numba", overlap_depth), ("reference", reference.overlap_depth)):
        out = np.full(n_rows, -7, np.int32)
        fn(idx.keys, idx.used, idx.perm, idx.ttlm, idx.ttl_exp, q, now, np.zeros(idx.words, np.uint64), out)
        outs[name] = out
    assert np.array_equal(outs["reference"], outs["numba"])
    assert outs["numba"].tolist() == model.depth(query, now, n_rows)


def test_overlap_evicts_earliest_expiry_when_window_full():
    idx = OverlapIndex(2, 16)  # window = whole table
    idx.insert(np.arange(16, dtype=np.uint64), 0, 0, 1000)
    idx.insert(np.array([3], np.uint64), 1, 0, 5000)  # hash 3 now expires last among TTL entries
    idx.insert(np.array([100], np.uint64), 0, 0, None)
    assert idx.evictions == 1 and len(idx) == 16
    out = np.zeros(2, np.int32)
    idx.depth(np.array([100], np.uint64), 10, out)
    assert out.tolist() == [1, 0]
    idx.depth(np.array([3], np.uint64), 10, out)
    assert out.tolist() == [1, 1]


def test_overlap_ttl_inserts_evict_one_permanent_entry_when_window_full():
    idx = OverlapIndex(1, 16)
    idx.insert(np.arange(16, dtype=np.uint64), 0, 0, None)
    idx.insert(np.arange(100, 120, dtype=np.uint64), 0, 0, 10)  # later TTL inserts evict TTL entries
    out = np.zeros(1, np.int32)
    held = 0
    for h in range(16):
        idx.depth(np.array([h], np.uint64), 5, out)
        held += int(out[0])
    assert held == 15 and len(idx) == 16 and idx.evictions == 20


def test_warm_kernels_runs():
    warm_kernels()


class _PackedFold:
    """`fold_words` through `booking_packed.fold_words_packed` (its arrays as one table, as `WordFold` calls it)."""

    @staticmethod
    def fold_words(n, progress, state, *rest):
        *arrays, bs, out_d, counts, out_r = rest
        return fold_words_packed(n, bs, pack_fold_arrays((progress, state, *arrays, out_d, counts, out_r)))


@FAST
@given(
    n_slots=st.integers(1, 12),
    seed=st.integers(0, 2**32 - 1),
    folds=st.integers(1, 3),
)
def test_fold_words_agrees_when_random_words(n_slots, seed, folds):
    """State + progress words: the kernel, the reference and the packed form agree fold after fold, and stale or
    unchanged words never touch a slot."""
    rng = np.random.default_rng(seed)
    n_rows, bs = 3, 4
    state = rng.integers(0, 4, n_slots).astype(np.uint8)
    gen = rng.integers(1, 4, n_slots).astype(np.uint32)
    rows = rng.integers(-1, n_rows + 1, n_slots).astype(np.int32)  # out-of-range rows are skipped
    isl = rng.integers(1, 50, n_slots).astype(np.int64)
    prefill = (isl * rng.integers(0, 2, n_slots)).astype(np.int64)
    out_tok = rng.integers(0, 3, n_slots).astype(np.int64)
    extra = rng.integers(0, 5, n_slots).astype(np.int64)
    wb = rng.integers(100, 200, n_rows).astype(np.int64)
    wp = rng.integers(100, 200, n_rows).astype(np.int64)
    seen = (gen.astype(np.uint64) << np.uint64(32)) | rng.integers(0, 4, n_slots).astype(np.uint64)
    seen[rng.random(n_slots) < 0.5] = 0
    impls = {**IMPLS, "packed": _PackedFold}
    arrs = {name: [a.copy() for a in (seen, state, gen, rows, isl, prefill, out_tok, extra, wb, wp)] for name in impls}
    for _ in range(folds):

        def words():
            g = np.where(rng.random(n_slots) < 0.7, gen, gen + 1).astype(np.uint64)
            return (g << np.uint64(32)) | rng.integers(0, 20, n_slots).astype(np.uint64)

        progress = words()
        sw = (words() & ~np.uint64(0xFFFFFFFF)) | rng.integers(0, 4, n_slots).astype(np.uint64)
        n = int(rng.integers(0, n_slots + 1))
        results = {}
        before = (arrs["numba"][8].copy(), arrs["numba"][9].copy())  # w_active_blocks, w_active_prefill
        for name, impl in impls.items():
            a = arrs[name]
            out_d, counts, out_r = np.full(n_slots, -1, np.int64), np.zeros(3, np.int64), np.full(n_rows, -1, np.int64)
            changed = impl.fold_words(n, progress.copy(), sw.copy(), *a, bs, out_d, counts, out_r)
            results[name] = (changed, counts.tolist(), sorted(out_d[: counts[1]].tolist()), out_r[: counts[2]].tolist())
        for name in ("reference", "packed"):
            assert results[name] == results["numba"], name
            for got, want in zip(arrs[name], arrs["numba"], strict=True):
                assert np.array_equal(got, want), name
        assert results["numba"][1][0] == results["numba"][0]
        # the changed rows are exactly the rows whose active blocks or prefill moved, ascending
        a = arrs["numba"]
        moved = np.flatnonzero((a[8] != before[0]) | (a[9] != before[1])).tolist()
        assert results["numba"][3] == moved
    # slots past n, free slots and slots with a bad row keep their output tokens from the last fold
    a = arrs["numba"]
    skipped = (state == 0) | (rows < 0) | (rows >= n_rows)
    assert np.array_equal(a[6][skipped], out_tok[skipped])
    assert np.all(a[1][state != 0] >= state[state != 0])  # states never move backwards


@FAST
@given(n_slots=st.integers(0, 10), seed=st.integers(0, 2**32 - 1))
def test_words_changed_agrees_and_keeps_every_store(n_slots, seed):
    """The kernel and the reference agree; True exactly when some state or progress word of slots
    [0, n) differs from what was seen; afterwards the progress words of [0, n) are all seen (a
    second call with no new store says False), and slots past n are never touched."""
    rng = np.random.default_rng(seed)
    size = n_slots + 2
    progress, state = rng.integers(0, 3, size).astype(np.uint64), rng.integers(0, 3, size).astype(np.uint64)
    seen_p, seen_s = rng.integers(0, 3, size).astype(np.uint64), rng.integers(0, 3, size).astype(np.uint64)
    want = bool(np.any(progress[:n_slots] != seen_p[:n_slots]) or np.any(state[:n_slots] != seen_s[:n_slots]))
    results = {}
    for name, impl in IMPLS.items():
        sp = seen_p.copy()
        got = impl.words_changed(n_slots, progress, state, sp, seen_s)
        results[name] = (bool(got), sp.tolist())
        assert bool(got) == want, name
        assert np.array_equal(sp[n_slots:], seen_p[n_slots:]), name
        if got:
            assert np.array_equal(sp[:n_slots], progress[:n_slots]), name
            assert not impl.words_changed(n_slots, progress, state, sp, state.copy()), name  # all seen now
    assert results["reference"] == results["numba"]
