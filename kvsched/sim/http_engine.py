"""`kvsched-sim-engine`: one simulated engine served as an OpenAI-compatible HTTP server, no GPU.

The engine model is `sim/engine.py`'s `SimEngine` (continuous batching, prefix cache, step times from
`sim/profile.py`) run in wall-clock time scaled by `--speedup`. Requests arrive as text (chat or
completion bodies); the server renders and tokenizes them with the same local tokenizer directory as
the gateway (`kvsched.gateway.tokenizer`), hashes the prompt's blocks the way vLLM does
(`block_hashes(mode="vllm")`), and publishes the prefix-cache changes as vLLM KV events (PUB +
replay ROUTER, `sim/kv_publisher.py`); BlockStored events carry the blocks' token ids, as vLLM's
do. So gateway + daemon + several of these run on one machine and the daemon's overlap index sees
what it would see in front of vLLM.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (streaming, with `stream_options`
`include_usage` / `continuous_usage_stats`, or buffered), `GET /health`, `GET /v1/models`. Output is
`max_tokens` filler tokens (chat: `max_completion_tokens or max_tokens`, as vLLM; finish_reason
"length"). Simplification: a request whose client disconnects still runs to completion inside the
simulated engine (SimEngine has no abort).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import logging
import os
import signal
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
from aiohttp import web

from ..errors import ConfigError
from ..gateway.cli_args import log_level_arg, positive_int_arg, ready_file_arg
from ..gateway.listen import port_arg
from ..gateway.openai import chat_messages
from ..gateway.tokenizer import ModelTokenizer
from ..hashing import block_hashes
from .engine import SeqRecord, SimEngine, SimRequest
from .kv_publisher import KvEventPublisher
from .profile import DEFAULT_PROFILE, EngineProfile

log = logging.getLogger("kvsched.sim.http_engine")
_enc = msgspec.json.encode


class _TokenListener:
    """Cache listener between SimEngine and the publisher: adds each stored block's token ids."""

    def __init__(self, publisher, capacity: int = 200_000) -> None:
        self.publisher = publisher
        self.tokens: OrderedDict[int, tuple[int, ...]] = OrderedDict()  # block hash -> its tokens
        self.capacity = capacity

    def remember(self, hashes, token_ids: list[int], block_size: int) -> None:
        for i, h in enumerate(hashes):
            self.tokens[int(h)] = tuple(token_ids[i * block_size : (i + 1) * block_size])
            self.tokens.move_to_end(int(h))
        while len(self.tokens) > self.capacity:
            self.tokens.popitem(last=False)

    def block_stored(self, hashes, parent, block_size) -> None:
        ids: list[int] = []
        for h in hashes:
            ids.extend(self.tokens.get(int(h), ()))
        self.publisher.block_stored(hashes, parent, block_size, token_ids=ids)

    def block_removed(self, hashes) -> None:
        self.publisher.block_removed(hashes)


@dataclass(slots=True)
class _Live:
    rec: SeqRecord
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    notified: int = 0  # output tokens the handler was last woken for


