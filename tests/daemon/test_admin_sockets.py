"""The admin socket answers both ZeroMQ request socket types a user may try (a real daemon process).

A DEALER's message is [request]; a REQ adds an empty delimiter frame ([b"", request]) and only accepts
a reply that carries it back (ZeroMQ RFC 28). docs/PROTOCOL.md "Admin socket".
"""

from __future__ import annotations

import pytest
import zmq

from kvsched import protocol as p
from tests.conftest import daemon_fixture

pytestmark = pytest.mark.timeout(90)

ONE_WORKER = """
[daemon]
block_size = 16

[[workers]]
worker_id = 4
"""

daemon = daemon_fixture(ONE_WORKER)


def _socket(ctx: zmq.Context, kind: int, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock


def test_plain_req_socket_gets_answers_in_lockstep(daemon):
    """A REQ socket (a user's first try) gets each reply; a REQ that could not be answered would
    block its next send, so three calls in a row prove every reply carried the envelope back."""
    enc, dec = p.make_encoder(), p.make_admin_reply_decoder()
    with zmq.Context() as ctx:
        sock = _socket(ctx, zmq.REQ, daemon.admin_endpoint)
        try:
            for req in (p.Status(), p.Workers(), b"\x93not admin"):
                sock.send(req if isinstance(req, bytes) else enc.encode(req))
                assert sock.poll(10_000), f"no reply to {req!r} on a REQ socket"
                replies = sock.recv_multipart()
                assert len(replies) == 1
                replies_obj = dec.decode(replies[0])
                if isinstance(req, p.Status):
                    assert isinstance(replies_obj, p.StatusReply)
                elif isinstance(req, p.Workers):
                    assert [w.worker_id for w in replies_obj.workers] == [4]
                else:
                    assert isinstance(replies_obj, p.AdminError) and replies_obj.code == p.ErrorCode.MALFORMED
        finally:
            sock.close(0)


def test_dealer_multipart_request_gets_a_clear_error_and_dealer_still_works(daemon):
    enc, dec = p.make_encoder(), p.make_admin_reply_decoder()
    with zmq.Context() as ctx:
        sock = _socket(ctx, zmq.DEALER, daemon.admin_endpoint)
        try:
            sock.send_multipart([b"x", enc.encode(p.Status())])
            assert sock.poll(10_000)
            err = dec.decode(sock.recv())
            assert isinstance(err, p.AdminError) and err.code == p.ErrorCode.MALFORMED
            assert "DEALER" in err.message and "REQ" in err.message
            sock.send(enc.encode(p.Status()))
            assert sock.poll(10_000)
            assert isinstance(dec.decode(sock.recv()), p.StatusReply)
        finally:
            sock.close(0)


def test_req_socket_on_the_data_socket_is_told_to_use_dealer(daemon):
    """A REQ on the data socket cannot work (the daemon sends unsolicited frames), but it must not
    wait forever: it gets `error{code=1}` naming DEALER. Before: dropped in silence."""
    enc, dec = p.make_encoder(), p.make_daemon_decoder()
    with zmq.Context() as ctx:
        sock = _socket(ctx, zmq.REQ, daemon.endpoint)
        try:
            sock.send(enc.encode(p.Hello(p.PROTOCOL_VERSION, "req-user")))
            assert sock.poll(10_000), "a REQ on the data socket got no answer"
            err = dec.decode(sock.recv())
            assert isinstance(err, p.Error) and err.code == p.ErrorCode.MALFORMED and "DEALER" in err.message
        finally:
            sock.close(0)


def test_dealer_multipart_message_on_the_data_socket_gets_an_error_and_dealer_still_works(daemon):
    """A data-socket message is one frame; a DEALER that sends several parts gets `error{code=1}`
    naming the part count (before: counted as malformed and dropped in silence), then keeps working."""
    enc, dec = p.make_encoder(), p.make_daemon_decoder()
    with zmq.Context() as ctx:
        sock = _socket(ctx, zmq.DEALER, daemon.endpoint)
        try:
            sock.send_multipart([b"\x00", b"extra"])
            assert sock.poll(10_000), "a multipart message on the data socket got no answer"
            err = dec.decode(sock.recv())
            assert isinstance(err, p.Error) and err.code == p.ErrorCode.MALFORMED and "2 parts" in err.message
            sock.send(enc.encode(p.Hello(p.PROTOCOL_VERSION, "after-multipart")))
            assert sock.poll(10_000)
            assert isinstance(dec.decode(sock.recv()), p.Welcome)
        finally:
            sock.close(0)
