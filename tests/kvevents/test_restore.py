"""A restarted daemon's applier: restored rows, catch-up replay, persisted seqs (pure: no sockets).

Reference model: the same event stream applied in order, once, by a fresh applier. Whatever the
interleaving of the live stream and the catch-up replay after a restart, the restored index must end
equal to it, and the persisted seq must say how far it is applied.
"""

from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.kvevents.apply import KvEventApplier
from kvsched.shm.overlap import OverlapIndex

ROWS = 2
KEYS = list(range(1, 13))
enc = msgspec.msgpack.encode


class Store:
    """What `KvIndexSegment` offers the applier: last_seq and present per row."""

    def __init__(self) -> None:
        self.last_seq = np.full(ROWS, -1, np.int64)
        self.present = np.ones(ROWS, np.uint8)


def batch(events) -> bytes:
    out = []
    for kind, keys in events:
        if kind == "clear":
            out.append(["AllBlocksCleared"])
        elif kind == "store":
            out.append(["BlockStored", list(keys), None, [], 16, None, "GPU"])
        else:
            out.append({"type": "BlockRemoved", "block_hashes": list(keys), "medium": "GPU"})
    return enc([0.0, out, 0])


def holders(idx: OverlapIndex) -> dict[int, list[int]]:
    out = np.zeros(ROWS, np.int32)
    res = {}
    for k in KEYS:
        idx.depth(np.array([k], np.uint64), 0, out)
        res[k] = out.tolist()
    return res


def reference(payloads: list[bytes]) -> dict[int, list[int]]:
    idx = OverlapIndex(ROWS, 1 << 8)
    ap = KvEventApplier(idx, None, replay_on_first=False)
    for seq, p in enumerate(payloads):
        ap.on_live(0, seq, p, 0)
    return holders(idx)


events = st.lists(
    st.tuples(
        st.sampled_from(["store", "store", "remove", "clear"]),
        st.lists(st.sampled_from(KEYS), min_size=1, max_size=3, unique=True),
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=200, deadline=None)
@given(stream=st.lists(events, min_size=3, max_size=30), data=st.data())
def test_restored_row_catches_up_to_the_in_order_result_whatever_the_interleaving(stream, data):
    """1. daemon A applies seqs 0..K live (persisting its seq), dies; 2. the engine publishes K+1..N
    while nobody listens, then N+1..M after daemon B connected; 3. B restores (index and seq kept),
    asks for a catch-up replay from K+1, which returns K+1..R (R in [N, M]) interleaved arbitrarily
    with the live N+1..M, then the end marker. B's index equals the in-order reference; seq = M."""
    payloads = [batch(evs) for evs in stream]
    m = len(payloads) - 1
    k = data.draw(st.integers(0, m), label="applied by A")
    n = data.draw(st.integers(k, m), label="published while down")
    r = data.draw(st.integers(n, m), label="replay snapshot")
    idx, store = OverlapIndex(ROWS, 1 << 8), Store()
    a = KvEventApplier(idx, None, replay_on_first=False, store=store)
    for seq in range(k + 1):
        a.on_live(0, seq, payloads[seq], 0)
    assert store.last_seq[0] == k
    b = KvEventApplier(idx, None, replay_on_first=False, store=store)  # same shared arrays
    assert b.restore(0, int(store.last_seq[0])) == k + 1 and b.catching_up(0)
    live = [("live", s) for s in range(n + 1, m + 1)]
    replay = [("replay", s) for s in range(k + 1, r + 1)]
    order = []
    while live or replay:
        src = live if not replay else replay if not live else (live if data.draw(st.booleans()) else replay)
        order.append(src.pop(0))
    for kind, seq in order:
        if kind == "live":
            res = b.on_live(0, seq, payloads[seq], 0)
            assert not res.restarted
            if res.replay_from is not None:  # a gap while the catch-up is in flight waits for it
                raise AssertionError("a second replay was requested while one is in flight")
        else:
            b.on_replay(0, seq, payloads[seq], 0)
    nxt = b.on_replay_end(0)
    assert nxt is None and not b.catching_up(0)
    assert holders(idx) == reference(payloads)
    assert store.last_seq[0] == m
    assert b.counters.restarts == 0 and b.counters.replay_lost == 0


def test_a_live_seq_not_above_the_restored_one_means_the_engine_restarted():
    idx, store = OverlapIndex(ROWS, 1 << 8), Store()
    a = KvEventApplier(idx, None, replay_on_first=False, store=store)
    for seq in range(5):
        a.on_live(1, seq, batch([("store", [seq + 1])]), 0)
    b = KvEventApplier(idx, None, replay_on_first=False, store=store)
    b.restore(1, 4)
    assert holders(idx)[3] == [0, 1]
    res = b.on_live(1, 0, batch([("store", [9])]), 0)  # the engine restarted: its seq began again
    assert res.restarted and b.counters.restarts == 1
    assert holders(idx)[3] == [0, 0] and holders(idx)[9] == [0, 1]
    assert store.last_seq[1] == 0


def test_catch_up_counts_seqs_the_ring_buffer_no_longer_holds():
    idx, store = OverlapIndex(ROWS, 1 << 8), Store()
    b = KvEventApplier(idx, None, replay_on_first=False, store=store)
    assert b.restore(0, 10) == 11
    b.on_replay(0, 20, batch([("store", [5])]), 0)  # oldest buffered batch: 11..19 are gone
    assert b.counters.replay_lost == 9 and store.last_seq[0] == 20
    assert b.on_replay_end(0) is None


def test_persisted_seq_stays_below_a_missing_range_until_it_is_filled():
    idx, store = OverlapIndex(ROWS, 1 << 8), Store()
    ap = KvEventApplier(idx, None, replay_on_first=False, store=store)
    ap.on_live(0, 0, batch([("store", [1])]), 0)
    res = ap.on_live(0, 4, batch([("store", [2])]), 0)  # 1..3 missing
    assert res.replay_from == 1 and store.last_seq[0] == 0  # a restart from here re-asks 1..
    for seq in (1, 2, 3):
        ap.on_replay(0, seq, batch([("store", [10 + seq])]), 0)
    assert store.last_seq[0] == 4
    ap.reset_row(0)
    assert store.last_seq[0] == -1 and store.present[0] == 0


def test_catch_up_that_never_answers_is_retried_then_given_up():
    idx, store = OverlapIndex(ROWS, 1 << 8), Store()
    b = KvEventApplier(idx, None, replay_on_first=False, store=store)
    b.restore(0, 3)
    assert b.replay_failed(0, retry=True) == 4 and b.catching_up(0)
    assert b.replay_failed(0, retry=False) is None and not b.catching_up(0)
    assert store.last_seq[0] == 3
    assert b.on_live(0, 4, batch([("store", [1])]), 0).replay_from is None  # in order again
