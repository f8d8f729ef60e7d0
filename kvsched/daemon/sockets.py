"""ZeroMQ endpoints of the daemon: bind, socket options, file modes of ipc sockets, CURVE.

No policy here: the actor decides what to do with frames; this module only opens and closes sockets.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from pathlib import Path

import zmq
from zmq.auth import CURVE_ALLOW_ANY
from zmq.auth.thread import ThreadAuthenticator

from ..endpoints import is_loopback_endpoint
from ..errors import ConfigError

log = logging.getLogger(__name__)

DATA_SOCKET_MODE = 0o660  # routers' group may connect
ADMIN_SOCKET_MODE = 0o600  # only the daemon's user


_BOUND_INODES: dict[str, int] = {}  # ipc path -> inode of the socket file this process bound


def _ipc_in_use(path: Path) -> bool:
    """True when a process is listening on the Unix socket at `path` (a live daemon)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(0.5)
        probe.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        probe.close()


def remove_stale_ipc(endpoint: str) -> Path | None:
    """Unlink the socket file of an `ipc://` endpoint that a daemon killed without a clean stop left
    behind; returns its path, or None when there was nothing to remove.

    Only a socket file, and only one no process listens on (a connect probe, `_ipc_in_use`): a live
    daemon's socket, even another instance's at the same path, and a regular file are left alone.
    The caller holds the instance lock, so this instance's daemon cannot be binding it meanwhile.
    """
    path = ipc_path(endpoint)
    try:
        if path is None or not stat.S_ISSOCK(path.lstat().st_mode) or _ipc_in_use(path):
            return None
        path.unlink()
    except FileNotFoundError:
        return None
    return path


def ipc_path(endpoint: str) -> Path | None:
    """The filesystem path of an `ipc://` endpoint, else None."""
    if endpoint.startswith("ipc://"):
        return Path(endpoint[len("ipc://") :])
    return None


def transport_cut(max_frame_bytes: int) -> int:
    """ZMQ_MAXMSGSIZE of the data socket, bytes: twice `max_frame_bytes` plus 64 KiB.

    A message between `max_frame_bytes` and this cut reaches the actor, which answers its sender
    `error{code=4 oversized}` naming both sizes (docs/PROTOCOL.md "Transport"); only a message beyond
    the cut makes libzmq drop the connection, unanswered. Reading up to the cut bounds what one
    message can cost the daemon in memory.
    """
    return 2 * max_frame_bytes + (64 << 10)


PEER_QUEUE_BUDGET_BYTES = 64 << 20  # what one peer may make libzmq queue for the daemon to read
MIN_HWM = 8  # messages: below this libzmq pauses and resumes a peer for every few messages
# Messages: the send mark's floor. A version-1 peer gets one message per reply, up to a wake's
# `frame_budget_per_wake` (512) and more in a burst, and a sending socket sees what libzmq's I/O thread
# drained only when it processes its commands (throttled to about once a millisecond), so a smaller
# mark would refuse (EAGAIN) replies to a peer that does read them.
REPLY_BURST_MESSAGES = 1024


