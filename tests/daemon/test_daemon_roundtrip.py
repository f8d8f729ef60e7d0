"""A real daemon process with real clients over ipc: admission, queueing, release, bad frames."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
import zmq

from kvsched import protocol as p
from kvsched.client import AdminClient, SchedulerClient
from kvsched.errors import DuplicateRequest, InvalidRequest, NoEndpoints, PinnedNotAllowed
from tests.conftest import TWO_WORKERS, RawPeer, daemon_fixture, purge, start_daemon, wait_until

pytestmark = pytest.mark.timeout(90)


def workers_load(admin_endpoint: str) -> dict[str, tuple[int, int, int]]:
    with AdminClient(admin_endpoint) as admin:
        reply = admin.call(p.Workers())
    return {
        f"{w.worker_id}:{w.dp_rank}": (w.active_blocks, w.active_prefill_tokens, w.active_requests)
        for w in reply.workers
    }


def queued(admin_endpoint: str) -> int:
    """Requests waiting in the daemon's queues."""
    with AdminClient(admin_endpoint) as admin:
        return sum(c.depth for c in admin.call(p.Queues()).classes)


def ledger_is_zero(admin_endpoint: str) -> bool:
    return all(v == (0, 0, 0) for v in workers_load(admin_endpoint).values())


daemon = daemon_fixture(TWO_WORKERS)


async def test_request_admitted_and_released_when_a_worker_is_free(session_daemon):
    async with SchedulerClient(session_daemon.endpoint, client_name="t1") as client:
        lease = await client.schedule("rt-1", isl_tokens=100, block_hashes=[11, 12, 13])
        assert lease.worker.worker_id in (1, 2)
        assert lease.cached_tokens == 0
        async with lease:
            lease.dispatched()
            lease.prefill_done()
            lease.add_output_tokens(10)
        assert lease.outcome == "completed"
    assert wait_until(lambda: ledger_is_zero(session_daemon.admin_endpoint))


async def test_second_request_with_same_prefix_sees_overlap_when_routed_to_same_worker(session_daemon):
    async with SchedulerClient(session_daemon.endpoint) as client:
        hashes = [101, 102, 103, 104]
        a = await client.schedule("ov-a", isl_tokens=64, block_hashes=hashes)
        async with a:
            pass
        b = await client.schedule("ov-b", isl_tokens=64, block_hashes=hashes)
        async with b:
            pass
        assert b.worker == a.worker
        assert b.overlap_blocks == 4 and b.cached_tokens == 64


async def test_duplicate_request_rejected_when_id_is_live(session_daemon):
    async with SchedulerClient(session_daemon.endpoint) as client:
        lease = await client.schedule("dup-1", isl_tokens=10)
        with pytest.raises(DuplicateRequest):
            await client.schedule("dup-1", isl_tokens=10)
        lease.release()
        again = await client.schedule("dup-1", isl_tokens=10)  # reusable once released
        again.release()


async def test_invalid_rejected_when_more_hashes_than_isl_allows(session_daemon):
    async with SchedulerClient(session_daemon.endpoint) as client:
        with pytest.raises(InvalidRequest):
            await client.schedule("too-many", isl_tokens=16, block_hashes=[1, 2, 3])


async def test_no_endpoints_when_pinned_to_unknown_worker(session_daemon):
    async with SchedulerClient(session_daemon.endpoint) as client:
        with pytest.raises(NoEndpoints):
            await client.schedule("pin-x", isl_tokens=16, pinned=(99, 0))


async def test_pinned_request_runs_on_its_worker(session_daemon):
    async with SchedulerClient(session_daemon.endpoint) as client:
        lease = await client.schedule("pin-2", isl_tokens=16, pinned=(2, 0))
        assert lease.worker == (2, 0)
        lease.release()


async def test_requests_queue_when_all_workers_busy_and_dispatch_on_release(daemon):
    async with SchedulerClient(daemon.endpoint) as client:
        # busy threshold is 1000 prefill tokens per worker: one 1500-token prefill makes a worker busy
        a = await client.schedule("busy-a", isl_tokens=1500)
        b = await client.schedule("busy-b", isl_tokens=1500)
        assert {a.worker.worker_id, b.worker.worker_id} == {1, 2}
        waiting = asyncio.create_task(client.schedule("busy-c", isl_tokens=100))
        assert await asyncio.to_thread(wait_until, lambda: queued(daemon.admin_endpoint) == 1)
        assert not waiting.done()
        a.prefill_done()  # a's prefill leaves worker -> capacity change -> dispatch
        c = await asyncio.wait_for(waiting, 30)
        assert c.worker == a.worker
        for lease in (a, b, c):
            lease.release()
    assert wait_until(lambda: ledger_is_zero(daemon.admin_endpoint))


