"""The gateway in process against a real daemon and scripted engines: the data-parallel rank header,
retry once with the failed worker excluded, 502 after two engine failures, nothing leaked."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from .conftest import scripted_daemon_fixture
from .helpers import eventually, health_stats, ledger, scripted_stack, stream_chat, words

pytestmark = pytest.mark.timeout(120)


# worker 1 with two ranks, worker 2 with one: one daemon for the module
daemon = scripted_daemon_fixture({1: 2, 2: 1}, scope="module")


@pytest.fixture
async def stack_short_read(daemon, tmp_path):
    """The stack with engine_read_timeout_s = 0.5 s."""
    async for s in scripted_stack(daemon, tmp_path, engine_read_timeout_s=0.5):
        yield s


async def test_rank_header_only_for_workers_with_several_ranks_and_engine_body_streams(stack):
    _gw, url, engines, d = stack
    async with aiohttp.ClientSession() as s:
        for i in range(12):
            r = await stream_chat(s, url, words(40 * i, 20))
            assert r["status"] == 200 and r["text"] == "ab" and r["done"], r
    assert engines[1].seen and engines[2].seen  # spread over both
    for seen in engines[1].seen:
        assert seen["headers"]["X-data-parallel-rank"] in ("0", "1")
        assert seen["body"]["stream"] is True and seen["body"]["stream_options"]["continuous_usage_stats"]
    assert all("X-data-parallel-rank" not in seen["headers"] for seen in engines[2].seen)
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)


async def test_failed_engine_is_retried_once_elsewhere_then_excluded(stack):
    gw, url, engines, d = stack
    engines[1].mode = "fail"
    async with aiohttp.ClientSession() as s:
        for i in range(8):
            r = await stream_chat(s, url, words(40 * i, 20))
            assert r["status"] == 200 and r["text"] == "ab", r
    assert len(engines[1].seen) <= 1  # failed once, then excluded until a health check passes
    assert len(engines[2].seen) == 8
    assert gw.health.failing == {1}
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)


async def test_two_engine_failures_answer_502_and_release_everything(stack):
    gw, url, engines, d = stack
    engines[1].mode = engines[2].mode = "fail"
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}]}
        ) as resp,
    ):
        body = await resp.json()
    assert resp.status == 502 and "engine failed" in body["error"]["message"], body
    assert len(engines[1].seen) + len(engines[2].seen) == 2
    assert gw.health.failing == {1, 2} and gw.health.excluded() == set()  # all down: fail open
    engines[2].mode = "ok"
    async with aiohttp.ClientSession() as s:
        r = await stream_chat(s, url, "w1 w2")
    assert r["status"] == 200 and r["text"] == "ab", r
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)


async def test_an_engines_own_4xx_is_passed_through_with_its_content_type_and_counted(stack):
    """Found by a new user: the engine's 4xx was relabelled `application/json` whatever the engine sent,
    and missing from /health's `stats` (docs: answers other than 200 before streaming are `http_<status>`)."""
    _gw, url, engines, d = stack
    engines[1].mode = engines[2].mode = "refuse"
    async with aiohttp.ClientSession() as s:
        async with s.post(
            url + "/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}]}
        ) as resp:
            body = await resp.text()
        stats = await health_stats(s, url)
    assert resp.status == 422 and body == "unknown parameter 'foo'", body
    assert resp.headers["Content-Type"].startswith("text/plain"), resp.headers
    assert stats.get("http_422") == 1, stats
    assert len(engines[1].seen) + len(engines[2].seen) == 1  # a refusal is no engine failure: no retry
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)


async def test_engine_silent_longer_than_the_read_timeout_fails_the_stream_and_releases(stack_short_read):
    """Mid-stream silence: the client gets the first token, then an error event, within a few
    timeouts (not the engine's 8 s); the lease is released. Silent before its headers: an engine
    failure (retried elsewhere once, then 502)."""
    _gw, url, engines, d = stack_short_read
    engines[1].mode = engines[2].mode = "stall"
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        t0 = loop.time()
        r = await stream_chat(s, url, "w1 w2")
        took = loop.time() - t0
    assert r["status"] == 200 and r["text"] == "a", r
    assert r["error"] and "engine sent nothing" in r["error"]["error"]["message"], r
    assert took < 6, took
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)
    engines[1].mode = engines[2].mode = "stall_headers"
    async with aiohttp.ClientSession() as s:
        t0 = loop.time()
        r = await stream_chat(s, url, "w3 w4")
        took = loop.time() - t0
        assert r["status"] == 502 and "no response headers" in r["error"]["error"]["message"], r
        assert took < 6, took  # two engines tried, 0.5 s each, not the engines' 8 s
        engines[1].mode = engines[2].mode = "ok"
        r = await stream_chat(s, url, "w3 w4")
        assert r["status"] == 200 and r["text"] == "ab", r
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)


def _server_timing(value: str) -> dict[str, float]:
    out = {}
    for part in value.split(","):
        name, dur = part.strip().split(";dur=")
        out[name] = float(dur)
    return out


async def test_server_timing_header_splits_the_gateway_time_streaming_and_buffered(stack):
    _gw, url, _engines, d = stack
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        for stream in (True, False):
            body = {"model": "tiny", "messages": [{"role": "user", "content": words(0, 20)}], "stream": stream}
            t0 = loop.time()
            async with s.post(url + "/v1/chat/completions", json=body) as resp:
                took_ms = (loop.time() - t0) * 1e3
                await resp.read()
            assert resp.status == 200
            timing = _server_timing(resp.headers["Server-Timing"])
            assert set(timing) == {"prep", "schedule", "queue", "engine"}, timing
            assert all(v >= 0 for v in timing.values()), timing
            assert timing["prep"] + timing["schedule"] + timing["engine"] <= took_ms, (timing, took_ms)
            assert timing["queue"] <= timing["schedule"], timing  # the daemon's queue is inside its round trip
            assert timing["schedule"] > 0 and timing["engine"] > 0  # a daemon round trip, an HTTP round trip
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)


