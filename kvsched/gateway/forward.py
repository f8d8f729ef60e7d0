"""One request through the gateway: schedule -> forward -> stream -> release (docs/GATEWAY.md).

Lease lifecycle against the engine's answer: `dispatched()` when the engine answers 200,
`prefill_done()` at the first chunk, output tokens from the engine's per-chunk usage as they stream,
`release("completed")` after `[DONE]`, `release("aborted")` on an engine error, a client disconnect
(the handler is cancelled) or any other exception. A lease the daemon drops while the engine serves
it (`LeaseLost`: its worker removed by an operator, or this gateway's link reaped) stops being
reported on, but the stream the engine is still sending is relayed to the end. A lease an operator
revokes (`kvsched cancel`, `LeaseRevoked`) aborts the request at once: the engine connection is
closed (vLLM aborts a request whose connection closes) and the client gets a 503, or an error event
ending its stream. An engine failure before the first chunk
(connection error, timeout, 5xx, stream closed empty) releases `aborted`, marks the worker failing
and retries once with it in `excluded_workers`; a second failure answers 502.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any, Protocol

import aiohttp
import msgspec
from aiohttp import web

from ..client.lease import Lease
from ..errors import LeaseLost, LeaseRevoked
from .config import GatewayConfig
from .health import EngineHealth, EngineUnhealthy
from .openai import Collector, HttpError, Prompt, engine_body
from .relay import EngineStreamError, Relay

log = logging.getLogger(__name__)


class GatewayParts(Protocol):
    """What forwarding uses of the gateway that serves the request (`app.Gateway` is the one
    implementation; stated here so this module does not import the app, which imports it)."""

    cfg: GatewayConfig
    session: aiohttp.ClientSession | None
    health: EngineHealth | None
    engine_timeout: aiohttp.ClientTimeout
    stats: Counter

    async def schedule(self, request_id: str, isl: int, hashes: Any, excluded: set[int], hints: dict) -> Lease: ...


_json_decode = msgspec.json.decode
_json_encode = msgspec.json.encode
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
_now = time.perf_counter


class Marks:
    """When one request passed each step in this process (`time.perf_counter`, s), sent back as a
    `Server-Timing` header (W3C Server Timing) with the successful response:
    `prep` = handler start -> parsed, tokenized, hashed; `schedule` = -> admitted (the daemon's
    round trip plus any queueing); `queue` = the part of `schedule` the request waited in the
    daemon's queue (its `Admitted.queued_us`); `engine` = -> the engine's response headers
    (connect, request, the engine's own wait). Durations in ms; engine retries are inside
    `schedule` + `engine`."""

    __slots__ = ("admitted", "engine", "prepared", "queued_us", "start")

    def __init__(self) -> None:
        self.start = _now()
        self.prepared = self.admitted = self.engine = self.start
        self.queued_us = 0

    def header(self) -> str:
        return (
            f"prep;dur={(self.prepared - self.start) * 1e3:.3f}, "
            f"schedule;dur={(self.admitted - self.prepared) * 1e3:.3f}, "
            f"queue;dur={self.queued_us / 1e3:.3f}, "
            f"engine;dur={(self.engine - self.admitted) * 1e3:.3f}"
        )


class EngineFailed(Exception):
    """The engine failed before producing a token (retryable elsewhere)."""


class ClientGone(Exception):
    """The HTTP client closed its connection: the lease is released `aborted`."""


async def _write(out: web.StreamResponse, data: bytes) -> None:
    try:
        await out.write(data)
    except (ConnectionError, aiohttp.ClientConnectionResetError) as exc:
        raise ClientGone(str(exc)) from None


async def serve(
    gw: GatewayParts, request: web.Request, p: Prompt, path: str, hints: dict, hashes, request_id: str, marks: Marks
) -> web.StreamResponse:
    """Schedule and forward `p`; returns the response sent (or raises HttpError before any byte)."""
    isl = len(p.token_ids)
    last: EngineFailed | None = None
    failed_here: set[int] = set()  # workers that failed this request (excluded on its retry)
    health = gw.health
    assert health is not None, "Gateway.start() first"
    for _attempt in range(2):
        excluded = health.excluded()  # a fresh set: the health view now (a retry sees the latest)
        excluded |= failed_here
        lease = await gw.schedule(request_id, isl, hashes, excluded, hints)
        marks.admitted = _now()
        marks.queued_us = lease.queued_us
        health.learn(lease.worker.worker_id, lease.url)
        try:
            return await _forward(gw, request, p, path, lease, request_id, marks)
        except EngineFailed as exc:
            lease.release("aborted")
            health.mark_failed(lease.worker.worker_id, str(exc))
            failed_here.add(lease.worker.worker_id)
            last = exc
            gw.stats["engine_retries"] += 1
        except BaseException:
            if not lease.closed:
                lease.release("aborted")
            raise
        finally:
            if lease.outcome == "lost":  # the daemon dropped it while the engine served it
                gw.stats["leases_lost_mid_stream"] += 1
    raise HttpError(502, f"engine failed before the first token, twice: {last}", "engine_error", "engine_failure")


async def _forward(
    gw: GatewayParts, request: web.Request, p: Prompt, path: str, lease: Lease, request_id: str, marks: Marks
) -> web.StreamResponse:
    if not lease.url:
        lease.release("aborted")
        raise HttpError(
            503,
            f"worker {lease.worker.worker_id} has no url in the daemon's config "
            "([[workers]] url, or kvsched add-worker --url)",
            "service_unavailable",
            "no_worker_url",
        )
    headers = {"Content-Type": "application/json", "X-Request-Id": request_id}
    if lease.dp_size > 1:
        headers["X-data-parallel-rank"] = str(lease.worker.dp_rank)
    silence = Silence(asyncio.get_running_loop(), gw.cfg.gateway.engine_read_timeout_s)
    lease.on_dropped(
        lambda dropped: (
            silence.abort(LeaseRevoked(dropped.request_id, dropped.lost_reason))
            if dropped.outcome == "revoked"
            else None
        )
    )
    assert gw.health is not None and gw.session is not None, "Gateway.start() first"
    waiting = gw.health.waiting.setdefault(lease.worker.worker_id, set())
    waiting.add(silence)  # until the response headers: a failed health check of this worker stops it
    try:
        try:
            resp = await gw.session.post(
                lease.url.rstrip("/") + path,
                data=_json_encode(engine_body(p)),
                headers=headers,
                timeout=gw.engine_timeout,
            )
        except asyncio.CancelledError:
            if silence.aborted is not None and silence.task is not None and silence.task.uncancel() == 0:
                if isinstance(silence.aborted, LeaseRevoked):
                    raise silence.aborted from None
                if isinstance(silence.aborted, EngineUnhealthy):
                    raise EngineFailed(str(silence.aborted)) from None
                raise EngineFailed(
                    f"no response headers from the engine within {silence.timeout_s:g} s (engine_read_timeout_s)"
                ) from None
            raise  # the client went away (or both at once)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise EngineFailed(f"{type(exc).__name__}: {exc}") from None
        finally:
            waiting.discard(silence)
        marks.engine = _now()
        silence.streaming(resp)
        async with resp:
            if resp.status >= 500:
                raise EngineFailed(f"engine answered HTTP {resp.status}")
            if resp.status != 200:  # the engine refused the request itself (e.g. 400): pass it on
                body = await resp.read()
                lease.release("aborted")
                gw.stats[f"http_{resp.status}"] += 1  # an answer other than 200 before streaming (docs)
                ctype = resp.headers.get("Content-Type")  # as the engine labelled it (none: none)
                return web.Response(status=resp.status, body=body, headers={"Content-Type": ctype} if ctype else None)
            _report(lease, lease.dispatched)
            return await _stream(gw, request, p, lease, resp, silence, marks)
    except LeaseRevoked as exc:  # before the first byte to the client
        gw.stats["leases_revoked"] += 1
        raise _revoked_error(exc) from None
    finally:
        lease.on_dropped(None)
        silence.cancel()


def _revoked_error(exc: LeaseRevoked) -> HttpError:
    """The answer to a request whose lease an operator revoked: 503 `cancelled`, no Retry-After
    (the same as a request cancelled while it waited, docs/GATEWAY.md)."""
    return HttpError(503, f"the request was cancelled by an operator: {exc}", "service_unavailable", "cancelled")


class Silence:
    """The engine's longest silence (`engine_read_timeout_s`): for its response headers, then
    between two reads of its stream, with one timer per request.

    aiohttp's own `sock_read` timeout cancels and re-creates a timer on every piece of data the
    connection receives (i.e. per streamed token), and `asyncio.timeout` around the request costs
    a timer too (docs/BENCHMARKS.md, `bench/bench_gateway.py`). Here each read stores the loop time (`touch`);
    the timer fires at most once per `timeout_s` and re-arms from the last read. After a full
    `timeout_s` without data it cancels the waiting task while no response has arrived (`aborted`
    tells the caller the cancellation was ours), or fails the stream with aiohttp's
    `ServerTimeoutError` (what `sock_read` raised) and closes the connection. `abort` does the same
    at once for another cause (a revoked lease).

    Args:
        loop: the running loop (the current task is the one cancelled). timeout_s: longest silence (s).
    """

    __slots__ = ("aborted", "handle", "last", "loop", "resp", "task", "timeout_s")

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop = loop
        self.timeout_s = timeout_s
        self.resp: aiohttp.ClientResponse | None = None
        self.task = asyncio.current_task(loop)
        self.aborted: BaseException | None = None
        self.last = loop.time()
        self.handle: asyncio.TimerHandle | None = loop.call_at(self.last + timeout_s, self._fire)

    def streaming(self, resp: aiohttp.ClientResponse) -> None:
        """The response headers arrived: from now on a silence fails `resp`'s stream."""
        self.resp = resp
        self.last = self.loop.time()

    def touch(self) -> None:
        """Data arrived now."""
        self.last = self.loop.time()

    def _fire(self) -> None:
        idle = self.loop.time() - self.last
        if idle < self.timeout_s:
            self.handle = self.loop.call_at(self.last + self.timeout_s, self._fire)
            return
        self.handle = None
        self.abort(
            aiohttp.ServerTimeoutError(
                f"engine sent nothing for {idle:.1f} s (engine_read_timeout_s = {self.timeout_s:g})"
            )
        )

    def abort(self, exc: BaseException) -> None:
        """Stop the engine request now (once): before its response headers, cancel the waiting task
        (`aborted` = exc tells the caller why); after them, fail its stream with `exc` and close
        the engine connection."""
        if self.aborted is not None:
            return
        self.aborted = exc
        self.cancel()
        if self.resp is None:
            if self.task is not None:
                self.task.cancel()
            return
        self.resp.content.set_exception(exc)
        self.resp.close()

    def cancel(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


def _sse_data(buf: bytearray, piece: bytes) -> list[bytes]:
    """The payloads of the `data:` lines (SSE) completed by `piece`; an incomplete last line stays
    in `buf`. A piece that ends a line with nothing pending (the usual read) is split as it is,
    without copying it through `buf`."""
    if not buf and piece.endswith(b"\n"):
        block = piece
    else:
        buf += piece
        cut = buf.rfind(b"\n")
        if cut < 0:
            return []
        block = bytes(buf[:cut])
        del buf[: cut + 1]
    return [ln[5:].strip() for ln in block.split(b"\n") if ln.startswith(b"data:")]


def _report(lease: Lease, call, *args: int) -> None:
    """One progress report (`dispatched`, `prefill_done`, `add_output_tokens`) on `lease`. A lost
    lease (LeaseLost: the daemon released its booking, e.g. `kvsched remove-worker`; the client has
    logged it) is not reported on any more; the caller keeps relaying the engine's stream.

    Raises:
        LeaseRevoked: an operator cancelled the lease (the caller aborts the request)."""
    if lease.outcome == "lost":
        return
    try:
        call(*args)
    except LeaseRevoked:
        raise
    except LeaseLost:
        pass


async def _stream(
    gw: GatewayParts,
    request: web.Request,
    p: Prompt,
    lease: Lease,
    resp: aiohttp.ClientResponse,
    silence: Silence,
    marks: Marks,
) -> web.StreamResponse:
    """Relay the engine's SSE stream. Reads whatever has arrived (`iter_any`), passes each chunk
    through `Relay` and writes what it relays in one write per read; the output tokens of a read are
    reported to the lease once, so a burst of chunks costs one syscall and one progress update, not
    one per token."""
    out: web.StreamResponse | None = None
    collector = None if p.stream else Collector(p.kind)
    # A non-streaming client gets everything collected (usage included) into one response.
    relay = Relay(p.kind, p.include_usage or collector is not None, p.continuous_usage or collector is not None)
    first = True
    done = False
    buf = bytearray()
    try:
        async for piece in resp.content.iter_any():
            silence.touch()
            pending: list[bytes] = []
            for data in _sse_data(buf, piece):
                if data == b"[DONE]":
                    done = True
                    break
                relayed = relay.chunk(data)
                if first and relay.chunks:
                    first = False
                    _report(lease, lease.prefill_done)
                if relayed is None:
                    continue
                if collector is not None:
                    collector.add(_json_decode(relayed))
                    continue
                pending.append(b"data: " + relayed + b"\n\n")
            if relay.output_tokens > lease.output_tokens:
                _report(lease, lease.add_output_tokens, relay.output_tokens - lease.output_tokens)
            if pending:
                if out is None:
                    out = web.StreamResponse(headers={**SSE_HEADERS, "Server-Timing": marks.header()})
                    await out.prepare(request)
                await _write(out, b"".join(pending))
            if done:
                break
        if not done:  # a clean end of the body without [DONE]: the engine stopped mid-answer (vLLM always ends with it)
            raise EngineStreamError("the engine ended the stream without [DONE]")
    except LeaseRevoked as exc:  # `kvsched cancel`: the engine connection is closed (Silence.abort)
        resp.close()
        gw.stats["leases_revoked"] += 1
        if out is None:
            raise _revoked_error(exc) from None
        err = _revoked_error(exc)
        await _write(
            out,
            b"data: " + _json_encode({"error": {"message": err.message, "type": err.err_type, "code": 503}}) + b"\n\n",
        )
        await out.write_eof()
        return out
    except (TimeoutError, aiohttp.ClientError, msgspec.DecodeError, EngineStreamError) as exc:
        if first:
            raise EngineFailed(f"{type(exc).__name__}: {exc}") from None
        lease.release("aborted")
        gw.stats["engine_errors_mid_stream"] += 1
        if out is None:
            raise HttpError(502, f"engine failed mid-stream: {exc}", "engine_error", "engine_failure") from None
        await _write(
            out,
            b"data: "
            + _json_encode(
                {"error": {"message": f"engine failed mid-stream: {exc}", "type": "engine_error", "code": 502}}
            )
            + b"\n\n",
        )
        await out.write_eof()
        return out
    lease.release("completed")
    gw.stats["completed"] += 1
    if collector is not None:
        return web.json_response(
            collector.response(), dumps=lambda o: _json_encode(o).decode(), headers={"Server-Timing": marks.header()}
        )
    if out is None:
        out = web.StreamResponse(headers={**SSE_HEADERS, "Server-Timing": marks.header()})
        await out.prepare(request)
    await _write(out, b"data: [DONE]\n\n")
    await out.write_eof()
    return out