def peer_hwm(max_message_bytes: int) -> int:
    """The per-peer receive high-water mark (messages) of a daemon ROUTER: the most messages of
    up to `max_message_bytes` that fit `PEER_QUEUE_BUDGET_BYTES` (64 MiB), at least `MIN_HWM` (8).

    ZeroMQ counts its queues in messages (zmq_setsockopt(3), ZMQ_RCVHWM/ZMQ_SNDHWM, per peer), so the
    byte bound is this count times the largest message: 31 messages of up to the data socket's
    2 MiB + 64 KiB transport cut with the default `max_frame_bytes` (1 MiB). docs/DESIGN.md §5.3.
    """
    return max(MIN_HWM, PEER_QUEUE_BUDGET_BYTES // max(1, max_message_bytes))


def peer_send_hwm(max_message_bytes: int) -> int:
    """The per-peer send high-water mark (messages) of a daemon ROUTER: `peer_hwm`, at least
    `REPLY_BURST_MESSAGES` (1024) so one wake's replies to a version-1 peer are never refused.

    The replies queued for a peer grow only once that peer's own ZeroMQ stops reading them (its
    process stopped, or its receive queue full: 100,000 messages for the reference client), and a
    reply message holds what one wake owes the peer (tens of KiB for a wake of 512 frames; at most
    `max_frame_bytes`). docs/DESIGN.md §5.3.
    """
    return max(REPLY_BURST_MESSAGES, peer_hwm(max_message_bytes))


def bind_router(
    ctx: zmq.Context,
    endpoint: str,
    *,
    mode: int,
    max_frame_bytes: int,
    curve_secret_key: bytes | None = None,
    heartbeat_ms: int = 1000,
) -> zmq.Socket:
    """Bind a ROUTER socket the daemon's actor will read with NOBLOCK.

    Sets `ROUTER_MANDATORY` (an unroutable reply raises EHOSTUNREACH, so the actor can release an
    undeliverable `Admitted`), `MAXMSGSIZE` (oversized frames drop the peer), TCP keepalive, and
    per-peer high-water marks (`peer_hwm`, `peer_send_hwm`): the receive mark bounds in bytes what
    one peer can make libzmq queue in the daemon; a peer that sends faster than the actor reads is
    paused by libzmq and its own sends then meet its own SNDHWM (back-pressure, nothing lost). A peer
    that stops reading its replies past the send mark gets the rest refused (EAGAIN: the outbox drops
    them, and the actor releases each undelivered `Admitted`).

    No ZMTP heartbeats (`ZMQ_HEARTBEAT_IVL`): libzmq 4.3.x aborts the whole process with "Assertion
    failed: !_io_error (stream_engine_base.cpp)" when a connection whose input is paused by a full
    receive queue (one peer flooding past `RCVHWM` while the actor reads) times out its heartbeat and
    is then resumed (zeromq/libzmq issues 3937 and 4767). Peers' liveness is the daemon's own rule
    (docs/PROTOCOL.md "Liveness"); a TCP peer whose host vanished is noticed by the kernel's
    keepalive probes instead, which close its pipe.

    Args:
        endpoint: `ipc://PATH` or `tcp://HOST:PORT`.
        mode: file mode applied to an ipc socket file (0o660 data, 0o600 admin).
        max_frame_bytes: ZMQ_MAXMSGSIZE, bytes; also the largest message the high-water marks are
            sized for (`peer_hwm`).
        curve_secret_key: z85 secret key; required for a non-loopback TCP endpoint.
        heartbeat_ms: the daemon's heartbeat period (ms); TCP keepalive probes start after 3 periods
            of silence and repeat every period (whole seconds, at least 1), 3 unanswered close it.
    Raises:
        ConfigError: a non-loopback TCP endpoint without CURVE keys, or a bind failure.
    """
    if endpoint.startswith("tcp://") and not is_loopback_endpoint(endpoint) and curve_secret_key is None:
        raise ConfigError(
            f"endpoint {endpoint}: a TCP endpoint not bound to loopback requires "
            "daemon.curve_secret_key_file (CURVE keys)"
        )
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, peer_send_hwm(max_frame_bytes))
    sock.setsockopt(zmq.RCVHWM, peer_hwm(max_frame_bytes))
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, max(1, 3 * heartbeat_ms // 1000))
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, max(1, heartbeat_ms // 1000))
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)
    if curve_secret_key is not None:
        sock.curve_secretkey = curve_secret_key
        sock.curve_publickey = zmq.curve_public(curve_secret_key)
        sock.curve_server = True
    path = ipc_path(endpoint)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        if path.exists():
            if _ipc_in_use(path):
                sock.close(0)
                raise ConfigError(f"endpoint {endpoint} is in use by another running process")
            path.unlink()  # a stale socket file from a crashed daemon
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise ConfigError(f"cannot bind {endpoint}: {exc}") from exc
    if path is not None:
        os.chmod(path, mode)
        _BOUND_INODES[str(path)] = path.stat().st_ino
    log.info("bound endpoint=%s mode=%o", endpoint, mode)
    return sock


def close_socket(sock: zmq.Socket, endpoint: str) -> None:
    """Close a socket and remove its ipc file (only if it is still ours)."""
    sock.close(0)
    path = ipc_path(endpoint)
    if path is not None:
        try:
            if path.stat().st_ino == _BOUND_INODES.pop(str(path), None):  # never someone else's file
                path.unlink()
        except FileNotFoundError:
            pass


def load_curve_secret(path: str | None) -> bytes | None:
    """Read a z85 CURVE secret key (the 40-char key, or a pyzmq `.key_secret` certificate file)."""
    if not path:
        return None
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ConfigError(f"daemon.curve_secret_key_file {path}: {exc.strerror}") from exc
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("secret-key"):
            return line.split("=", 1)[1].strip().strip('"').encode()
        if len(line) == 40:
            return line.encode()
    raise ConfigError(f"daemon.curve_secret_key_file {path}: no z85 secret key found")


def start_curve_auth(
    ctx: zmq.Context, secret_key: bytes | None, authorized_keys_dir: str | None
) -> ThreadAuthenticator | None:
    """Start pyzmq's CURVE authenticator for this context when a server key is configured.

    Args:
        secret_key: the server's z85 secret key, or None (no CURVE: returns None).
        authorized_keys_dir: directory of client public-key certificates (pyzmq `*.key` files); None
            lets any client that knows the server's public key connect.
    Returns:
        The running `ThreadAuthenticator` (call `.stop()` at shutdown), or None.
    """
    if secret_key is None:
        return None

    auth = ThreadAuthenticator(ctx)
    auth.start()
    if authorized_keys_dir:
        auth.configure_curve(domain="*", location=authorized_keys_dir)
    else:
        auth.configure_curve(domain="*", location=CURVE_ALLOW_ANY)
    log.info(
        "CURVE authentication on authorized_keys_dir=%s", authorized_keys_dir or "<any client with the server key>"
    )
    return auth
