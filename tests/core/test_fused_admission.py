"""The admission kernel (`Admitter.admit`, one `admit_kv` call, the first step of every enqueue) decides exactly as the
Python path (`admit_one`): two schedulers fed the same operations, one with the fused path off,
return the same records and end in the same state (ledger, overlap indexes, recent work, explain)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.config import ClassConfig, SelectorConfig
from kvsched.core.create import create_scheduler
from kvsched.core.ledger import Ledger
from kvsched.core.types import Admit, WorkerKey
from kvsched.shm.layout import LedgerArrays
from kvsched.shm.overlap import OverlapIndex

from .factories import make_config, make_request

WORKERS = ((1, 0), (2, 0), (3, 0), (3, 1))
LEDGER = (
    "w_active_blocks",
    "w_active_prefill",
    "w_active_requests",
    "w_flags",
    "ref_keys",
    "ref_counts",
    "arena",
    "s_state",
    "s_generation",
    "s_worker_row",
    "s_isl",
    "s_cached",
    "s_prefill",
    "s_expected_osl",
    "s_extra_blocks",
    "s_class",
    "s_enqueue_us",
    "s_admit_us",
    "s_arena_len",
    "s_owner_pid",
)


def _pair(events: bool, busy_frac: float | None, max_slots: int, overload_prefill: int | None, home: bool = False):
    """Two identical schedulers; the second decides by the Python path only. `home`: the home term on,
    for prompts from 64 tokens (so that the fused path decides the shorter ones only)."""
    from kvsched.config import OverloadConfig

    classes = [ClassConfig(name="default", prefill_busy_threshold_frac=busy_frac), ClassConfig(name="batch")]
    out = []
    for _ in range(2):
        sel = (
            SelectorConfig(seed=3, home_weight=0.5, home_min_prefill_tokens=64)
            if home
            else SelectorConfig(seed=3, home_weight=0.0)
        )
        config = make_config(
            classes=classes, selector=sel, overload=OverloadConfig(overload_prefill_tokens=overload_prefill)
        )
        ledger = Ledger(LedgerArrays.private(8, max_slots, 16, block_size=16), overload=config.overload)
        s = create_scheduler(config, ledger=ledger, overlap=OverlapIndex(8, 256), add_workers=False, events=events)
        for wid, rank in WORKERS:
            s.add_worker(WorkerKey(wid, rank), 4000, 2048)
        if events:
            for row in (0, 2):
                s.set_event_fed(row, True)
            s.event_device.insert(np.arange(1, 9, dtype=np.uint64), 2, 0, None)
        out.append(s)
    fast, slow = out
    slow.admitter.fused = False
    assert fast.admitter.fused
    return fast, slow


def count_fused(sched) -> dict:
    """Wrap `sched.admitter.admit` so that each admission it decides (not None) counts in the
    returned dict's "fused" entry."""
    calls = {"fused": 0}
    admit = sched.admitter.admit

    def counting(*args):
        got = admit(*args)
        calls["fused"] += got is not None
        return got

    sched.admitter.admit = counting
    return calls