async def test_cancelled_waiter_sends_release_cancelled_and_leaves_queue(daemon):
    async with SchedulerClient(daemon.endpoint) as client:
        a = await client.schedule("cx-a", isl_tokens=1500)
        b = await client.schedule("cx-b", isl_tokens=1500)
        waiting = asyncio.create_task(client.schedule("cx-c", isl_tokens=100))
        assert await asyncio.to_thread(wait_until, lambda: queued(daemon.admin_endpoint) == 1)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        admin = AdminClient(daemon.admin_endpoint)
        assert wait_until(lambda: sum(c.depth for c in admin.call(p.Queues()).classes) == 0, 30)
        a.release()
        b.release()
        await asyncio.sleep(0.2)
        assert wait_until(lambda: ledger_is_zero(daemon.admin_endpoint))
        assert admin.call(p.Status()).active_leases == 0
        admin.close()


def test_malformed_frame_gets_error_and_daemon_keeps_serving_others(session_daemon):
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.connect(session_daemon.endpoint)
    dec = p.make_daemon_decoder()
    enc = p.make_encoder()
    try:
        bad.send(b"\xc1garbage")
        assert bad.poll(5000)
        err = dec.decode(bad.recv())
        assert isinstance(err, p.Error) and err.code == p.ErrorCode.MALFORMED
        bad.send(enc.encode(p.Enqueue("before-hello", 10)))  # before Hello
        assert bad.poll(5000)
        err = dec.decode(bad.recv())
        assert err.code == p.ErrorCode.NOT_HELLO and err.request_id == "before-hello"
        bad.send(enc.encode(p.Hello(99)))  # wrong protocol version
        assert bad.poll(5000)
        assert dec.decode(bad.recv()).code == p.ErrorCode.VERSION
        bad.send(enc.encode(p.Status()))  # admin frame on the data socket
        assert bad.poll(5000)
        assert dec.decode(bad.recv()).code == p.ErrorCode.ADMIN_ON_DATA_SOCKET
        bad.send_multipart([enc.encode(p.Heartbeat(1)), b"extra part"])  # several parts: answered, dropped
        assert bad.poll(5000)
        err = dec.decode(bad.recv())
        assert err.code == p.ErrorCode.MALFORMED and "2 parts" in err.message
        bad.send(enc.encode(p.Hello(p.PROTOCOL_VERSION)))  # the next frame is still served
        assert bad.poll(5000)
        assert isinstance(dec.decode(bad.recv()), p.Welcome)
    finally:
        bad.close(0)
        ctx.term()

    async def good() -> None:
        async with SchedulerClient(session_daemon.endpoint) as client:
            lease = await client.schedule("after-garbage", isl_tokens=32)
            lease.release()

    asyncio.run(good())


CLIENT_SCRIPT = textwrap.dedent("""
    import asyncio, sys
    from kvsched.client import SchedulerClient

    async def main(endpoint, tag, n):
        async with SchedulerClient(endpoint, client_name=tag) as client:
            async def one(i):
                lease = await client.schedule(f"{tag}-{i}", isl_tokens=64 + i, block_hashes=[i % 7, i])
                async with lease:
                    lease.dispatched(); lease.prefill_done(); lease.add_output_tokens(5)
                return lease.worker.worker_id
            workers = await asyncio.gather(*(one(i) for i in range(n)))
        print(sorted(set(workers)))

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
""")


def test_several_client_processes_complete_every_lifecycle_when_run_concurrently(daemon):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CLIENT_SCRIPT, daemon.endpoint, f"proc{k}", "100"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=os.environ.copy(),
        )
        for k in range(3)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err.decode()
        assert out.strip() in (b"[1]", b"[2]", b"[1, 2]")
    assert wait_until(lambda: ledger_is_zero(daemon.admin_endpoint))
    with AdminClient(daemon.admin_endpoint) as admin:
        status = admin.call(p.Status())
    assert status.active_leases == 0 and status.decisions_total >= 300


