"""`PendingCalls` (the client's book of waiting calls) against the rules the client relies on: each
answer reaches its own call, `shutting_down` parks a call, the `Reattach` re-sends exactly the calls
still waiting (requeues with their original Enqueue), and the reconnect deadline resolves the rest."""

from __future__ import annotations

import asyncio

import pytest

from kvsched import protocol as p
from kvsched.client.pending import BYPASS, PendingCalls
from kvsched.errors import DaemonUnavailable, ShuttingDown


def admitted(rid: str, slot: int = 3) -> p.Admitted:
    return p.Admitted(rid, 1, 0, slot, 7, 0, 0, 0)


async def test_answers_reach_their_own_call_and_shutting_down_parks():
    book = PendingCalls()
    loop = asyncio.get_running_loop()
    a, b, c = loop.create_future(), loop.create_future(), loop.create_future()
    book.open("a", a, p.Enqueue("a", 10), 10)
    book.open("b", b, p.Enqueue("b", 10), 10)
    book.open("c", c, p.Enqueue("c", 10), 10)
    with pytest.raises(ValueError):
        book.open("a", loop.create_future(), p.Enqueue("a", 10), 10)
    assert book.answer(admitted("b"))
    assert b.result().request_id == "b" and not a.done()
    assert book.answer(p.Rejected("c", "shutting_down"))  # taken, but the call keeps waiting
    assert not c.done()
    assert not book.answer(admitted("nobody"))  # the client gives it back
    assert not book.answer(admitted("b"))  # already answered: a second answer is not taken
    assert book.fail("a", DaemonUnavailable("x")) and isinstance(a.exception(), DaemonUnavailable)
    book.expire("gone", bypass=False)
    assert isinstance(c.exception(), ShuttingDown)  # parked: the daemon stopped and none came back


async def test_reattach_resends_waiting_enqueues_and_requeues_with_their_origin():
    book = PendingCalls()
    loop = asyncio.get_running_loop()
    origin = p.Enqueue("r", 40, policy_class="gold")
    book.origins["r"] = origin  # an admitted lease being requeued
    waiting, requeue, answered = loop.create_future(), loop.create_future(), loop.create_future()
    book.open("w", waiting, p.Enqueue("w", 10), 10)
    book.open("r", requeue, p.Update("r", 5, 2, "requeue"), 40)
    book.open("x", answered, p.Enqueue("x", 10), 10)
    book.answer(admitted("x"))
    book.answer(p.Rejected("w", "shutting_down"))
    frame = book.reattach([p.LeaseRef("open", 1, 1)])
    assert frame.leases == [p.LeaseRef("open", 1, 1)]
    assert [e.request_id for e in frame.pending] == ["w"]  # "x" is answered: not re-sent
    assert frame.requeues == [p.Requeued(p.LeaseRef("r", 5, 2), origin)]
    book.expire("gone", bypass=False)  # "w" was re-sent by the Reattach: no longer parked
    assert isinstance(waiting.exception(), DaemonUnavailable) and not isinstance(waiting.exception(), ShuttingDown)


async def test_bypass_expiry_and_close():
    book = PendingCalls()
    loop = asyncio.get_running_loop()
    a, b = loop.create_future(), loop.create_future()
    book.open("a", a, p.Enqueue("a", 10), 10)
    book.expire("gone", bypass=True)
    assert a.result() is BYPASS
    assert book.close("a") is not None and "a" not in book and book.close("a") is None
    book.open("b", b, p.Enqueue("b", 10), 10)
    book.fail_all()
    assert isinstance(b.exception(), DaemonUnavailable) and len(book) == 0
