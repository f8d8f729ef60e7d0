"""The composed core: the takeover rule, orphan records, the one constructor, the explain ring.
(The core's imports are checked by tests/test_layering.py.)"""

from __future__ import annotations

import numpy as np

from kvsched.core.create import create_scheduler
from kvsched.core.leases import OrphanCounts
from kvsched.core.types import DAEMON_OWNER, Admit, WorkerKey
from tests.core.factories import make_config, make_request, make_scheduler


def test_claimant_may_take_over_only_from_daemon_self_gone_or_same_process_owner():
    alive = {1: True, 2: True, 3: True}
    same = {(2, 4)}
    s = make_scheduler(owner_alive=lambda o: alive.get(o, True))
    s.lease_table.same_process = lambda a, b: (a, b) in same
    for rid, owner in (("d", DAEMON_OWNER), ("a", 1), ("b", 2), ("c", 3)):
        [got] = s.enqueue(make_request(rid, owner=owner, isl_tokens=10), 1)
        assert isinstance(got, Admit)
    alive[3] = False  # its connection died; the lease is still live until the reaper cancels it
    assert s.may_take_over("unknown", 4)  # not live: the Enqueue is processed normally
    assert s.may_take_over("d", 4)  # the daemon's own (orphans after a restart)
    assert s.may_take_over("a", 1)  # its own
    assert not s.may_take_over("a", 4)  # another live connection's
    assert s.may_take_over("b", 4)  # an earlier connection of the same process
    assert s.may_take_over("c", 4)  # an owner known gone


def test_orphans_come_back_as_a_record_and_are_reported_once_when_released():
    s = make_scheduler()
    [a] = s.enqueue(make_request("a", isl_tokens=10, owner=5), 1)
    [b] = s.enqueue(make_request("b", isl_tokens=10, owner=5), 1)
    fresh = create_scheduler(s.config, ledger=s.ledger, overlap=s.overlap, add_workers=False)
    orphans = fresh.restore_after_restart(10, 1_000)
    assert orphans == OrphanCounts(adopted=2, released=0, deadline_us=1_010)
    assert fresh.owner_of("a") == DAEMON_OWNER
    assert fresh.adopt_lease("a", a.slot, a.generation, 7, 20)  # claimed by a reconnected client
    assert fresh.take_orphan_report() is None
    fresh.tick(1_009)
    assert fresh.take_orphan_report() is None  # before the deadline
    fresh.tick(1_010)
    report = fresh.take_orphan_report()
    assert report == OrphanCounts(adopted=2, released=1, deadline_us=None) and report.claimed == 1
    assert fresh.take_orphan_report() is None  # once
    assert fresh.owner_of("b") is None and fresh.owner_of("a") == 7 and fresh.active_leases == 1
    assert b.request_id == "b"


def test_a_daemon_stall_during_the_grace_moves_the_orphan_deadline_by_the_stall():
    """Routers' Reattach frames sent while the restarted daemon's loop was blocked sit unread, and the
    timer runs before the socket is read: the stall is not part of anyone's grace (docs/DESIGN.md
    §5.4, the same rule as liveness)."""
    s = make_scheduler()
    s.enqueue(make_request("a", isl_tokens=10, owner=5), 1)
    fresh = create_scheduler(s.config, ledger=s.ledger, overlap=s.overlap, add_workers=False)
    assert fresh.restore_after_restart(10, 1_000).deadline_us == 1_010
    fresh.credit_stall(3_000)
    fresh.tick(1_010 + 2_999)
    assert fresh.take_orphan_report() is None and fresh.owner_of("a") == DAEMON_OWNER
    fresh.tick(1_010 + 3_000)
    assert fresh.take_orphan_report().released == 1
    fresh.credit_stall(3_000)  # no orphans left: nothing to move
    assert fresh.active_leases == 0


def test_create_scheduler_registers_the_configured_workers_once():
    from kvsched.config import WorkerConfig

    cfg = make_config(
        workers=[
            WorkerConfig(worker_id=3, dp_size=2, total_kv_blocks=100),
            WorkerConfig(worker_id=9, total_kv_blocks=100),
        ]
    )
    s = create_scheduler(cfg)
    keys = sorted((w.worker_id, w.dp_rank) for w in s.workers())
    assert keys == [(3, 0), (3, 1), (9, 0)]
    again = create_scheduler(cfg, ledger=s.ledger)  # a restarted daemon's ledger keeps its rows
    assert sorted((w.worker_id, w.dp_rank) for w in again.workers()) == keys
    events = create_scheduler(cfg, events=True)
    assert events.event_device is not None and events.speculative is not None
    assert s.event_device is None and s.speculative is None


def test_immediate_admissions_share_one_bypass_record_and_no_cost_snapshot():
    """The decision path keeps what it allocates: the explain ring stores the terms, not the costs."""
    s = make_scheduler(workers=((1, 0), (2, 0)))
    h = np.arange(1, 5, dtype=np.uint64)
    [a] = s.enqueue(make_request("a", isl_tokens=64, block_hashes=h), 1)
    [b] = s.enqueue(make_request("b", isl_tokens=64, block_hashes=h), 2)
    assert isinstance(a, Admit) and isinstance(b, Admit)
    ring = s.admitter.explain
    assert ring[-1][7] is None and ring[-1][11] is not None  # costs dropped: the terms sum to them
    assert ring[-1][8] is ring[-2][8]  # worker-table copies shared while the table is unchanged
    reply = s.explain("b")
    chosen = [r for r in reply.rows if (r.worker_id, r.dp_rank) == (reply.chosen_worker_id, reply.chosen_dp_rank)]
    assert chosen and chosen[0].cost == min(r.cost for r in reply.rows if r.eligible)
    assert WorkerKey(reply.chosen_worker_id, reply.chosen_dp_rank) == b.worker