async def test_operator_cancel_answers_the_waiting_router_and_revokes_a_lease(daemon):
    """1. two leases fill both workers, 2. a third request waits, 3. `kvsched cancel` on the waiting
    one and on a lease. Result: the waiter gets RequestCancelled; the lease holder sees outcome
    "revoked", its `on_dropped` callback runs once and its progress calls raise LeaseRevoked (a
    LeaseLost: the caller must abort the request); release stays a quiet no-op; the ledger returns
    to zero."""
    from kvsched.errors import LeaseLost, LeaseRevoked, RequestCancelled

    async with SchedulerClient(daemon.endpoint) as client:
        a = await client.schedule("oc-a", isl_tokens=1500)
        b = await client.schedule("oc-b", isl_tokens=1500)
        dropped = []
        a.on_dropped(lambda lease: dropped.append(lease.outcome))
        waiting = asyncio.create_task(client.schedule("oc-c", isl_tokens=100))
        assert await asyncio.to_thread(wait_until, lambda: queued(daemon.admin_endpoint) == 1)
        with AdminClient(daemon.admin_endpoint) as admin:
            assert isinstance(admin.call(p.Cancel(request_id="oc-c")), p.OkReply)
            with pytest.raises(RequestCancelled):
                await asyncio.wait_for(waiting, 30)
            assert isinstance(admin.call(p.Cancel(request_id="oc-a")), p.OkReply)
        assert await asyncio.to_thread(wait_until, lambda: a.outcome == "revoked", 30)
        assert dropped == ["revoked"]
        for call in (lambda: a.add_output_tokens(5), a.dispatched, a.prefill_done):
            with pytest.raises(LeaseRevoked, match=r"oc-a.*revoked by an operator"):
                call()
        with pytest.raises(LeaseLost):
            await a.requeue()
        a.release()
        b.release()
    assert wait_until(lambda: ledger_is_zero(daemon.admin_endpoint))


def test_release_with_defaults_frees_the_senders_lease(session_daemon):
    with RawPeer(session_daemon.endpoint) as peer:
        peer.hello()
        peer.send(p.Enqueue("short-release", 32))
        assert isinstance(peer.recv(), p.Admitted)
        peer.send(p.make_encoder().encode(["release", "short-release"]))  # trailing defaults omitted
        with AdminClient(session_daemon.admin_endpoint) as admin:
            assert wait_until(lambda: admin.call(p.Status()).active_leases == 0, 30)


URL_WORKERS = """
[daemon]
block_size = 16

[[workers]]
worker_id = 1
url = "http://10.0.0.1:8000"

[[workers]]
worker_id = 2
dp_size = 2
url = "http://10.0.0.2:8000"
"""


async def test_admitted_carries_worker_url_and_dp_size_and_excluded_workers_are_skipped(tmp_path):
    d = start_daemon(tmp_path, URL_WORKERS)
    try:
        async with SchedulerClient(d.endpoint) as client:
            for i in range(4):
                lease = await client.schedule(f"u{i}", isl_tokens=16, excluded_workers=[1])
                assert lease.worker.worker_id == 2
                assert (lease.url, lease.dp_size) == ("http://10.0.0.2:8000", 2)
                lease.release("completed")
            lease = await client.schedule("u-one", isl_tokens=16, excluded_workers=[2])
            assert (lease.worker.worker_id, lease.url, lease.dp_size) == (1, "http://10.0.0.1:8000", 1)
            lease.release("completed")
            with AdminClient(d.admin_endpoint) as admin:
                admin.call(p.AddWorker(worker_id=7, url="http://10.0.0.7:9000"))
            lease = await client.schedule("u-new", isl_tokens=16, pinned=(7, 0))
            assert (lease.url, lease.dp_size) == ("http://10.0.0.7:9000", 1)
            lease.release("completed")
            with pytest.raises(PinnedNotAllowed):
                await client.schedule("u-pin", isl_tokens=16, pinned=(7, 0), excluded_workers=[7])
        assert wait_until(lambda: ledger_is_zero(d.admin_endpoint))
    finally:
        d.stop()
        purge(d.instance)
