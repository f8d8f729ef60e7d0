"""Stream state and index updates of `KvEventApplier` (pure: no sockets)."""

from __future__ import annotations

import msgspec
import numpy as np

from kvsched.kvevents.apply import KvEventApplier
from kvsched.shm.layout import FLAG_STALE
from kvsched.shm.overlap import OverlapIndex
from kvsched.shm.select_kernels import credit_rows

enc = msgspec.msgpack.encode
ROWS = 4


def stored(*hashes, medium="GPU"):
    return ["BlockStored", list(hashes), None, [], 16, None, medium]


def removed(*hashes, medium="GPU"):
    return {"type": "BlockRemoved", "block_hashes": list(hashes), "medium": medium}


CLEARED = ["AllBlocksCleared"]


def batch(*events) -> bytes:
    return enc([0.0, list(events), 0])


def make(replay_on_first=False, **kw):
    dev, off = OverlapIndex(ROWS, 1 << 10), OverlapIndex(ROWS, 1 << 10)
    return KvEventApplier(dev, off, replay_on_first=replay_on_first, **kw), dev, off


def depth(idx: OverlapIndex, *hashes) -> list[int]:
    out = np.zeros(ROWS, np.int32)
    idx.depth(np.array(hashes, dtype=np.uint64), 0, out)
    return out.tolist()


def test_in_order_batches_apply_store_remove_and_tiers():
    ap, dev, off = make()
    r = ap.on_live(1, 0, batch(stored(1, 2, 3), stored(1, 2, medium="CPU")), 0)
    assert r.replay_from is None and r.applied == 2 and r.first
    assert depth(dev, 1, 2, 3)[1] == 3 and depth(off, 1, 2, 3)[1] == 2
    ap.on_live(1, 1, batch(removed(2)), 0)
    assert depth(dev, 1, 2, 3)[1] == 1 and depth(off, 1, 2)[1] == 2
    assert ap.counters.applied == 3 and ap.counters.gaps == 0


def test_gap_requests_replay_and_replayed_batches_fill_it():
    ap, dev, _ = make()
    ap.on_live(0, 0, batch(stored(1)), 0)
    r = ap.on_live(0, 3, batch(stored(4)), 0)  # seqs 1, 2 missing
    assert r.replay_from == 1 and ap.counters.gaps == 1 and ap.replay_pending(0)
    assert ap.on_replay(0, 1, batch(stored(2)), 0) == 1
    assert ap.on_replay(0, 2, batch(stored(3)), 0) == 1
    assert ap.on_replay(0, 3, batch(stored(4)), 0) == 0  # already applied live: duplicate
    assert ap.on_replay_end(0) is None and not ap.replay_pending(0)
    assert depth(dev, 1, 2, 3, 4)[0] == 4
    assert ap.counters.replayed == 2 and ap.counters.replay_duplicates == 1 and ap.counters.replay_lost == 0
    assert ap.stream(0).tombs == {}


def test_replay_never_resurrects_a_block_a_newer_live_event_removed():
    ap, dev, _ = make()
    ap.on_live(0, 0, batch(stored(1)), 0)
    ap.on_live(0, 2, batch(removed(5), stored(6)), 0)  # seq 1 missing; 5 removed live at seq 2
    ap.on_live(0, 3, batch(removed(6)), 0)
    # the replayed seq 1 stored 5 and 6 and removed 1; 5 and 6 must stay gone, 1 must go
    ap.on_replay(0, 1, batch(stored(5, 6), removed(1)), 0)
    assert depth(dev, 5)[0] == 0 and depth(dev, 6)[0] == 0 and depth(dev, 1)[0] == 0
    assert ap.counters.resurrect_skipped == 2


def test_replay_does_not_remove_a_block_a_newer_live_event_stored():
    ap, dev, _ = make()
    ap.on_live(0, 0, batch(stored(7)), 0)
    ap.on_live(0, 2, batch(stored(7)), 0)
    ap.on_replay(0, 1, batch(removed(7)), 0)
    assert depth(dev, 7)[0] == 1


def test_replayed_clear_keeps_newer_live_stores_and_live_clear_discards_older_replays():
    ap, dev, _ = make()
    ap.on_live(0, 0, batch(stored(1, 2)), 0)
    ap.on_live(0, 2, batch(stored(9)), 0)  # seq 1 missing
    ap.on_replay(0, 1, batch(CLEARED, stored(3)), 0)
    assert depth(dev, 1)[0] == 0 and depth(dev, 9)[0] == 1 and depth(dev, 3)[0] == 1
    ap.on_replay_end(0)

    ap2, dev2, _ = make()
    ap2.on_live(0, 0, batch(stored(1)), 0)
    ap2.on_live(0, 2, batch(CLEARED, stored(8)), 0)  # live clear at seq 2
    ap2.on_replay(0, 1, batch(stored(4)), 0)  # older than the clear: dropped
    assert depth(dev2, 4)[0] == 0 and depth(dev2, 8)[0] == 1 and depth(dev2, 1)[0] == 0


def test_end_marker_counts_lost_seqs_and_asks_again_for_gaps_found_meanwhile():
    ap, _, _ = make()
    ap.on_live(0, 0, batch(), 0)
    assert ap.on_live(0, 3, batch(), 0).replay_from == 1  # missing 1, 2 (request sent at seq 3)
    assert ap.on_live(0, 6, batch(), 0).replay_from is None  # missing 4, 5: one replay at a time
    ap.on_replay(0, 2, batch(), 0)
    assert ap.on_replay_end(0) == 4  # seq 1 lost; 4, 5 found after the request -> ask again
    assert ap.counters.replay_lost == 1 and ap.counters.replay_requests == 2
    ap.on_replay(0, 4, batch(), 0)
    ap.on_replay(0, 5, batch(), 0)
    assert ap.on_replay_end(0) is None and ap.stream(0).missing == []


