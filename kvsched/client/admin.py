"""`AdminClient`: synchronous request/reply over the daemon's admin socket (used by the CLI and tests)."""

from __future__ import annotations

import msgspec
import zmq

from .. import protocol as p
from ..endpoints import admin_endpoint, connect_problem, missing_ipc_path
from ..errors import DaemonUnavailable, ProtocolError


class AdminClient:
    """One DEALER to the admin socket; `call(request)` sends one admin frame and waits for its reply.

    Args:
        endpoint: admin socket; None = discovery (`KVSCHED_ADMIN_ENDPOINT`, else `<instance>-admin.sock`).
        timeout_s: seconds to wait for a reply before `DaemonUnavailable`.
    Raises:
        ValueError: a malformed endpoint (names what is wrong), before any socket is made.
    """

    def __init__(self, endpoint: str | None = None, *, instance: str = "default", timeout_s: float = 5.0) -> None:
        self.endpoint = endpoint or admin_endpoint(instance)
        problem = connect_problem(self.endpoint)
        if problem is not None:  # else pyzmq raises a bare ZMQError ("Invalid argument")
            raise ValueError(
                f"bad kvsched admin endpoint {self.endpoint!r}: {problem}; use ipc://PATH or tcp://HOST:PORT"
            )
        self.timeout_s = timeout_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(self.endpoint)
        self._enc = p.make_encoder()
        self._dec: msgspec.msgpack.Decoder[p.AdminReply] = p.make_admin_reply_decoder()

    def call(self, request: p.AdminRequest) -> p.AdminReply:
        """Send `request`, return the reply (an `AdminError` reply is returned, not raised).

        Raises:
            DaemonUnavailable: no reply within `timeout_s`, or at once when the endpoint is an ipc
                socket file that does not exist (no daemon bound it); names the endpoint.
            ProtocolError: the reply does not decode.
        """
        missing = missing_ipc_path(self.endpoint)
        if missing is not None:
            raise DaemonUnavailable(
                f"no kvsched daemon at {self.endpoint}: socket file {missing} does not exist "
                "(daemon not running, or another --instance / runtime directory)"
            )
        self._sock.send(self._enc.encode(request))
        if not self._sock.poll(int(self.timeout_s * 1000), zmq.POLLIN):
            self.close()
            raise DaemonUnavailable(f"no kvsched daemon answered at {self.endpoint} within {self.timeout_s:.1f}s")
        raw = self._sock.recv()
        try:
            return self._dec.decode(raw)
        except Exception as exc:
            raise ProtocolError(f"undecodable admin reply: {exc}") from exc

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(0)
            self._ctx.term()

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
