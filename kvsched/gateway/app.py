"""`kvsched-gateway`: the aiohttp application, its lifecycle and the console-script entry point.

Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (streaming and not), `GET /v1/models`,
`GET /health` (200 while the daemon connection is up, else 503). One `SchedulerClient` per process;
run several processes behind a load balancer for more throughput. docs/GATEWAY.md has the contract.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import os
import signal
import sys
import time
from collections import Counter

import aiohttp
import msgspec
from aiohttp import web

from ..client import SchedulerClient
from ..endpoints import missing_ipc_path
from ..errors import ConfigError, DaemonUnavailable, FrameTooLarge, RequestRejected
from ..hashing import DEFAULT_VLLM_SEED, BlockHashCache, vllm_none_hash
from . import openai as oa
from .cli_args import int_range_arg, log_level_arg, ready_file_arg
from .config import MAX_WORKERS, GatewayConfig, GatewaySection, ModelSection, load_gateway_config
from .forward import ClientGone, Marks, serve
from .health import EngineHealth
from .hints import scheduling_hints
from .listen import (
    LISTEN_BACKLOG,
    PortInUse,
    check_listen_address,
    host_arg,
    host_port,
    listen_socket,
    port_arg,
    port_error,
)
from .tokenizer import ModelTokenizer, TemplateError
from .workers import WorkerLink, default_workers, supervise

log = logging.getLogger("kvsched.gateway")
# Counters /health reports (0 until they happen), besides http_<status> and rejected_<reason> (docs/GATEWAY.md).
STATS = (
    "completed",
    "engine_retries",
    "engine_errors_mid_stream",
    "leases_lost_mid_stream",
    "leases_revoked",
    "client_gone",
)


def hash_seed_mismatch(override: str | None, daemon_seed: str | None, endpoint: str) -> str | None:
    """Why the gateway's `hash_seed` override cannot be used with the daemon at `endpoint`, or None.

    The daemon's `kv_hash_seed` (its `Welcome.hash_seed`) is the pool's one hash seed (docs/VLLM.md);
    the gateway's own `hash_seed` is only a statement of what it should be. They agree when they give
    the same vLLM chain start (`vllm_none_hash`): unset means vLLM's default seed on either side.

    Args:
        override: `[gateway] hash_seed`, None when not set (no check).
        daemon_seed: the daemon's `Welcome.hash_seed` (None = vLLM's default).
        endpoint: the daemon's data endpoint, named in the message (the pool it concerns).
    Returns:
        None when they agree or no override is set; else a message naming both values.
    """
    if override is None or vllm_none_hash(override) == vllm_none_hash(daemon_seed):
        return None
    theirs = repr(daemon_seed) if daemon_seed is not None else f"unset, vLLM's default {DEFAULT_VLLM_SEED!r}"
    return (
        f"block hash seed mismatch: the gateway's hash_seed = {override!r} but the daemon at {endpoint} has "
        f"kv_hash_seed = {theirs}; the daemon's is the pool's one seed (what its engines' PYTHONHASHSEED must "
        "be): remove hash_seed from the gateway's config or make it equal (docs/VLLM.md)"
    )


def _tokenizer(m: ModelSection) -> ModelTokenizer:
    """The model's tokenizer; raises ConfigError naming the `[[models]]` entry and its key."""
    try:
        return ModelTokenizer(m.tokenizer_dir, m.chat_template)
    except ConfigError as exc:
        raise ConfigError(f"[[models]] name = {m.name!r}: {exc}") from None