def test_seq_decrease_clears_the_row_and_replays_from_zero():
    ap, dev, off = make(replay_on_first=True)
    assert ap.on_live(2, 0, batch(stored(1, 2), stored(1, medium="CPU")), 0).replay_from is None
    ap.on_live(2, 1, batch(stored(3)), 0)
    ap.on_live(1, 0, batch(stored(1)), 0)  # another row is untouched
    r = ap.on_live(2, 0, batch(stored(5)), 0)
    assert r.restarted and r.first and r.replay_from is None
    assert depth(dev, 1)[2] == 0 and depth(dev, 5)[2] == 1 and depth(off, 1)[2] == 0 and depth(dev, 1)[1] == 1
    r = ap.on_live(2, 0, batch(), 0)  # equal seq after a restart at 0: restarted again
    assert r.restarted and depth(dev, 5)[2] == 0
    r = ap.on_live(2, 7, batch(), 0)
    assert not r.restarted and r.replay_from == 1
    r = ap.on_live(2, 3, batch(), 0)  # restart with batches 0..2 already gone by: replay from 0
    assert r.restarted and r.replay_from == 0
    assert ap.counters.restarts == 3


def test_first_batch_with_seq_above_zero_asks_for_the_history():
    ap, dev, _ = make(replay_on_first=True)
    r = ap.on_live(0, 5, batch(stored(9)), 0)
    assert r.first and r.replay_from == 0 and ap.counters.gaps == 0
    ap.on_replay(0, 4, batch(stored(8)), 0)
    assert ap.on_replay_end(0) is None and ap.counters.replay_lost == 4
    assert depth(dev, 8)[0] == 1


def test_all_blocks_cleared_clears_both_tiers_of_that_row_only():
    ap, dev, off = make()
    ap.on_live(0, 0, batch(stored(1), stored(1, medium="CPU")), 0)
    ap.on_live(1, 0, batch(stored(1)), 0)
    ap.on_live(0, 1, batch(CLEARED), 0)
    assert depth(dev, 1)[:2] == [0, 1] and depth(off, 1)[0] == 0


def test_malformed_payload_consumes_its_seq_and_unknowns_are_counted():
    ap, dev, _ = make()
    ap.on_live(0, 0, b"\xc1", 0)
    r = ap.on_live(
        0,
        1,
        batch(
            ["Mystery", 1],
            stored(4),
            {"type": "BlockStored", "block_hashes": [5], "token_ids": [], "block_size": 16, "new": 1},
        ),
        0,
    )
    assert r.replay_from is None and r.applied == 2 and depth(dev, 5)[0] == 1
    c = ap.counters
    assert (c.malformed_batches, c.unknown_types, c.unknown_fields, c.gaps) == (1, 1, 1, 0)


def test_replay_failure_retries_then_gives_up():
    ap, _, _ = make()
    ap.on_live(0, 0, batch(), 0)
    ap.on_live(0, 4, batch(stored(1)), 0)
    assert ap.replay_failed(0, retry=True) == 1
    assert ap.replay_failed(0, retry=False) is None
    assert ap.counters.replay_lost == 3 and ap.stream(0).tombs == {} and not ap.replay_pending(0)


def test_tombstone_overflow_abandons_the_replay():
    ap, _, _ = make(max_tombstones=3)
    ap.on_live(0, 0, batch(), 0)
    ap.on_live(0, 2, batch(stored(1, 2, 3, 4)), 0)
    assert ap.counters.tombstone_overflows == 1 and not ap.stream(0).missing
    assert ap.on_replay(0, 1, batch(stored(9)), 0) == 0


def test_offload_events_ignored_without_offload_index():
    dev = OverlapIndex(ROWS, 1 << 8)
    ap = KvEventApplier(dev, None, replay_on_first=False)
    assert ap.on_live(0, 0, batch(stored(1, medium="CPU"), stored(2)), 0).applied == 1
    assert depth(dev, 1)[0] == 0 and depth(dev, 2)[0] == 1


def test_credit_rows_combines_indexes():
    device = np.array([4, 0, 2, 5], np.int32)
    offload = np.array([6, 3, 0, 9], np.int32)
    spec = np.array([1, 2, 3, 8], np.int32)
    approx = np.array([0, 0, 0, 7], np.int32)
    fed = np.ones(4, np.uint8)
    flags = np.array([0, 0, 0, FLAG_STALE], np.uint8)  # the last row's stream is stale: approximate only
    raw, out = np.zeros(4, np.int32), np.zeros(4, np.int32)
    credit_rows(approx, device, offload, spec, fed, flags, FLAG_STALE, 0.5, True, raw, out)
    assert out.tolist() == [4 + 1, 2 + 0, 3, 7]  # 2 + 0.5 floored
    credit_rows(approx, device, offload, spec, fed, flags, FLAG_STALE, 0.5, False, raw, out)
    assert out.tolist() == [4, 2, 3, 7]
    fed[0] = 0  # a row without an event source: approximate only
    credit_rows(approx, device, offload, spec, fed, flags, FLAG_STALE, 1.0, True, raw, out)
    assert out.tolist() == [0, 3, 3, 7]
