"""The gateway in process against a real daemon and scripted engines: the data-parallel rank header,
retry once with the failed worker excluded, 502 after two engine failures, nothing leaked."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from kvsched.gateway.app import Gateway, make_app
from kvsched.gateway.config import GatewayConfig, GatewaySection, ModelSection
from kvsched.gateway.local_fleet import free_port, write_tiny_tokenizer
from tests.conftest import purge, start_daemon

from .helpers import eventually, ledger, stream_chat, words

pytestmark = pytest.mark.timeout(120)


class ScriptedEngine:
    """An OpenAI-ish engine that records each request's headers and answers `mode`: "ok" (two
    tokens, usage on every chunk), "fail" (HTTP 500), "stall_headers" (no answer for 8 s),
    "stall" (the first token, then silence for 8 s), "slow" (six tokens, 0.3 s apart) or "long"
    (600 tokens, 0.1 s apart). `disconnects` counts requests whose connection closed before the end."""

    def __init__(self, port: int, mode: str = "ok") -> None:
        self.mode = mode
        self.seen: list[dict] = []
        self.disconnects = 0
        self.port = port
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append({"headers": dict(request.headers), "body": body})
        if self.mode == "fail":
            return web.Response(status=500, text="boom")
        if self.mode == "stall_headers":
            await asyncio.sleep(8)
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        texts = {"slow": tuple("abcdef"), "long": ("x",) * 600}.get(self.mode, ("a", "b"))
        try:
            for i, text in enumerate(texts):
                if i and self.mode == "stall":
                    await asyncio.sleep(8)
                if self.mode in ("slow", "long"):
                    await asyncio.sleep(0.3 if self.mode == "slow" else 0.1)
                chunk = {"id": "e", "choices": [{"index": 0, "delta": {"content": text},
                                                 "finish_reason": "stop" if i == len(texts) - 1 else None}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": i + 1, "total_tokens": 6 + i}}
                await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await out.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError):  # the gateway closed the connection
            self.disconnects += 1
            raise
        return out

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", self.chat), web.get("/health", self.health)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """One daemon for the module: worker 1 with two ranks, worker 2 with one, at fixed engine ports."""
    ports = {1: free_port(), 2: free_port()}
    d = start_daemon(tmp_path_factory.mktemp("fwd"), f"""
[daemon]
block_size = 16

[[workers]]
worker_id = 1
dp_size = 2
url = "http://127.0.0.1:{ports[1]}"

[[workers]]
worker_id = 2
url = "http://127.0.0.1:{ports[2]}"
""")
    d.engine_ports = ports
    yield d
    d.stop()
    purge(d.instance)


@pytest.fixture
async def stack(daemon, tmp_path):
    async for s in _stack(daemon, tmp_path):
        yield s


@pytest.fixture
async def stack_short_read(daemon, tmp_path):
    """The stack with engine_read_timeout_s = 0.5 s."""
    async for s in _stack(daemon, tmp_path, engine_read_timeout_s=0.5):
        yield s


async def _stack(daemon, tmp_path, **gateway):
    engines = {w: ScriptedEngine(port) for w, port in daemon.engine_ports.items()}
    for e in engines.values():
        await e.start()
    cfg = GatewayConfig(gateway=GatewaySection(port=free_port(), daemon_endpoint=daemon.endpoint,
                                               health_interval_s=60.0, **gateway),
                        models=[ModelSection(name="tiny", tokenizer_dir=str(write_tiny_tokenizer(tmp_path / "tok")))])
    gw = Gateway(cfg)
    await gw.start()
    runner = web.AppRunner(make_app(gw), handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", cfg.gateway.port).start()
    yield gw, f"http://127.0.0.1:{cfg.gateway.port}", engines, daemon
    await runner.cleanup()
    await gw.stop()
    for e in engines.values():
        await e.runner.cleanup()


async def test_rank_header_only_for_workers_with_several_ranks_and_engine_body_streams(stack):
    gw, url, engines, d = stack
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
    async with aiohttp.ClientSession() as s:
        async with s.post(url + "/v1/chat/completions",
                          json={"model": "tiny", "messages": [{"role": "user", "content": "w1 w2"}]}) as resp:
            body = await resp.json()
    assert resp.status == 502 and "engine failed" in body["error"]["message"], body
    assert len(engines[1].seen) + len(engines[2].seen) == 2
    assert gw.health.failing == {1, 2} and gw.health.excluded() == set()  # all down: fail open
    engines[2].mode = "ok"
    async with aiohttp.ClientSession() as s:
        r = await stream_chat(s, url, "w1 w2")
    assert r["status"] == 200 and r["text"] == "ab", r
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)


async def test_engine_silent_longer_than_the_read_timeout_fails_the_stream_and_releases(stack_short_read):
    """Mid-stream silence: the client gets the first token, then an error event, within a few
    timeouts (not the engine's 8 s); the lease is released. Silent before its headers: an engine
    failure (retried elsewhere once, then 502)."""
    gw, url, engines, d = stack_short_read
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
    gw, url, engines, d = stack
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
    gw, url, engines, d = stack_short_read
    engines[1].mode = engines[2].mode = "slow"
    async with aiohttp.ClientSession() as s:
        r = await stream_chat(s, url, "w1 w2")
    assert r["status"] == 200 and r["text"] == "abcdef" and r["done"] and not r["error"], r
    assert await eventually(lambda: ledger(d.admin_endpoint) == (0, 0), 30)
