"""Requests the gateway must answer with an OpenAI-style 400 (not a 500 with a traceback), seen
over HTTP against a real daemon and a scripted engine."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from .conftest import scripted_daemon_fixture
from .helpers import health_stats, stream_chat

daemon = scripted_daemon_fixture({1: 1}, scope="module")


async def _raw_post(url: str, path: str, body: bytes, extra_header: bytes) -> tuple[int, dict | str]:
    """POST with one header line sent as raw bytes (a value aiohttp clients cannot send); returns
    (status, the JSON answer or its text)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"%s\r\nConnection: close\r\n\r\n%s" % (path.encode(), host.encode(), len(body), extra_header, body)
        )
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 30)
    finally:
        writer.close()
    head, _, payload = raw.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(payload)
    except ValueError:
        return status, payload.decode(errors="replace")


async def _post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict | str]:
    """(status, the JSON answer, or its text when it is not JSON: aiohttp's plain-text 500)."""
    async with aiohttp.ClientSession() as s, s.post(url + path, json=body, headers=headers or {}) as resp:
        text = await resp.text()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


async def test_a_content_part_whose_text_is_not_a_string_is_a_400_naming_it(stack):
    _gw, url, engines, _ = stack
    for text in (5, None):
        body = {
            "model": "tiny",
            "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
        }
        status, answer = await _post(url, "/v1/chat/completions", body)
        assert status == 400, answer
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] == "invalid_request"
        assert "messages[0].content[0].text must be a string" in answer["error"]["message"]
    status, answer = await _post(
        url,
        "/v1/chat/completions",
        {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": ["w1"]}]},
    )
    assert status == 400 and "messages[0].content[0] must be a content part object" in answer["error"]["message"]
    assert engines[1].seen == []  # none of them was scheduled or forwarded


async def test_max_tokens_beside_a_null_max_completion_tokens_is_the_one_forwarded_and_booked(stack):
    """Before: the null hid max_tokens, the gateway put its 256-token default in the engine's body."""
    _gw, url, engines, _ = stack
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "max_completion_tokens": None,
        "messages": [{"role": "user", "content": "w1 w2"}],
    }
    status, answer = await _post(url, "/v1/chat/completions", body)
    assert status == 200, answer
    assert engines[1].seen[-1]["body"]["max_tokens"] == 2


async def test_a_hint_header_that_is_not_utf8_is_a_400_naming_it(stack):
    """aiohttp decodes such bytes with surrogateescape; the value reached the daemon link, which
    failed to encode it (a 500 with a traceback)."""
    gw, url, _engines, _ = stack
    body = json.dumps({"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "w1 w2"}]}).encode()
    for header in (b"X-Kvsched-Class: \xff\xfe", b"X-Kvsched-Session-Id: \xff\xfe\xc3\xa9"):
        name = header.split(b":")[0].decode()
        status, answer = await _raw_post(url, "/v1/chat/completions", body, header)
        assert status == 400, (header, answer)
        assert answer["error"]["code"] == "invalid_header" and answer["error"]["type"] == "invalid_request_error"
        assert f"header {name} is not valid UTF-8 text" == answer["error"]["message"]
    # valid UTF-8 outside ASCII is a name like any other
    status, answer = await _raw_post(url, "/v1/chat/completions", body, "X-Kvsched-Session-Id: clé".encode())
    assert status == 200, answer
    assert gw.client.connected


async def test_health_reports_the_documented_stats_of_this_process(stack):
    """docs/GATEWAY.md names stats (leases_lost_mid_stream, leases_revoked, ...) that nothing exposed."""
    _gw, url, _engines, _ = stack
    async with aiohttp.ClientSession() as s:
        stats = await health_stats(s, url)
        assert stats == {
            "completed": 0,
            "engine_retries": 0,
            "engine_errors_mid_stream": 0,
            "leases_lost_mid_stream": 0,
            "leases_revoked": 0,
            "client_gone": 0,
        }
        assert (await stream_chat(s, url, "w1 w2"))["status"] == 200
        assert (await stream_chat(s, url, "w1", model="nope"))["status"] == 404
        stats = await health_stats(s, url)
    assert stats["completed"] == 1 and stats["http_404"] == 1 and stats["leases_revoked"] == 0


async def test_a_body_priority_out_of_range_is_a_400_naming_the_field_not_a_header(stack):
    """Found from outside: `"priority": 2**70` in the body was answered `invalid_header`, param null."""
    _gw, url, _engines, _ = stack
    body = {"model": "tiny", "max_tokens": 2, "priority": 2**70, "messages": [{"role": "user", "content": "w1"}]}
    status, answer = await _post(url, "/v1/chat/completions", body)
    assert status == 400, answer
    assert answer["error"]["code"] == "invalid_request" and answer["error"]["param"] == "priority", answer