def _same_state(fast, slow, ids) -> None:
    for f in LEDGER:
        np.testing.assert_array_equal(getattr(fast.ledger.arrays, f), getattr(slow.ledger.arrays, f), err_msg=f)
    for name in ("overlap", "speculative"):
        a, b = getattr(fast, name), getattr(slow, name)
        if a is not None:
            for f in ("keys", "used", "perm", "ttlm", "ttl_exp"):
                np.testing.assert_array_equal(getattr(a, f), getattr(b, f), err_msg=f"{name}.{f}")
    np.testing.assert_array_equal(fast.selector.recent[: slow.selector.recent.size], slow.selector.recent)
    assert not fast.selector.recent[slow.selector.recent.size :].any()
    assert fast.selector.recent_at_us == slow.selector.recent_at_us
    np.testing.assert_array_equal(fast.selector.home, slow.selector.home)
    assert fast.selector.home_at_us == slow.selector.home_at_us
    for rid in ids:
        assert fast.explain(rid) == slow.explain(rid), rid


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    events=st.booleans(),
    busy_frac=st.sampled_from([None, 0.5, 4.0]),
    max_slots=st.sampled_from([6, 64]),
    overload_prefill=st.sampled_from([None, 3000]),
    home=st.booleans(),
)
def test_fused_path_decides_as_the_python_path(seed, events, busy_frac, max_slots, overload_prefill, home):
    """Random enqueues (shared prefixes, allowed sets, pins, the batch class, repeated ids), progress,
    releases, requeues and cleanups, on an idle fleet (ties) and a loaded one (busy class, full slot
    table, overloaded rows)."""
    rng = np.random.default_rng(seed)
    fast, slow = _pair(events, busy_frac, max_slots, overload_prefill, home)
    calls = count_fused(fast)
    now, ids, held = 1_000_000, [], []
    for i in range(120):
        now += int(rng.integers(0, 3)) * int(rng.integers(1, 400_000))
        op = rng.random()
        if op < 0.6:
            rid = f"r{i}" if rng.random() < 0.95 else (ids[-1] if ids else "r0")
            prefix = int(rng.integers(0, 3))
            n = int(rng.integers(0, 9))
            hashes = np.array(
                [prefix * 1000 + k for k in range(min(n, 3))] + [10**6 + i * 16 + k for k in range(n - 3)],
                dtype=np.uint64,
            )
            kw = dict(
                isl_tokens=max(1, n * 16 - int(rng.integers(0, 16))) + int(rng.integers(0, 3)) * 16,
                block_hashes=np.frombuffer(hashes.tobytes(), dtype="<u8"),
                owner=1,
            )
            if rng.random() < 0.15:
                kw["allowed_workers"] = frozenset({int(rng.choice([1, 2, 3]))})
            if rng.random() < 0.1:
                kw["pinned"] = WorkerKey(*WORKERS[int(rng.integers(0, len(WORKERS)))])
            if rng.random() < 0.15:
                kw["policy_class"] = "batch"
            if rng.random() < 0.3:
                kw["expected_osl"] = int(rng.integers(1, 500))
            got = [s.enqueue(make_request(rid, **kw), now) for s in (fast, slow)]
            assert got[0] == got[1]
            ids.append(rid)
            held += [a for a in got[0] if isinstance(a, Admit)]
        elif op < 0.75 and held:
            a = held[int(rng.integers(0, len(held)))]
            kind = str(rng.choice(["dispatched", "prefill_done", "requeue"]))
            got = []
            for s in (fast, slow):
                try:
                    got.append(s.update(a.request_id, a.slot, a.generation, kind, None, now))
                except KeyError:
                    got.append("stale")
            assert got[0] == got[1]
            if kind == "requeue" and got[0] != "stale":
                held += [x for x in got[0] if isinstance(x, Admit)]
        elif held:
            a = held.pop(int(rng.integers(0, len(held))))
            for s in (fast, slow):
                s.release(a.request_id, a.slot, a.generation, "completed", 10, now)
        got = [s.drain_cleanup(now) for s in (fast, slow)]
        assert got[0] == got[1]
        held += [a for a in got[0] if isinstance(a, Admit)]
    _same_state(fast, slow, ids)
    if busy_frac is None and overload_prefill is None and max_slots == 64:
        assert calls["fused"] > 0  # the fused path decided some of them


def test_queued_requests_are_booked_by_the_kernel_in_the_dispatch_pass():
    """One pipeline: a request that waited (its class busy) is booked by the same kernel step
    (`Admitter.book`) when a dispatch pass admits it, with its waiting time in the `Admit`; records
    and state match the Python path's."""
    fast, slow = _pair(False, 0.5, 64, None)
    booked = {"n": 0}
    book = fast.admitter.book

    def counting(*args):
        got = book(*args)
        booked["n"] += got is not None
        return got

    fast.admitter.book = counting
    calls = count_fused(fast)
    held, ids = [], []
    for i in range(12):  # 1,600-token prompts: every worker busy (> 0.5 x 2,048) after one each
        h = np.array([100 * i + k for k in range(4)], dtype=np.uint64)
        got = [
            s.enqueue(make_request(f"b{i}", isl_tokens=1600, block_hashes=h, owner=1), 1000 + i) for s in (fast, slow)
        ]
        assert got[0] == got[1]
        held += got[0]
        ids.append(f"b{i}")
    assert len(held) == len(WORKERS)  # the rest wait
    waited = []
    for k, a in enumerate(list(held)):
        got = [s.update(a.request_id, a.slot, a.generation, "prefill_done", None, 50_000 + k) for s in (fast, slow)]
        got = [g + s.drain_cleanup(50_000 + k) for g, s in zip(got, (fast, slow), strict=True)]
        assert got[0] == got[1]
        waited += got[0]
    assert waited and all(isinstance(a, Admit) and a.queued_us > 0 for a in waited)
    assert booked["n"] == calls["fused"] + len(waited)  # the dispatch pass's bookings went through the kernel
    _same_state(fast, slow, ids)


