"""`ConnectionTable.close_dead` / `died`: the routing ids of peers whose watched process died are
remembered (bounded, oldest forgotten first) so that frames they left buffered are dropped unread;
a peer that only went silent is forgotten without that memory."""

from __future__ import annotations

import os
import subprocess
import sys

from kvsched.daemon import connections
from kvsched.daemon.connections import ConnectionTable


def _gone_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_peer_whose_process_died_is_remembered_a_silent_one_is_not():
    table = ConnectionTable(liveness_timeout_us=1_000)
    dead, silent = table.open(b"dead", 0), table.open(b"silent", 0)
    dead.pid = _gone_pid()
    silent.pid = os.getpid()  # alive: only its silence ends it
    assert {c.identity for c in table.find_dead(10_000)} == {b"dead", b"silent"}
    for conn in table.find_dead(10_000):
        table.close_dead(conn)
    assert len(table) == 0 and not dead.alive and not silent.alive
    assert table.died(b"dead") and not table.died(b"silent") and not table.died(b"never-seen")


def test_the_memory_of_dead_ids_is_bounded_oldest_first(monkeypatch):
    monkeypatch.setattr(connections, "MAX_DEAD_IDS", 3)
    table = ConnectionTable(liveness_timeout_us=1_000)
    gone = _gone_pid()
    for i in range(5):
        conn = table.open(b"peer-%d" % i, 0)
        conn.pid = gone
        table.close_dead(conn)
    assert [table.died(b"peer-%d" % i) for i in range(5)] == [False, False, True, True, True]


def test_a_dead_peer_is_told_once_why_its_frames_are_dropped():
    """Found from outside: a connection whose Hello named a pid that is not running was reaped at once
    and every later frame on it was dropped without an answer (a third-party client that sent a wrong
    pid waited forever). Result: the first frame after the reap gets a notice naming the pid; later
    ones are dropped silently (a dead router's buffered frames must not each cost a reply)."""
    table = ConnectionTable(liveness_timeout_us=1_000)
    dead = table.open(b"dead", 0)
    dead.pid = dead.hello_pid = _gone_pid()
    for conn in table.find_dead(10_000):
        table.close_dead(conn)
    notice = table.dead_notice(b"dead")
    assert notice is not None and f"pid {dead.hello_pid}" in notice and "not running" in notice
    assert table.dead_notice(b"dead") is None and table.died(b"dead")
    assert table.dead_notice(b"never-seen") is None
