"""HTTP helpers of the gateway tests: OpenAI-style requests over aiohttp, SSE parsing, ledger checks."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from kvsched import protocol as p
from kvsched.client import AdminClient


def words(start: int, n: int) -> str:
    """`n` vocabulary words of the tiny tokenizer starting at w<start> (one token each)."""
    return " ".join(f"w{(start + i) % 2000}" for i in range(n))


async def stream_chat(session: aiohttp.ClientSession, url: str, content: str, max_tokens: int = 8,
                      model: str = "tiny") -> dict:
    """One streaming chat request with usage; returns {"status", "text", "usage", "done", "error"}."""
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
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