def test_fused_path_is_taken_for_a_plain_request_and_explained():
    """A request on a loaded fleet (no ties) is admitted by the kernel; `explain` reads the ring."""
    fast, slow = _pair(False, None, 64, None)
    for s in (fast, slow):
        s.enqueue(make_request("warm", isl_tokens=640, block_hashes=np.arange(1, 41, dtype=np.uint64), owner=1), 10)
    before = fast.admitter.explain.head
    h = np.arange(1, 9, dtype=np.uint64)
    got = [s.enqueue(make_request("a", isl_tokens=128, block_hashes=h, owner=1), 20) for s in (fast, slow)]
    assert got[0] == got[1] and isinstance(got[0][0], Admit)
    assert fast.admitter.explain.head == before + 1
    assert fast.explain("a") == slow.explain("a")
    assert fast.admitter.explain[-1][11] is not None  # the kv terms, read from the ring
    _same_state(fast, slow, ["warm", "a"])


@pytest.mark.parametrize("n", [1, 3])
def test_explain_ring_keeps_the_newest_records_when_it_wraps(n):
    fast, _ = _pair(False, None, 64, None)
    from kvsched.core import admitter as adm_mod
    from kvsched.core.explain_ring import ExplainRing

    fast.admitter.explain = ExplainRing(n, 8)
    for i in range(n + 2):
        fast.enqueue(make_request(f"x{i}", isl_tokens=32, block_hashes=np.array([7, i], np.uint64), owner=1), 100 + i)
    assert fast.explain("x0") is None and fast.explain(f"x{n + 1}") is not None
    assert adm_mod.EXPLAIN_RING >= 1024


@pytest.mark.parametrize("key,value", [("lead_max_extra_ttft_s", 3.0), ("prefill_seconds_ref_us", 30.0)])
def test_fused_path_is_off_when_a_key_the_fused_kernel_is_not_given_is_on(key, value):
    """The predicted-seconds keys read a model the fused kernel is not given (the kv selector's
    `admitted` feeds its state): with one on, every request takes the Python path, and two
    schedulers, one forced onto the Python path, decide alike."""
    from kvsched.core.ledger import Ledger as _Ledger

    out = []
    for _ in range(2):
        config = make_config(selector=SelectorConfig(seed=3, **{"home_weight": 0.0, key: value}))
        s = create_scheduler(
            config,
            ledger=_Ledger(LedgerArrays.private(8, 64, 16, block_size=16)),
            overlap=OverlapIndex(8, 256),
            add_workers=False,
        )
        for wid, rank in WORKERS:
            s.add_worker(WorkerKey(wid, rank), 4000, 2048)
        out.append(s)
    auto, slow = out
    slow.admitter.fused = False
    assert not auto.admitter.fused
    rng = np.random.default_rng(5)
    for i in range(40):
        h = np.array([int(rng.integers(0, 3)) * 100 + k for k in range(4)] + [10**6 + i], dtype=np.uint64)
        got = [s.enqueue(make_request(f"q{i}", isl_tokens=80, block_hashes=h, owner=1), 1000 * i) for s in out]
        assert got[0] == got[1]
    _same_state(auto, slow, [f"q{i}" for i in range(40)])


def test_with_the_home_term_on_the_fused_kernel_decides_short_prompts_and_the_python_path_long_ones():
    """The home term is 0 on every row for a prompt shorter than `home_min_prefill_tokens`: the fused
    kernel decides those; longer ones take the Python path. Both schedulers (one forced onto the
    Python path) decide alike and count the same cache-reusing admissions."""
    fast, slow = _pair(False, None, 64, None, home=True)
    calls = {"fused": 0, "short": 0}
    admit = fast.admitter.admit

    def counting(spec, *args):
        got = admit(spec, *args)
        calls["fused"] += got is not None
        calls["short"] += spec.isl_tokens < 64
        assert got is None or spec.isl_tokens < 64
        return got

    fast.admitter.admit = counting
    ids = []
    for i in range(60):
        n = 2 if i % 3 else 6  # 32 or 96 tokens; turns of 3 conversations reuse their history
        h = np.array([1000 * (i % 3) + k for k in range(n)], dtype=np.uint64)
        rid = f"h{i}"
        got = [s.enqueue(make_request(rid, isl_tokens=16 * n, block_hashes=h, owner=1), 1000 * i) for s in (fast, slow)]
        assert got[0] == got[1]
        ids.append(rid)
        for a in got[0]:
            if isinstance(a, Admit):
                for s in (fast, slow):
                    s.release(a.request_id, a.slot, a.generation, "completed", 1, 1000 * i + 500)
    _same_state(fast, slow, ids)
    assert calls["fused"] > 0 and fast.selector.home.any()
