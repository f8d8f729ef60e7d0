"""HTTP helpers of the gateway tests: OpenAI-style requests over aiohttp, SSE parsing, ledger checks,
scripted engines and the in-process gateway in front of them."""

from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from kvsched import protocol as p
from kvsched.client import AdminClient
from kvsched.gateway.app import Gateway, make_app
from kvsched.gateway.config import GatewayConfig, GatewaySection, ModelSection
from kvsched.gateway.local_fleet import write_tiny_tokenizer
from tests.conftest import free_port


def words(start: int, n: int) -> str:
    """`n` vocabulary words of the tiny tokenizer starting at w<start> (one token each)."""
    return " ".join(f"w{(start + i) % 2000}" for i in range(n))


async def stream_chat(
    session: aiohttp.ClientSession, url: str, content: str, max_tokens: int = 8, model: str = "tiny"
) -> dict:
    """One streaming chat request with usage; returns {"status", "text", "usage", "done", "error"}."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    out = {"status": 0, "text": "", "usage": None, "done": False, "error": None}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        out["status"] = resp.status
        if resp.status != 200:
            out["error"] = await resp.json()
            return out
        async for line in resp.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                out["done"] = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                out["error"] = chunk
                continue
            for ch in chunk.get("choices") or ():
                out["text"] += (ch.get("delta") or {}).get("content") or ""
            if chunk.get("usage"):
                out["usage"] = chunk["usage"]
    return out


async def health_stats(session: aiohttp.ClientSession, url: str) -> dict:
    """The `stats` object of the gateway's GET /health (asserted to answer 200)."""
    async with session.get(url + "/health") as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["stats"]


def ledger(admin_endpoint: str) -> tuple[int, int]:
    """(active requests summed over workers, active leases) as the daemon reports them."""
    with AdminClient(admin_endpoint) as admin:
        w = admin.call(p.Workers())
        leases = admin.call(p.Leases())
    return sum(r.active_requests + r.active_blocks + r.active_prefill_tokens for r in w.workers), leases.total


def decisions(admin_endpoint: str) -> int:
    with AdminClient(admin_endpoint) as admin:
        return admin.call(p.Status()).decisions_total


async def eventually(pred, timeout_s: float = 30.0, interval_s: float = 0.02) -> bool:
    """Poll `pred` without blocking the event loop (sockets closed by the test must really close)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        await asyncio.sleep(interval_s)
    return bool(pred())


class ScriptedEngine:
    """An OpenAI-ish engine that records each request's headers and answers `mode`: "ok" (two
    tokens, usage on every chunk), "fail" (HTTP 500), "refuse" (HTTP 422, text/plain), "stall_headers"
    (no answer for 8 s), "stall" (the first token, then silence for 8 s), "slow" (six tokens, 0.3 s
    apart), "long" (600 tokens, 0.1 s apart) or "nodone" (two tokens, no finish_reason, and the body
    ends without `[DONE]`). `disconnects` counts requests whose connection closed before the end."""

    def __init__(self, port: int, mode: str = "ok") -> None:
        self.mode = mode
        self.seen: list[dict] = []
        self.disconnects = 0
        self.healthy = True  # False: GET /health answers 503
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
        if self.mode == "refuse":  # the engine's own 4xx, in its own content type
            return web.Response(status=422, text="unknown parameter 'foo'", content_type="text/plain")
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
                last = i == len(texts) - 1 and self.mode != "nodone"
                chunk = {
                    "id": "e",
                    "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop" if last else None}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": i + 1, "total_tokens": 6 + i},
                }
                await out.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            if self.mode != "nodone":
                await out.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError):  # the gateway closed the connection
            self.disconnects += 1
            raise
        return out

    async def health(self, request: web.Request) -> web.Response:
        return web.Response() if self.healthy else web.Response(status=503)

    async def start(self) -> None:
        app = web.Application()
        app.add_routes([web.post("/v1/chat/completions", self.chat), web.get("/health", self.health)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()


async def scripted_stack(daemon, tmp_path, **gateway):
    """The gateway in process (health checks every 60 s, the tiny tokenizer, `gateway` overrides of
    its [gateway] section) in front of `daemon`, one `ScriptedEngine` per `daemon.engine_ports`
    worker; yields (gateway, its URL, {worker_id: engine}, daemon) and stops them all afterwards."""
    engines = {w: ScriptedEngine(port) for w, port in daemon.engine_ports.items()}
    started, gw, runner = [], None, None
    try:  # whatever started is stopped even when a later step fails (its ports freed for the next test)
        for e in engines.values():
            await e.start()
            started.append(e)
        cfg = GatewayConfig(
            gateway=GatewaySection(
                port=free_port(), daemon_endpoint=daemon.endpoint, health_interval_s=60.0, **gateway
            ),
            models=[ModelSection(name="tiny", tokenizer_dir=str(write_tiny_tokenizer(tmp_path / "tok")))],
        )
        gw = Gateway(cfg)
        await gw.start()
        runner = web.AppRunner(make_app(gw), handler_cancellation=True)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", cfg.gateway.port).start()
        yield gw, f"http://127.0.0.1:{cfg.gateway.port}", engines, daemon
    finally:
        if runner is not None:
            await runner.cleanup()
        if gw is not None:
            await gw.stop()
        for e in started:
            await e.runner.cleanup()
