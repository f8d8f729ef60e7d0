"""The one edge-triggered ZeroMQ read (`daemon/reader.py`) over a real inproc PAIR of sockets."""

from __future__ import annotations

import asyncio

import zmq

from kvsched.daemon.reader import Reader, read_some, readable


def _pair(name: str) -> tuple[zmq.Context, zmq.Socket, zmq.Socket]:
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind(f"inproc://{name}")
    b.connect(f"inproc://{name}")
    return ctx, a, b


def test_read_some_reads_at_most_its_budget_and_stops_when_the_handler_closes_the_socket():
    ctx, a, b = _pair("read-some")
    try:
        for i in range(5):
            b.send_multipart([b"m", str(i).encode()])
        got: list[bytes] = []
        assert read_some(a, 3, lambda parts: got.append(parts[1])) == 3
        assert got == [b"0", b"1", b"2"] and readable(a)
        assert read_some(a, 3, lambda parts: (got.append(parts[1]), a.close(0))) == 1  # closed by the handler
        assert got == [b"0", b"1", b"2", b"3"]
        b.close(0)
    finally:
        ctx.term()


async def test_a_reader_keeps_one_wake_queued_and_none_once_stopped():
    """Three asks for a wake before the loop turns run one drain; a drain that asks again gets the
    next turn; a stopped reader runs no queued wake and queues none."""
    ctx, a, b = _pair("reader-once")
    drains: list[int] = []
    again = [True]

    def drain() -> bool:
        drains.append(read_some(a, 1, lambda parts: None))
        return again[0]

    reader = Reader(asyncio.get_running_loop(), a, drain)
    try:
        for _ in range(2):
            b.send(b"x")
        for _ in range(3):
            reader.wake_soon()
        await asyncio.sleep(0)
        assert drains == [1]  # one drain for three asks; it asked for the next turn
        again[0] = False
        await asyncio.sleep(0)
        assert drains == [1, 1]
        await asyncio.sleep(0)
        assert drains == [1, 1]  # it asked for none
        reader.wake_soon()
        reader.stop()
        reader.wake_soon()
        reader.wake()
        await asyncio.sleep(0)
        assert drains == [1, 1]
    finally:
        reader.stop()
        a.close(0)
        b.close(0)
        ctx.term()