class HttpSimEngine:
    """The server's state: one SimEngine, its clock, publisher and live requests.

    Args:
        tokenizer: a `ModelTokenizer`. model: served model name. block_size (tokens),
        total_kv_blocks, max_num_batched_tokens: the engine's. speedup: simulated µs per wall µs.
        hash_seed: vLLM hash seed (the engines' PYTHONHASHSEED; None = vLLM >= 0.29's default).
        publisher: a `KvEventPublisher`, or None for no KV events.
    """

    def __init__(
        self,
        tokenizer,
        model: str,
        block_size: int,
        total_kv_blocks: int,
        max_num_batched_tokens: int = 8192,
        speedup: float = 1.0,
        hash_seed: str | None = None,
        publisher=None,
        max_macro_us: int = 20_000,
        profile: EngineProfile = DEFAULT_PROFILE,
    ) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.block_size = block_size
        self.speedup = speedup
        self.hash_seed = hash_seed
        self.engine = SimEngine(
            total_kv_blocks, block_size, max_num_batched_tokens, profile=profile, max_macro_us=max_macro_us
        )
        self.publisher = publisher
        self.listener = _TokenListener(publisher) if publisher is not None else None
        self.engine.cache_listener = self.listener
        self.live: dict[str, _Live] = {}
        self._ids = itertools.count()
        self._t0 = time.monotonic()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def now_us(self) -> int:
        return int((time.monotonic() - self._t0) * 1e6 * self.speedup)

    # ------------------------------------------------------------------ engine loop
    def _advance(self) -> None:
        for _kind, rec in self.engine.advance(self.now_us()):
            live = self.live.get(rec.request.request_id)
            if live is not None:
                live.wake.set()
        for rec in self.engine.running():
            live = self.live.get(rec.request.request_id)
            if live is not None and rec.output_tokens != live.notified:
                live.notified = rec.output_tokens
                live.wake.set()
        if self.publisher is not None:
            self.publisher.flush()

    async def _loop(self) -> None:
        while True:
            self._advance()
            nxt = self.engine.next_step_end()
            self._wake.clear()
            if nxt is None:
                timeout = 0.05 if self.publisher is not None else None  # answer replays while idle
            else:
                timeout = max(0.0005, (nxt - self.now_us()) / 1e6 / self.speedup)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())
        if self.publisher is not None:
            self.publisher.attach(asyncio.get_running_loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.publisher is not None:
            self.publisher.close()

    # ------------------------------------------------------------------ HTTP
    def _prompt_ids(self, kind: str, body: dict) -> list[int]:
        if kind == "chat":
            return self.tokenizer.encode(self.tokenizer.render_chat(chat_messages(body)))
        prompt = body["prompt"]
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a one-element batch; [3] alone is a one-token prompt
        if isinstance(prompt, list):
            return [int(t) for t in prompt]
        return self.tokenizer.encode(prompt, add_special_tokens=True)

    async def handle(self, request: web.Request, kind: str) -> web.StreamResponse:
        try:
            body = msgspec.json.decode(await request.read())
            ids = self._prompt_ids(kind, body)
            # vLLM: chat takes `max_completion_tokens or max_tokens`; completions has no
            # max_completion_tokens (ignored), only `max_tokens`
            asked = (
                (body.get("max_completion_tokens") or body.get("max_tokens"))
                if kind == "chat"
                else body.get("max_tokens")
            )
            osl = int(asked or 16)
        except Exception as exc:
            return web.json_response(
                {"error": {"message": f"bad request: {exc}", "type": "BadRequestError", "code": 400}}, status=400
            )
        if not ids:
            return web.json_response({"error": {"message": "empty prompt", "code": 400}}, status=400)
        hashes = [int(h) for h in block_hashes(ids, self.block_size, mode="vllm", hash_seed=self.hash_seed)]
        if self.listener is not None:
            self.listener.remember(hashes, ids, self.block_size)
        rid = f"sim-{next(self._ids)}"
        self._advance()
        rec = self.engine.submit(SimRequest(rid, len(ids), osl, hashes), self.now_us())
        live = self.live[rid] = _Live(rec)
        self._wake.set()
        try:
            return await self._respond(request, kind, body, live, request.headers.get("X-Request-Id", rid))
        finally:
            self.live.pop(rid, None)

    async def _respond(self, request, kind, body, live: _Live, rid: str) -> web.StreamResponse:
        stream = bool(body.get("stream"))
        opts = body.get("stream_options") or {}
        usage_each = stream and bool(opts.get("continuous_usage_stats"))
        created = int(time.time())
        # The model the client asked for, as vLLM answers with the served name the client used
        # (else a gateway's streamed and buffered answers named different models).
        model = body.get("model") if isinstance(body.get("model"), str) and body.get("model") else self.model
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
        rec = live.rec
        isl = rec.request.isl
        out: web.StreamResponse | None = None  # set exactly when streaming
        if stream:
            out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(request)
        sent = 0
        text: list[str] = []

        def usage(n: int) -> dict:
            return {
                "prompt_tokens": isl,
                "completion_tokens": n,
                "total_tokens": isl + n,
                "prompt_tokens_details": {"cached_tokens": rec.cached_tokens},
            }

        def chunk(choice: dict, n: int) -> bytes:
            c = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if usage_each:
                c["usage"] = usage(n)
            return b"data: " + _enc(c) + b"\n\n"

        while True:
            await live.wake.wait()
            live.wake.clear()
            target = rec.output_tokens
            if out is not None and sent == 0 and target > 0 and kind == "chat":
                await out.write(
                    chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}, 0)
                )
            while sent < target:
                word = f" w{sent}"
                sent += 1
                if out is not None:
                    last = sent == rec.request.osl
                    ch = {"index": 0, "delta": {"content": word}} if kind == "chat" else {"index": 0, "text": word}
                    ch["finish_reason"] = "length" if last else None
                    await out.write(chunk(ch, sent))
                else:
                    text.append(word)
            if rec.done_us >= 0:
                break
        if out is None:
            msg = (
                {"index": 0, "message": {"role": "assistant", "content": "".join(text)}, "finish_reason": "length"}
                if kind == "chat"
                else {"index": 0, "text": "".join(text), "finish_reason": "length"}
            )
            return web.json_response(
                {
                    "id": rid,
                    "object": obj.replace(".chunk", ""),
                    "created": created,
                    "model": model,
                    "choices": [msg],
                    "usage": usage(sent),
                }
            )
        if opts.get("include_usage"):
            final: dict[str, Any] = {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": [],
                "usage": usage(sent),
            }
            await out.write(b"data: " + _enc(final) + b"\n\n")
        await out.write(b"data: [DONE]\n\n")
        await out.write_eof()
        return out

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, "completion")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(request, "chat")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.get("/health", self.health),
                web.get("/v1/models", self.models),
            ]
        )
        return app


