"""Staleness of a KV-event stream: evidence of loss, never silence (pure; `kvevents/staleness.py` and
`KvEventApplier.unfilled` / `reconnected`; docs/KV_EVENTS.md, "Staleness")."""

from __future__ import annotations

import pytest

from kvsched.kvevents.staleness import StreamHealth
from tests.kvevents.test_apply import CLEARED, batch, depth, make, removed, stored


def test_a_connected_row_is_never_stale_from_silence():
    h = StreamHealth.subscribed(2.0, now_s=100.0)
    h.connected()
    h.gap(False, 101.0)
    assert not h.stale(100.0 + 1e6)


def test_no_handshake_since_subscribing_is_a_disconnect_from_then():
    h = StreamHealth.subscribed(2.0, now_s=100.0)
    assert not h.stale(101.9) and h.stale(102.0)
    h.connected()
    assert not h.stale(102.0)


def test_a_disconnect_counts_from_its_first_report_until_a_handshake():
    h = StreamHealth.subscribed(2.0, now_s=0.0)
    h.connected()
    h.disconnected(10.0)
    h.disconnected(11.5)  # a reconnect attempt failing again keeps the first time
    assert not h.stale(11.9) and h.stale(12.0)
    h.connected()
    assert not h.stale(30.0)


def test_an_unfilled_gap_counts_from_when_it_opened_until_it_closes():
    h = StreamHealth.subscribed(2.0, now_s=0.0)
    h.connected()
    h.gap(True, 5.0)
    h.gap(True, 6.5)
    assert not h.stale(6.9) and h.stale(7.0)
    h.gap(False, 7.1)
    assert not h.stale(7.1)


def test_the_limit_must_be_positive():
    with pytest.raises(ValueError):
        StreamHealth.subscribed(0.0, now_s=0.0)


def test_a_gap_is_unfilled_until_replay_fills_it():
    ap, _, _ = make()
    ap.on_live(0, 0, batch(stored(1)), 0)
    ap.on_live(0, 3, batch(stored(4)), 0)
    assert ap.unfilled(0)
    ap.on_replay(0, 1, batch(stored(2)), 0)
    assert ap.unfilled(0)
    ap.on_replay(0, 2, batch(stored(3)), 0)
    assert not ap.unfilled(0)
    assert ap.on_replay_end(0) is None and not ap.unfilled(0)


def test_seqs_replay_could_not_supply_stay_unfilled_until_the_engine_clears_or_restarts():
    ap, _, _ = make()
    ap.on_live(0, 0, batch(stored(1)), 0)
    ap.on_live(0, 2, batch(stored(3)), 0)
    assert ap.on_replay_end(0) is None  # the publisher no longer had seq 1
    assert ap.counters.replay_lost == 1 and ap.unfilled(0)
    ap.on_live(0, 3, batch(stored(5)), 0)
    assert ap.unfilled(0)  # later batches do not bring seq 1 back
    ap.on_live(0, 4, batch(CLEARED, stored(6)), 0)
    assert not ap.unfilled(0)
    ap.on_live(1, 0, batch(stored(1)), 0)
    ap.on_live(1, 2, batch(stored(3)), 0)
    ap.replay_failed(1, retry=False)
    assert ap.unfilled(1)
    ap.on_live(1, 0, batch(stored(9)), 0)  # seq decrease: the engine restarted, the row starts over
    assert not ap.unfilled(1)


def test_the_history_before_the_first_batch_is_not_a_gap_even_when_lost():
    ap, _, _ = make(replay_on_first=True)
    assert ap.on_live(0, 500, batch(stored(1)), 0).replay_from == 0
    assert not ap.unfilled(0)
    ap.on_replay(0, 499, batch(stored(2)), 0)
    assert ap.on_replay_end(0) is None and ap.counters.replay_lost == 499
    assert not ap.unfilled(0)


def test_a_reconnect_asks_from_the_last_applied_seq_and_catches_up_what_was_published_meanwhile():
    ap, dev, _ = make()
    ap.on_live(0, 0, batch(stored(1)), 0)
    ap.on_live(0, 1, batch(stored(2)), 0)
    assert ap.reconnected(0) == 1  # the seq it knows: still held = the same publisher
    assert ap.reconnected(0) is None  # one replay at a time
    assert ap.on_replay(0, 1, batch(stored(2)), 0) == 0
    assert ap.on_replay(0, 2, batch(removed(1)), 0) == 1  # published while nobody listened
    assert ap.on_replay_end(0) is None
    assert depth(dev, 1)[0] == 0 and depth(dev, 2)[0] == 1 and ap.stream(0).last_seq == 2
    assert ap.counters.restarts == 0 and not ap.unfilled(0)
    ap.on_live(0, 3, batch(stored(7)), 0)  # the live stream goes on without a gap
    assert ap.counters.gaps == 0 and depth(dev, 7)[0] == 1


def test_a_reconnect_answered_with_nothing_means_the_engine_restarted():
    ap, dev, _ = make()
    ap.on_live(0, 0, batch(stored(1)), 0)
    ap.on_live(0, 1, batch(stored(2)), 0)
    assert ap.reconnected(0) == 1
    assert ap.on_replay_end(0) is None  # its ring buffer holds nothing from seq 1 on
    assert ap.counters.restarts == 1 and depth(dev, 1)[0] == 0
    assert ap.stream(0).last_seq == -1 and not ap.unfilled(0)


def test_a_reconnect_of_a_row_that_knows_nothing_asks_for_the_whole_history():
    ap, dev, _ = make(replay_on_first=True)
    assert ap.reconnected(0) == 0
    assert ap.on_replay(0, 40, batch(stored(1)), 0) == 1  # the ring buffer starts at 40
    assert ap.on_replay(0, 41, batch(stored(2)), 0) == 1
    assert ap.on_replay_end(0) is None
    assert depth(dev, 1)[0] == 1 and not ap.unfilled(0)  # 0..39: history, not a gap
    off, _, _ = make(replay_on_first=False)
    assert off.reconnected(0) is None


def test_a_reconnect_that_loses_seqs_the_ring_buffer_dropped_leaves_the_row_unfilled():
    ap, _, _ = make()
    ap.on_live(0, 0, batch(stored(1)), 0)
    assert ap.reconnected(0) == 0
    ap.on_replay(0, 5, batch(stored(6)), 0)  # seqs 1..4 are gone from the publisher's buffer
    assert ap.on_replay_end(0) is None
    assert ap.counters.replay_lost == 4 and ap.counters.restarts == 0 and ap.unfilled(0)
