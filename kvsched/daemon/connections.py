"""Peers of the data socket: identity → connection, liveness (heartbeats and pid watch), ownership.

Liveness, never wall-clock age of a lease, ends a router's leases (docs/PROTOCOL.md, "Liveness"): a
connection is dead when nothing credited it for `liveness_timeout_ms` — no frame from it, and no
heartbeat naming its `conn_token` from the client's heartbeat DEALER (`credit`) — or when the local
process named in its `Hello.pid` no longer exists. The token is issued at Hello (`Welcome.conn_token`)
and forgotten with the connection; a heartbeat DEALER is never a connection of its own. The pid is
watched only when the peer runs on this host *and* in this PID namespace (`Hello.pid_ns` equals the
inode of our `/proc/self/ns/pid`): a router in a container or sidecar sharing the host name has pids
that mean nothing here (pid_namespaces(7)).
The inode alone is not enough, every host's initial namespace has the same one, hence the host check.
The actor then calls `Scheduler.cancel_owner(owner)`.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from dataclasses import dataclass

from ..core.types import DAEMON_OWNER

log = logging.getLogger(__name__)

_HOSTNAME = socket.gethostname()
# A daemon stall at least this share of the liveness timeout is not counted as the peers' silence
# (`ConnectionTable.credit_stall`); heartbeats come at most every half timeout, so a shorter stall
# cannot make a live peer look dead.
STALL_CREDIT_SHARE = 0.25


def pid_namespace_id() -> int:
    """Inode number of this process's PID namespace (`/proc/self/ns/pid`), or 0 when unreadable."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


_PID_NS = pid_namespace_id()

MAX_DEAD_IDS = 65_536  # routing ids of dead watched peers remembered (frames from them are dropped)


@dataclass(slots=True)
class Connection:
    """One router connection (the data DEALER of one router process; its heartbeat DEALER is none).

    Attributes:
        identity: the ROUTER routing id of the peer (bytes).
        owner: small int the core uses as the owner of requests and leases.
        protocol_version: from Hello; 0 until Hello arrived.
        pid: the peer's pid when it is a process of this host and PID namespace (pid watch on), else 0.
        hello_pid / pid_ns: the pid and PID-namespace inode the peer announced (logs, same-process
            checks), watched or not.
        client_name / host: from Hello, for logs and `kvsched status`.
        last_seen_us: monotonic time of the last frame received (µs), moved forward by the time the
            daemon itself could not read (`ConnectionTable.credit_stall`).
        inflight: Enqueues answered by neither Admitted nor Rejected yet.
        conn_token: the token its `Welcome` named (non-zero from Hello on): heartbeats that carry it
            credit this connection, from whichever socket they come.
    """

    identity: bytes
    owner: int
    protocol_version: int = 0
    pid: int = 0
    hello_pid: int = 0
    pid_ns: int = 0
    client_name: str = ""
    host: str = ""
    last_seen_us: int = 0
    inflight: int = 0
    alive: bool = True
    conn_token: int = 0


