"""The wall-clock fleet process: M `SimEngine`s behind one ZeroMQ ROUTER, time scaled by `speedup`.

Routers (DEALER) send `SimSubmit` for a request the daemon admitted; the fleet answers on the same
connection with `SimBatch` frames carrying `SimFirstToken` (prefill done, with the engine's cached
tokens), periodic `SimProgress` (output tokens so far) and `SimDone`; `SimError` if the request
cannot run (unknown worker). Simulated time is `(monotonic() - t0) * speedup` in µs, with `t0`
shared by the orchestrator so routers and fleet agree on the timeline.

CPU: one thread; it wakes on a frame or every `tick_ms`, advances every engine to "now" (macro
steps, so cost is per event), and sends one batch per router per wake.

KV events (`FleetParams.kv_events`): each engine publishes its prefix-cache changes as vLLM KV
events (`KvEventPublisher`, encoding `kv_encoding`) on its own PUB socket with a replay ROUTER;
the events of one wake go out as one batch per engine, and replay requests are answered every wake.
"""

from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np
import zmq
from msgspec import Meta

from ..protocol import WorkerKey
from .engine import DONE, FIRST_TOKEN, SeqRecord, SimEngine, SimRequest
from .fleet_spec import FleetSpec, make_engines
from .kv_publisher import KvEventPublisher
from .tokens import TokenIdPublisher

log = logging.getLogger(__name__)

Tokens = Annotated[int, Meta(ge=0, le=2**31 - 1)]


class SimFrame(msgspec.Struct, frozen=True, array_like=True, tag_field="t"):
    """Base of the fleet's frames (simulator only; not part of the kvsched protocol)."""


class SimSubmit(SimFrame, tag="submit", frozen=True):
    """Router → fleet: run this admitted request on (worker_id, dp_rank). Answered by events."""

    request_id: str
    worker_id: int
    dp_rank: int
    isl: Annotated[int, Meta(ge=1)]  # prompt tokens
    osl: Annotated[int, Meta(ge=1)]  # output tokens to generate
    hashes: bytes = b""  # little-endian u64 block hashes


class SimFirstToken(SimFrame, tag="first", frozen=True):
    """Fleet → router: prefill finished at simulated `t_us`; `cached_tokens` came from the cache.

    `overlap_blocks` / `best_overlap_blocks`: leading prompt blocks cached, at submission, on the
    chosen engine / on the engine with the deepest such prefix (the ground truth every router's
    overlap is judged against: "overlap given up" = best - chosen)."""

    request_id: str
    t_us: int
    cached_tokens: Tokens
    overlap_blocks: int = 0
    best_overlap_blocks: int = 0


class SimProgress(SimFrame, tag="progress", frozen=True):
    """Fleet → router: output tokens produced so far."""

    request_id: str
    output_tokens: Tokens


class SimDone(SimFrame, tag="done", frozen=True):
    """Fleet → router: last token produced at simulated `t_us`."""

    request_id: str
    t_us: int
    output_tokens: Tokens


class SimError(SimFrame, tag="error", frozen=True):
    """Fleet → router: the request cannot run (the router aborts its lease)."""

    request_id: str
    message: str


class SimBatch(SimFrame, tag="batch", frozen=True):
    """Fleet → router: the events of one wake, in order."""

    items: list[SimFirstToken | SimProgress | SimDone | SimError]


@dataclass(frozen=True, slots=True)
class FleetParams:
    """What the fleet process needs (picklable, for multiprocessing spawn)."""

    endpoint: str  # ROUTER bind address, e.g. ipc:///tmp/kvsched-replay-x/fleet.sock
    spec: FleetSpec
    speedup: float = 1.0
    tick_ms: float = 5.0  # wall ms between engine advances when no frame arrives
    progress_ms: float = 100.0  # wall ms between progress reports per running request
    stats_path: str | None = None  # write engine counters here (JSON) on exit
    # (pub, replay) endpoints per engine in `spec.worker_keys()` order; () = no KV events (`kv_event_endpoints`)
    kv_events: tuple[tuple[str, str | None], ...] = ()
    kv_encoding: str = "array"  # "array" (older vLLM) | "map" (newer vLLM)
    kv_token_ids: bool = False  # BlockStored events carry synthetic token ids (`tokens.py`; Dynamo needs them)