class StartError(Exception):
    """`kvsched-sim-engine` cannot start (exit 2); the message names the flag to change."""


async def _serve(args) -> None:
    """Serve until SIGINT / SIGTERM. Raises StartError for a tokenizer directory that cannot be loaded
    (--tokenizer), a KV-event port (--kv-events-port / --kv-replay-port) or HTTP port (--port) that
    cannot be bound."""
    try:
        tokenizer = ModelTokenizer(args.tokenizer)
    except ConfigError as exc:
        raise StartError(f"--tokenizer: {exc}") from None
    publisher = None
    ctx = zmq.Context()
    if args.kv_events_port:
        replay_port = args.kv_replay_port or args.kv_events_port + 1
        try:
            publisher = KvEventPublisher(
                ctx,
                f"tcp://{args.host}:{args.kv_events_port}",
                f"tcp://{args.host}:{replay_port}",
                topic=args.kv_events_topic,
                encoding=args.kv_encoding,
                dp_rank=args.dp_rank,
            )
        except zmq.ZMQError as exc:
            ctx.destroy(linger=0)  # closes the PUB socket when only the replay bind failed
            raise StartError(
                f"--kv-events-port {args.kv_events_port} / --kv-replay-port {replay_port}: cannot bind "
                f"tcp://{args.host}:{args.kv_events_port} and tcp://{args.host}:{replay_port}: {exc}; "
                "choose other ports"
            ) from None
    sim = HttpSimEngine(
        tokenizer,
        args.model,
        args.block_size,
        args.total_kv_blocks,
        args.max_num_batched_tokens,
        args.speedup,
        args.hash_seed,
        publisher,
    )
    sim.start()
    runner = web.AppRunner(sim.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        try:
            await web.TCPSite(runner, args.host, args.port, backlog=1024).start()
        except OSError as exc:
            raise StartError(
                f"--port {args.port}: cannot listen on {args.host}:{args.port}: "
                f"{os.strerror(exc.errno) if exc.errno else exc}; choose another port"
            ) from None
        port = runner.addresses[0][1]
        log.info(
            "sim engine worker=%d rank=%d listening on http://%s:%d kv_events=%s",
            args.worker_id,
            args.dp_rank,
            args.host,
            port,
            publisher.endpoint if publisher else "-",
        )
        if args.ready_file:
            with open(args.ready_file, "w") as fh:
                fh.write(str(port))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await runner.cleanup()
        await sim.stop()
        ctx.term()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point of `kvsched-sim-engine`."""
    ap = argparse.ArgumentParser(
        prog="kvsched-sim-engine",
        description="One simulated LLM engine served as an "
        "OpenAI-compatible HTTP server that publishes vLLM KV events (no GPU).",
    )
    ap.add_argument("--worker-id", type=int, default=0, help="the worker id it plays (for logs)")
    ap.add_argument("--host", default="127.0.0.1", help="address for HTTP and KV events (default 127.0.0.1)")
    ap.add_argument("--port", type=port_arg, default=8000, help="HTTP port (0 = any free port)")
    ap.add_argument("--kv-events-port", type=port_arg, default=0, help="KV-event PUB port (0 = publish no events)")
    ap.add_argument("--kv-replay-port", type=port_arg, default=0, help="replay ROUTER port (default: PUB port + 1)")
    ap.add_argument("--kv-events-topic", default="", help="topic of every KV-event message")
    ap.add_argument("--kv-encoding", choices=("array", "map"), default="array", help="KV-event encoding")
    ap.add_argument("--tokenizer", required=True, help="local tokenizer directory (tokenizer.json + chat template)")
    ap.add_argument("--model", default="sim", help="served model name")
    ap.add_argument(
        "--block-size", type=positive_int_arg, default=16, help="tokens per KV block (= the daemon's block_size)"
    )
    ap.add_argument("--total-kv-blocks", type=positive_int_arg, default=8192, help="KV blocks of the engine")
    ap.add_argument("--max-num-batched-tokens", type=positive_int_arg, default=8192, help="per-step token budget")
    ap.add_argument("--dp-rank", type=int, default=0, help="data_parallel_rank written in KV-event batches")
    ap.add_argument("--speedup", type=float, default=1.0, help="simulated time per wall time (10 = 10x faster)")
    ap.add_argument("--hash-seed", default=None, help="vLLM hash seed (PYTHONHASHSEED); default vLLM >= 0.29's")
    ap.add_argument("--ready-file", type=ready_file_arg, help="write the bound HTTP port here once serving")
    ap.add_argument("--log-level", type=log_level_arg, default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    import uvloop

    uvloop.install()
    try:
        asyncio.run(_serve(args))
    except StartError as exc:
        print(f"kvsched-sim-engine: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