class ConnectionTable:
    """All known data-socket peers; owner ids are never reused within one daemon run and never
    `DAEMON_OWNER` (they count from 1)."""

    def __init__(self, liveness_timeout_us: int) -> None:
        self.liveness_timeout_us = liveness_timeout_us
        self._by_identity: dict[bytes, Connection] = {}
        self._by_owner: dict[int, Connection] = {}
        self._by_token: dict[int, Connection] = {}
        self._next_owner = DAEMON_OWNER + 1
        # Routing ids of peers whose watched process died: frames they left buffered are dropped
        # unread (a flood must not keep the daemon busy after its sender is gone). Bounded, FIFO.
        self._dead_ids: dict[bytes, int | None] = {}  # identity -> pid not yet told (None: told)
        # Routing ids of peers reaped for silence (bounded, FIFO): a frame one sends afterwards is
        # told why it must say Hello again (`not_hello_reason`).
        self._silent_ids: dict[bytes, bool] = {}

    def __len__(self) -> int:
        return len(self._by_identity)

    def get(self, identity: bytes) -> Connection | None:
        return self._by_identity.get(identity)

    def by_owner(self, owner: int) -> Connection | None:
        return self._by_owner.get(owner)

    def open(self, identity: bytes, now_us: int) -> Connection:
        """Register a peer (first frame seen). Returns the new connection."""
        conn = Connection(identity=identity, owner=self._next_owner, last_seen_us=now_us)
        self._next_owner += 1
        self._by_identity[identity] = conn
        self._by_owner[conn.owner] = conn
        return conn

    def close(self, conn: Connection) -> None:
        """Forget a peer; its owner id stays unused forever."""
        conn.alive = False
        self._by_identity.pop(conn.identity, None)
        self._by_owner.pop(conn.owner, None)
        self._by_token.pop(conn.conn_token, None)

    def close_dead(self, conn: Connection) -> None:
        """Forget a peer found dead (`find_dead`); when its watched process is gone, its routing id is
        remembered (the last `MAX_DEAD_IDS`, FIFO) so that `died` drops what it left buffered."""
        if conn.pid and not pid_exists(conn.pid):
            self._dead_ids[conn.identity] = conn.pid  # cleared once `dead_notice` told the peer
            if len(self._dead_ids) > MAX_DEAD_IDS:
                del self._dead_ids[next(iter(self._dead_ids))]
        else:
            self._silent_ids[conn.identity] = True
            if len(self._silent_ids) > MAX_DEAD_IDS:
                del self._silent_ids[next(iter(self._silent_ids))]
        self.close(conn)

    def not_hello_reason(self, identity: bytes) -> str:
        """The error text for a frame before Hello from `identity`: says, for a peer reaped for
        silence, that it was declared dead and what was released (forgotten once it is told)."""
        if not self._silent_ids.pop(identity, False):
            return "send Hello first"
        return (
            f"send Hello first: this connection was declared dead after more than "
            f"{self.liveness_timeout_us // 1000} ms without a frame (liveness_timeout_ms) and its leases "
            "and waiting requests were released; open a new connection, Hello and Reattach"
        )

    def dead_notice(self, identity: bytes) -> str | None:
        """The error text owed the first frame that arrives from a peer `close_dead` found dead (its
        Hello may have named a wrong pid: then it is listening), or None: told already, or not dead."""
        pid = self._dead_ids.get(identity)
        if pid is None:
            return None
        self._dead_ids[identity] = None
        return (
            f"send Hello first: this connection was closed because the process its Hello named (pid {pid} on "
            "this host) is not running; its leases and waiting requests were released and its frames are "
            "dropped from now on. Open a new connection whose Hello names this process's pid (or 0)"
        )

    def died(self, identity: bytes) -> bool:
        """True when `identity` is a remembered peer whose process died (`close_dead`)."""
        return identity in self._dead_ids

    def owner_alive(self, owner: int) -> bool:
        """Predicate handed to the Scheduler (`admit_one` skips dead requesters). `DAEMON_OWNER` is
        the daemon itself (e.g. leases re-adopted after a restart) and always alive."""
        if owner == DAEMON_OWNER:
            return True
        conn = self._by_owner.get(owner)
        return conn is not None and conn.alive

    def same_process(self, a: int, b: int) -> bool:
        """Predicate handed to the Scheduler (Reattach takeover): are owners `a` and `b` connections
        of one process — same announced pid (non-zero), host and PID namespace? A reconnecting
        client's new connection may then claim what its earlier connection held."""
        ca, cb = self._by_owner.get(a), self._by_owner.get(b)
        return (
            ca is not None
            and cb is not None
            and ca.hello_pid != 0
            and ca.hello_pid == cb.hello_pid
            and ca.host == cb.host
            and ca.pid_ns == cb.pid_ns
        )

    def hello(self, conn: Connection, version: int, pid: int, client_name: str, host: str, pid_ns: int = 0) -> None:
        """Record a Hello; the pid is watched only for peers on this host and in this PID namespace
        (`pid_ns` = the inode of the peer's /proc/self/ns/pid; 0 = unknown, never watched)."""
        conn.protocol_version = version
        conn.client_name = client_name
        conn.host = host
        conn.hello_pid, conn.pid_ns = pid, pid_ns
        same_ns = pid_ns != 0 and pid_ns == _PID_NS and host == _HOSTNAME
        conn.pid = pid if (pid > 0 and same_ns) else 0
        while not conn.conn_token:  # 63 random bits: no other peer can guess it, 0 means "none"
            token = secrets.randbits(63)
            if token not in self._by_token:
                conn.conn_token = token
                self._by_token[token] = conn

    def credit(self, conn_token: int, now_us: int) -> Connection | None:
        """A heartbeat naming `conn_token` arrived at `now_us` (µs): the connection it names counts as
        heard from. Returns that connection, or None when no open connection has the token (closed,
        reaped, from before a daemon restart, or made up): then nothing changes."""
        conn = self._by_token.get(conn_token)
        if conn is not None:
            conn.last_seen_us = max(conn.last_seen_us, now_us)
        return conn

    def credit_stall(self, stall_us: int, now_us: int) -> bool:
        """The daemon read nothing for `stall_us` µs (its periodic timer ran that late: the loop was
        blocked or the process not scheduled). Frames peers sent meanwhile sit unread, and after a
        stall the timer (and so the reaper) runs before the socket is read: a stall of at least
        `STALL_CREDIT_SHARE` of the liveness timeout is not counted as anyone's silence. Every
        `last_seen_us` moves forward by `stall_us`, never past `now_us`; returns True when it did.

        Without it a daemon resuming from a stall longer than the liveness timeout reaps every peer
        before reading the heartbeats they sent all along (liveness is "nothing arrived from it",
        docs/PROTOCOL.md "Lifecycle", docs/DESIGN.md §5.4). A peer that is really gone is reaped
        `stall_us` later. Shorter
        lateness is a busy loop that still reads between timers: not credited, so overload does not
        postpone reaping. O(connections), only after a stall."""
        if stall_us < self.liveness_timeout_us * STALL_CREDIT_SHARE:
            return False
        for conn in self._by_identity.values():
            conn.last_seen_us = min(now_us, conn.last_seen_us + stall_us)
        return True

    def find_dead(self, now_us: int) -> list[Connection]:
        """Connections silent past the liveness timeout or whose local process is gone."""
        dead = []
        for conn in self._by_identity.values():
            if now_us - conn.last_seen_us > self.liveness_timeout_us or (conn.pid and not pid_exists(conn.pid)):
                dead.append(conn)
        return dead

    def __iter__(self):
        return iter(list(self._by_identity.values()))


def pid_exists(pid: int) -> bool:
    """`kill(pid, 0)`: True when the process exists (EPERM means it exists but is not ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