def kv_event_endpoints(spec: FleetSpec, runtime_dir: str | Path, transport: str = "ipc") -> tuple[tuple[str, str], ...]:
    """(pub, replay) endpoints per engine: ipc sockets in `runtime_dir`, or free tcp loopback ports.

    tcp ports are found by binding port 0 and closing again (a small race, acceptable for a simulator).
    """
    if transport == "ipc":
        return tuple(
            (f"ipc://{runtime_dir}/kv-{k.worker_id}.pub", f"ipc://{runtime_dir}/kv-{k.worker_id}.replay")
            for k in spec.worker_keys()
        )
    if transport != "tcp":
        raise ValueError(f"unknown KV-event transport {transport!r} (expected 'ipc' or 'tcp')")

    ports = []
    socks = []
    for _ in range(2 * spec.workers):
        sk = socket.socket()
        sk.bind(("127.0.0.1", 0))
        socks.append(sk)
        ports.append(sk.getsockname()[1])
    for sk in socks:
        sk.close()
    return tuple(
        (f"tcp://127.0.0.1:{ports[2 * i]}", f"tcp://127.0.0.1:{ports[2 * i + 1]}") for i in range(spec.workers)
    )


class Fleet:
    """M engines in scaled wall-clock time behind one ROUTER socket (module docstring)."""

    def __init__(self, params: FleetParams, ctx: zmq.Context | None = None) -> None:
        self.params = params
        max_macro_us = max(100_000, int(params.progress_ms * 1000 * params.speedup))
        self.engines: dict[WorkerKey, SimEngine] = make_engines(params.spec, max_macro_us=max_macro_us)
        self._ctx = ctx or zmq.Context.instance()
        self.sock = self._ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.bind(params.endpoint)
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(SimSubmit)
        self.publishers: list[KvEventPublisher] = []
        for key, (pub, replay) in zip(params.spec.worker_keys(), params.kv_events, strict=False):  # () = none
            publisher = KvEventPublisher(self._ctx, pub, replay, encoding=params.kv_encoding)
            self.engines[key].cache_listener = TokenIdPublisher(publisher) if params.kv_token_ids else publisher
            self.publishers.append(publisher)
        self._owner: dict[str, bytes] = {}  # request_id -> router identity
        self._reported: dict[str, int] = {}  # request_id -> output tokens last reported
        self._out: dict[bytes, list] = {}
        self._overlap: dict[str, tuple[int, int]] = {}  # request_id -> (chosen, best) cached blocks at submit
        self.t0 = 0.0
        self.submitted = 0
        self.completed = 0

    def now_us(self) -> int:
        return max(0, int((time.monotonic() - self.t0) * self.params.speedup * 1e6))

    def serve(self, t0: float, should_stop) -> None:
        """Run until `should_stop()` is true. `t0`: monotonic seconds of simulated time 0."""
        self.t0 = t0
        tick = max(1, int(self.params.tick_ms))
        next_progress = time.monotonic()
        while not should_stop():
            if self.sock.poll(tick, zmq.POLLIN):
                self._drain()
            now = self.now_us()
            for engine in self.engines.values():
                self._collect(engine.advance(now))
            mono = time.monotonic()
            if mono >= next_progress:
                next_progress = mono + self.params.progress_ms / 1000.0
                self._progress()
            self._flush()
            self.publish_kv_events()

    def publish_kv_events(self) -> None:
        """One KV-event batch per engine with cache changes since the last call; answer replays."""
        for publisher in self.publishers:
            publisher.flush()

    def _drain(self) -> None:
        for _ in range(1024):
            try:
                ident, raw = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = self._dec.decode(raw)
            except msgspec.DecodeError as exc:
                log.warning("fleet: undecodable frame peer=%s err=%s", ident.hex(), exc)
                continue
            self._submit(ident, msg)

    def _submit(self, ident: bytes, msg: SimSubmit) -> None:
        engine = self.engines.get(WorkerKey(msg.worker_id, msg.dp_rank))
        if engine is None:
            self._out.setdefault(ident, []).append(SimError(msg.request_id, f"no engine {msg.worker_id}:{msg.dp_rank}"))
            return
        now = self.now_us()
        self._collect(engine.advance(now))  # steps that ended before the arrival happen first
        hashes = tuple(np.frombuffer(msg.hashes, dtype="<u8").tolist())
        try:
            engine.submit(SimRequest(msg.request_id, msg.isl, msg.osl, hashes), now)
        except ValueError as exc:
            self._out.setdefault(ident, []).append(SimError(msg.request_id, str(exc)))
            return
        self._owner[msg.request_id] = ident
        self._reported[msg.request_id] = 0
        self._overlap[msg.request_id] = (
            engine.cached_prefix_blocks(hashes),
            max(e.cached_prefix_blocks(hashes) for e in self.engines.values()),
        )
        self.submitted += 1

    def _collect(self, events: list[tuple[int, SeqRecord]]) -> None:
        for kind, rec in events:
            rid = rec.request.request_id
            ident = self._owner.get(rid)
            if ident is None:
                continue
            out = self._out.setdefault(ident, [])
            if kind == FIRST_TOKEN:
                out.append(SimFirstToken(rid, rec.first_token_us, rec.cached_tokens, *self._overlap.pop(rid, (0, 0))))
            elif kind == DONE:
                out.append(SimDone(rid, rec.done_us, rec.output_tokens))
                del self._owner[rid]
                self._reported.pop(rid, None)
                self.completed += 1

    def _progress(self) -> None:
        for engine in self.engines.values():
            for rec in engine.running():
                rid = rec.request.request_id
                last = self._reported.get(rid)
                if last is not None and rec.output_tokens > last:
                    self._reported[rid] = rec.output_tokens
                    self._out.setdefault(self._owner[rid], []).append(SimProgress(rid, rec.output_tokens))

    def _flush(self) -> None:
        for ident, items in self._out.items():
            if not items:
                continue
            try:
                self.sock.send_multipart([ident, self._enc.encode(SimBatch(items))])
            except zmq.ZMQError as exc:  # the router went away (EHOSTUNREACH): drop its events
                log.warning("fleet: cannot deliver peer=%s events=%d err=%s", ident.hex(), len(items), exc)
        self._out.clear()

    def stats(self) -> dict:
        per = {}
        for key, e in self.engines.items():
            s = e.stats
            per[str(key)] = {
                "steps": s.steps,
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.cached_tokens,
                "evicted_blocks": s.evicted_blocks,
                "finished": s.finished,
                "live": e.num_live,
            }
        return {
            "submitted": self.submitted,
            "completed": self.completed,
            "engines": per,
            "kv_event_batches": sum(p.seq for p in self.publishers),
            "kv_replays_served": sum(p.replays_served for p in self.publishers),
        }

    def close(self) -> None:
        if self.params.stats_path:
            Path(self.params.stats_path).write_bytes(msgspec.json.encode(self.stats()))
        for publisher in self.publishers:
            publisher.close()
        self.sock.close(0)


def fleet_main(params: FleetParams, ready, go, t0_value, stop) -> None:
    """Process entry (multiprocessing spawn): bind, signal `ready`, wait for `go`, serve until `stop`.

    Args:
        ready / go / stop: multiprocessing Events. t0_value: multiprocessing Value('d') holding the
            monotonic time of simulated time 0 (set before `go`).
    """
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s fleet %(levelname)s %(message)s")
    ctx = zmq.Context()
    fleet = Fleet(params, ctx)
    try:
        ready.set()
        while not go.wait(0.1):
            if stop.is_set():
                return
        fleet.serve(t0_value.value, stop.is_set)
    finally:
        fleet.close()
        ctx.term()