async def test_a_slow_stream_within_the_read_timeout_between_chunks_completes(stack_short_read):
    """Six chunks 0.3 s apart with a 0.5 s read timeout: 1.8 s in all, never 0.5 s of silence."""
    _gw, url, engines, d = stack_short_read
    engines[1].mode = engines[2].mode = "slow"
    async with aiohttp.ClientSession() as s:
        r = await stream_chat(s, url, "w1 w2")
    assert r["status"] == 200 and r["text"] == "abcdef" and r["done"] and not r["error"], r
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)


async def test_requests_waiting_on_an_engine_that_fails_its_health_check_are_retried_elsewhere(stack):
    """Found from outside: with one engine hung (SIGSTOP), the requests already sent to it waited for
    `engine_read_timeout_s` (600 s by default) although the health check had marked the worker
    failing within 2 s. 1. both workers' URLs are known and worker 2 is excluded, so a request goes
    to worker 1, whose engine does not answer (8 s) and whose health check fails; 2. a health-check
    pass runs. Result: the waiting request is stopped and retried on worker 2 at once (200 well
    before the engine's 8 s), and nothing is leaked."""
    gw, url, engines, d = stack
    gw.health.learn(1, engines[1].url)
    gw.health.learn(2, engines[2].url)
    gw.health.failing = {2}
    engines[1].mode, engines[1].healthy = "stall_headers", False
    async with aiohttp.ClientSession() as s:
        pending = asyncio.ensure_future(stream_chat(s, url, words(0, 20)))
        assert await eventually(lambda: len(engines[1].seen) == 1, 20)
        await gw.health.check_once()  # worker 1 fails its check, worker 2 passes
        r = await asyncio.wait_for(pending, 20)
        assert r["status"] == 200 and r["text"] == "ab", r
    # answered by worker 2 (before: worker 1 answered after its 8 s stall, and worker 2 saw nothing)
    assert len(engines[2].seen) == 1 and gw.health.failing == {1}
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)


@pytest.fixture
async def stack_short_body(daemon, tmp_path):
    """The stack with body_read_timeout_s = 0.5 s."""
    async for s in scripted_stack(daemon, tmp_path, body_read_timeout_s=0.5):
        yield s


async def test_a_body_that_never_completes_is_answered_408_and_the_connection_freed(stack_short_body):
    """Found from outside: a client that sent `Content-Length: 100` and one byte got no answer and kept
    its connection (slowloris). Result: 408 `body_timeout` after `body_read_timeout_s`; a normal
    request still works and nothing was scheduled."""
    _gw, url, engines, _d = stack_short_body
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 100\r\n\r\n{"
    )
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 10)  # before: nothing, until this timeout
    assert b" 408 " in status_line, status_line
    writer.close()
    async with aiohttp.ClientSession() as s:
        r = await stream_chat(s, url, words(0, 5))
        assert r["status"] == 200, r
    assert len(engines[1].seen) + len(engines[2].seen) == 1


async def test_unknown_paths_and_wrong_methods_get_openai_style_json_errors(stack):
    """Found from outside: 404 and 405 were aiohttp's plain text ("404: Not Found"), which an OpenAI
    client cannot parse as an error. Result: JSON `{"error": {...}}` naming the route or the method."""
    _gw, url, _engines, _d = stack
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/chat/completions") as resp:
            body = await resp.json()
            assert resp.status == 405 and resp.headers["Allow"] == "POST", body
            assert body["error"]["code"] == "method_not_allowed" and "POST" in body["error"]["message"]
        async with s.post(url + "/v1/embeddings", json={}) as resp:
            body = await resp.json()
            assert resp.status == 404 and body["error"]["code"] == "not_found", body
            assert "/v1/chat/completions" in body["error"]["message"]
        async with s.get(url + "/v1/models") as resp:
            assert resp.status == 200


async def test_a_stream_the_engine_ends_without_done_is_an_engine_error_not_a_completion(stack):
    """Found from outside: an engine body that ended cleanly after some chunks but without `[DONE]`
    was relayed as a success (the client got `[DONE]`, the lease was released `completed`)."""
    gw, url, engines, d = stack
    engines[1].mode = engines[2].mode = "nodone"
    async with aiohttp.ClientSession() as s:
        r = await stream_chat(s, url, "w1 w2")
    assert r["status"] == 200 and not r["done"], r  # no [DONE] for the client either
    assert r["error"] and "without [DONE]" in r["error"]["error"]["message"], r
    assert gw.stats["engine_errors_mid_stream"] == 1 and gw.stats["completed"] == 0, gw.stats
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)


async def test_a_client_that_disconnects_mid_stream_is_counted_client_gone(stack):
    """Found from outside: /health's `client_gone` counted only a failed write; aiohttp cancels the
    handler of a client that went away, which was not counted."""
    gw, url, engines, d = stack
    engines[1].mode = engines[2].mode = "long"
    for n in (1, 2):
        async with aiohttp.ClientSession() as s:
            resp = await s.post(
                url + "/v1/chat/completions",
                json={"model": "tiny", "stream": True, "messages": [{"role": "user", "content": f"w{n} w2"}]},
            )
            assert resp.status == 200
            await resp.content.readline()  # the first chunk arrived
            resp.close()  # the client goes away mid-stream
        assert await eventually(lambda n=n: gw.stats["client_gone"] == n, 10), gw.stats
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)