class Gateway:
    """State of one gateway process: config, tokenizers, the daemon client, the engine session.

    Args:
        cfg: the loaded `GatewayConfig`.
    Raises:
        ConfigError: a tokenizer directory that cannot be loaded.
    """

    def __init__(self, cfg: GatewayConfig) -> None:
        self.cfg = cfg
        g = cfg.gateway
        self.tokenizers = {m.name: _tokenizer(m) for m in cfg.models}
        self.max_model_len = {m.name: m.max_model_len for m in cfg.models}  # tokens, prompt + output
        self.created = int(time.time())
        self.client: SchedulerClient | None = None
        self.session: aiohttp.ClientSession | None = None
        self.health: EngineHealth | None = None
        # The longest silence (engine_read_timeout_s) is enforced by forward.Silence, one timer per
        # request, not by aiohttp's sock_read, which re-arms a timer per chunk received.
        self.engine_timeout = aiohttp.ClientTimeout(total=None, sock_connect=g.engine_connect_timeout_s)
        self.stats: Counter = Counter()
        self.hash_cache = BlockHashCache()  # shared prefixes are hashed once per process
        self._seed_checked: tuple[object, str | None] = (None, None)  # (the Welcome checked, its verdict)
        # Request ids: a random per-process prefix (unique across worker processes and restarts)
        # plus a counter; a twentieth of uuid4's cost per request.
        self._id_prefix = f"gw-{os.urandom(8).hex()}-"
        self._ids = itertools.count(1)

    async def start(self) -> None:
        """Connect to the daemon (raises DaemonUnavailable) and open the engine session."""
        g = self.cfg.gateway
        self.client = await self._connect_when_daemon_up(g)
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300), auto_decompress=False
        )
        self.health = EngineHealth(self.session, g.health_interval_s, g.health_timeout_s, g.health_path)
        self.health.start()
        self.hash_seed_problem()  # logged now rather than at the first request
        log.info(
            "gateway ready daemon=%s block_size=%d hash_seed=%r models=%s",
            self.client.endpoint,
            self.block_size,
            self.client.welcome.hash_seed if self.client.welcome else None,
            ",".join(self.tokenizers),
        )

    async def _connect_when_daemon_up(self, g: GatewaySection) -> SchedulerClient:
        """Connect, waiting up to `connect_timeout_s` (s) for the daemon to bind its socket and answer.

        A gateway started beside its daemon (one pod, one compose file, `make gateway-demo`) may
        start first: it waits instead of exiting. Raises DaemonUnavailable after the timeout, and
        ConfigError for a malformed endpoint (e.g. from KVSCHED_ENDPOINT).
        """
        try:
            client = SchedulerClient(
                g.daemon_endpoint or None,
                instance=g.instance,
                client_name=g.client_name or f"gateway-{os.getpid()}",
                connect_timeout_s=g.connect_timeout_s,
            )
        except ValueError as exc:  # the endpoint's syntax (the file's is checked when it is loaded)
            raise ConfigError(str(exc)) from None
        if missing_ipc_path(client.endpoint) is not None:  # the client waits for it (SchedulerClient.connect)
            log.info("waiting up to %.1fs for the daemon at %s", g.connect_timeout_s, client.endpoint)
        return await client.connect()  # DaemonUnavailable names the endpoint (and a still-missing socket)

    @property
    def block_size(self) -> int:
        """Tokens per block of the daemon connected now (its last Welcome: a restart may change it), 0 before."""
        return self.client.welcome.block_size if self.client is not None and self.client.welcome else 0

    def hash_seed_problem(self) -> str | None:
        """`hash_seed_mismatch` for the daemon's last Welcome, checked once per Welcome (a restarted
        daemon may bring another seed) and logged as an ERROR when it fails; None before any Welcome."""
        client = self.client
        welcome = client.welcome if client is not None else None
        if client is None or welcome is None:
            return None
        if welcome is not self._seed_checked[0]:
            problem = hash_seed_mismatch(self.cfg.gateway.hash_seed, welcome.hash_seed, client.endpoint)
            if problem is not None:
                log.error("%s; every request answers 503 until they agree", problem)
            self._seed_checked = (welcome, problem)
        return self._seed_checked[1]

    def block_hashes(self, token_ids: list[int]):
        """The prompt's block hashes, with the daemon's block size and seed (`SchedulerClient.block_hashes`,
        vLLM mode, through the process's `BlockHashCache`). Raises HttpError 503 `hash_seed_mismatch`
        (no Retry-After: a configuration to fix) when the gateway's override disagrees with the daemon."""
        problem = self.hash_seed_problem()
        if problem is not None:
            raise oa.HttpError(503, problem, "service_unavailable", "hash_seed_mismatch")
        assert self.client is not None, "start() first"
        try:
            return self.client.block_hashes(token_ids, cache=self.hash_cache)
        except DaemonUnavailable as exc:  # no Welcome (not after start(), which waits for one)
            raise oa.error_for_unavailable(exc) from None

    async def stop(self) -> None:
        if self.health is not None:
            await self.health.stop()
        if self.session is not None:
            await self.session.close()
        if self.client is not None:
            await self.client.close()

    async def schedule(self, request_id: str, isl: int, hashes, excluded: set[int], hints: dict):
        """`SchedulerClient.schedule` with rejections mapped to HttpError (status-code table)."""
        assert self.client is not None, "start() first"
        try:
            return await self.client.schedule(request_id, isl, hashes, excluded_workers=excluded or None, **hints)
        except RequestRejected as exc:
            self.stats[f"rejected_{exc.reason}"] += 1
            raise oa.error_for_rejection(exc) from None
        except DaemonUnavailable as exc:
            raise oa.error_for_unavailable(exc) from None
        except FrameTooLarge as exc:  # more block hashes than the daemon's max_frame_bytes carries
            raise oa.HttpError(400, str(exc), code="prompt_too_long") from None

    # ------------------------------------------------------------------ handlers
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "completion", "/v1/completions")

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, "chat", "/v1/chat/completions")

    async def models(self, request: web.Request) -> web.Response:
        data = [
            {"id": name, "object": "model", "created": self.created, "owned_by": "kvsched"} for name in self.tokenizers
        ]
        return web.json_response({"object": "list", "data": data})

    async def health_endpoint(self, request: web.Request) -> web.Response:
        """200 while the daemon connection is up, else 503: status, failing worker ids, pid, and this
        process's `stats` (request counts since it started: `STATS`, http_<status>, rejected_<reason>)."""
        up = self.client is not None and self.client.connected
        failing = sorted(self.health.failing) if self.health else []
        return web.json_response(
            {
                "status": "ok" if up else "daemon_unavailable",
                "failing_workers": failing,
                "pid": os.getpid(),
                "stats": {**dict.fromkeys(STATS, 0), **self.stats},
            },
            status=200 if up else 503,
        )

    async def _handle(self, request: web.Request, kind: str, path: str) -> web.StreamResponse:
        marks = Marks()
        try:
            p = await self._parse(request, kind)
            hints = scheduling_hints(request, p)
            hashes = self.block_hashes(p.token_ids)
            marks.prepared = marks.admitted = marks.engine = time.perf_counter()
            return await serve(self, request, p, path, hints, hashes, f"{self._id_prefix}{next(self._ids):x}", marks)
        except oa.HttpError as exc:
            self.stats[f"http_{exc.status}"] += 1
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers())
        except ClientGone:  # released `aborted` on the way out; nobody reads this answer
            self.stats["client_gone"] += 1
            return web.Response(status=499)
        except asyncio.CancelledError:  # aiohttp cancels the handler of a client that disconnected
            if request.transport is None or request.transport.is_closing():  # (not a shutdown's cancel)
                self.stats["client_gone"] += 1
            raise

    async def _parse(self, request: web.Request, kind: str) -> oa.Prompt:
        g = self.cfg.gateway
        if request.content_length is not None and request.content_length > g.max_body_bytes:
            raise oa.HttpError(
                413,
                f"request body of {request.content_length} bytes exceeds the limit of {g.max_body_bytes} bytes",
                code="body_too_large",
            )
        try:
            if request.content.is_eof():  # the whole body came with the headers: no timer
                raw = await request.read()
            else:  # a client that never sends the rest must not hold the connection forever
                raw = await asyncio.wait_for(request.read(), g.body_read_timeout_s)
        except TimeoutError:
            raise oa.HttpError(
                408,
                f"request body not received within {g.body_read_timeout_s:g} s (body_read_timeout_s)",
                code="body_timeout",
            ) from None
        except web.HTTPRequestEntityTooLarge:
            raise oa.HttpError(
                413, f"request body exceeds the limit of {g.max_body_bytes} bytes", code="body_too_large"
            ) from None
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            raise oa.HttpError(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
        except RecursionError:  # msgspec stops at the interpreter's recursion limit (~1,000 levels)
            raise oa.HttpError(400, "request body is nested too deeply", code="invalid_json") from None
        p = oa.parse_body(kind, body)
        tok = self.tokenizers.get(p.model)
        if tok is None:
            raise oa.HttpError(
                404,
                f"model {p.model!r} does not exist; served models: {sorted(self.tokenizers)}",
                "not_found_error",
                "model_not_found",
                param="model",
            )
        try:
            if kind == "chat":
                p.text = tok.render_chat(oa.chat_messages(p.body))
                p.token_ids = tok.encode(p.text)
            elif p.text is not None:
                p.token_ids = tok.encode(p.text, add_special_tokens=True)
        except TemplateError as exc:
            raise oa.HttpError(400, str(exc), code="chat_template_error", param="messages") from None
        if not p.token_ids:
            raise oa.HttpError(400, "the prompt has no tokens", code="empty_prompt")
        if len(p.token_ids) > g.max_prompt_tokens:
            raise oa.HttpError(
                400,
                f"prompt of {len(p.token_ids)} tokens exceeds the limit of {g.max_prompt_tokens} tokens",
                code="prompt_too_long",
            )
        limit = self.max_model_len[p.model]
        room = limit - len(p.token_ids)  # output tokens the context window leaves
        if p.max_tokens is None:
            if room < 1:
                raise oa.HttpError(
                    400,
                    f"this model's maximum context length is {limit} tokens; the prompt has "
                    f"{len(p.token_ids)} tokens, leaving no room for output. Shorten the prompt.",
                    code="context_length_exceeded",
                    param="messages" if kind == "chat" else "prompt",
                )
            p.max_tokens = min(g.default_max_tokens, room)
            p.body = {**p.body, "max_tokens": p.max_tokens}
        elif p.max_tokens > room:
            raise oa.HttpError(
                400,
                f"this model's maximum context length is {limit} tokens; you requested "
                f"{len(p.token_ids) + p.max_tokens} tokens ({len(p.token_ids)} in the prompt, "
                f"{p.max_tokens} in max_tokens). Reduce the prompt or max_tokens.",
                code="context_length_exceeded",
                param="max_tokens",
            )
        return p


def make_app(gw: Gateway) -> web.Application:
    """The aiohttp application (body size checked by the handlers, so oversize answers an OpenAI-style 413;
    unknown routes and methods an OpenAI-style 404 / 405, from a catch-all resource added last)."""
    routes = {
        "/v1/completions": ("POST", gw.completions),
        "/v1/chat/completions": ("POST", gw.chat),
        "/v1/models": ("GET", gw.models),
        "/health": ("GET", gw.health_endpoint),
    }

    async def no_route(request: web.Request) -> web.Response:
        allowed = routes.get(request.path, (None,))[0]
        if allowed is not None:
            err = oa.HttpError(
                405, f"{request.method} is not allowed on {request.path}; use {allowed}", code="method_not_allowed"
            )
            return web.json_response(err.body(), status=405, headers={"Allow": allowed})
        err = oa.HttpError(404, f"no route {request.path}; the gateway serves {', '.join(routes)}", code="not_found")
        return web.json_response(err.body(), status=404)

    app = web.Application(client_max_size=gw.cfg.gateway.max_body_bytes)
    app.add_routes(
        [
            (web.post if method == "POST" else web.get)(path, handler)  # web.get: HEAD too
            for path, (method, handler) in routes.items()
        ]
    )
    app.router.add_route("*", "/{tail:.*}", no_route)
    return app


async def run(cfg: GatewayConfig, ready_file: str | None = None, link: WorkerLink | None = None) -> None:
    """Serve until SIGINT/SIGTERM. `link`: a worker of `--workers` (serves its supervisor's socket).

    Raises:
        PortInUse: the listen port is taken (checked before connecting to the daemon, and at bind).
        DaemonUnavailable: no daemon answered within `connect_timeout_s`.
    """
    host, port = cfg.gateway.host, cfg.gateway.port
    sock = link.attach() if link else None  # a worker of `--workers` serves its supervisor's socket
    if sock is None:
        check_listen_address(host, port)
    gw = Gateway(cfg)
    runner = None
    try:
        await gw.start()
        runner = web.AppRunner(make_app(gw), handler_cancellation=True, access_log=None)
        await runner.setup()
        try:
            # SockSite listens again: without backlog= its 128 would replace the supervisor's 1024.
            site = (
                web.SockSite(runner, sock, backlog=LISTEN_BACKLOG)
                if sock
                else web.TCPSite(runner, host, port, backlog=LISTEN_BACKLOG)
            )
            await site.start()
        except OSError as exc:  # taken while the gateway waited for its daemon
            raise port_error(host, port, exc) from None
        await _serve_until_signal(runner, cfg, ready_file, link)
    finally:
        if runner is not None:
            await runner.cleanup()
        await gw.stop()


async def _serve_until_signal(
    runner: web.AppRunner, cfg: GatewayConfig, ready_file: str | None, link: WorkerLink | None
) -> None:
    port = runner.addresses[0][1] if runner.addresses else cfg.gateway.port
    log.info("listening on http://%s", host_port(cfg.gateway.host, port))
    if link:
        link.announce(port)
    elif ready_file:
        with open(ready_file, "w") as fh:
            fh.write(str(port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point of `kvsched-gateway`."""
    ap = argparse.ArgumentParser(
        prog="kvsched-gateway",
        description="OpenAI-compatible gateway in front of engines scheduled by a kvsched daemon (docs/GATEWAY.md).",
    )
    ap.add_argument("--config", required=True, help="gateway TOML: [gateway] and [[models]] (docs/GATEWAY.md)")
    ap.add_argument(
        "--host", type=host_arg, help="listen address; an IPv6 one bare or in brackets (overrides [gateway] host)"
    )
    ap.add_argument("--port", type=port_arg, help="listen port 0-65535, 0 = any free port (overrides [gateway] port)")
    ap.add_argument(
        "--workers",
        type=int_range_arg(0, MAX_WORKERS),
        metavar="N",
        help="gateway processes "
        "sharing one listening socket, each with its own daemon connection; 0 = one per CPU, at "
        f"most {MAX_WORKERS} (overrides [gateway] workers; default 1)",
    )
    ap.add_argument(
        "--ready-file", type=ready_file_arg, help="write the bound port here once serving (for scripts and tests)"
    )
    ap.add_argument("--log-level", type=log_level_arg, default="INFO", help="DEBUG, INFO, WARNING (default INFO)")
    ap.add_argument("--worker-of", type=WorkerLink.parse, help=argparse.SUPPRESS)  # set by --workers on its workers
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s %(message)s")
    try:
        cfg = load_gateway_config(args.config)
        if args.host is not None:  # never empty (host_arg)
            cfg.gateway.host = args.host
        if args.port is not None:
            cfg.gateway.port = args.port
        workers = cfg.gateway.workers if args.workers is None else args.workers  # both in [0, MAX_WORKERS]
        if workers == 0:
            workers = min(default_workers(), MAX_WORKERS)
        if workers > 1 and not args.worker_of:
            for m in cfg.models:  # a bad model is reported once, here, not by each worker
                _tokenizer(m)
            try:
                sock = listen_socket(cfg.gateway.host, cfg.gateway.port)
            except (OSError, OverflowError) as exc:
                raise port_error(cfg.gateway.host, cfg.gateway.port, exc) from None
            sys.exit(
                supervise(
                    args.config, sock, workers, args.ready_file, args.log_level, cfg.gateway.connect_timeout_s + 60.0
                )
            )
        import uvloop

        uvloop.install()
        asyncio.run(run(cfg, args.ready_file, link=args.worker_of))
    except ConfigError as exc:
        print(f"kvsched-gateway: {exc}", file=sys.stderr)
        sys.exit(2)
    except DaemonUnavailable as exc:
        print(f"kvsched-gateway: {exc}", file=sys.stderr)
        sys.exit(3)
    except PortInUse as exc:
        print(f"kvsched-gateway: {exc.strerror}", file=sys.stderr)
        sys.exit(2)
