"""Admin socket handlers: one function per admin command, each `(request, ctx, now_us) -> (reply, outcomes)`.

The admin socket is a separate ROUTER (mode 0600). Handlers run on the actor like every other
mutation, so admin operations are serialized with scheduling (docs/DESIGN.md §2.5). Reload re-reads the profile
through `load_config_keys` and hands it to `Scheduler.reload`, which refuses (keeping the old profile) when
a class holding requests would disappear.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import zmq

from .. import protocol as p
from ..config import Config, load_config_keys, url_problem
from ..core.reload import restart_only_changes
from ..core.types import WorkerKey
from ..endpoints import endpoint_problem
from ..errors import ConfigError
from . import runtime_workers
from .kv_sources import KvEventSource

log = logging.getLogger(__name__)


@dataclass(slots=True)
class AdminContext:
    """What admin handlers may read besides the scheduler.

    Attributes:
        scheduler: the `Scheduler`.
        instance / endpoint / block_size / daemon_epoch: identity shown by `status`.
        config_path: the file `reload` re-reads (None = defaults only).
        started_s: monotonic start time (s), for uptime.
        connections: callable returning the number of live router connections.
        kv_events: the `KvEventSubscriber` (AddWorker / RemoveWorker add and remove its sources), or None.
        worker_urls: worker_id -> base URL (`Admitted.url`), shared with the actor.
        hash_check: the KV-event `HashCheck` (its bad rows flag `kvsched workers`), or None.
        kv_index: the KV-index segment, where a runtime-added worker's URL and KV-event endpoints
            are kept for a restarted daemon (`runtime_workers`), or None.
        running: the config the daemon started with (`reload` names what differs in the sections it
            does not apply), or None.
    """

    scheduler: object
    instance: str
    endpoint: str
    block_size: int
    daemon_epoch: int
    config_path: str | None
    started_s: float = field(default_factory=time.monotonic)
    connections: Callable[[], int] = lambda: 0
    decisions_window: list = field(default_factory=lambda: [time.monotonic(), 0])
    config_overrides: dict | None = None
    kv_events: object | None = None
    worker_urls: dict = field(default_factory=dict)
    hash_check: object | None = None
    kv_index: object | None = None
    running: Config | None = None


def handle(req: p.AdminRequest, ctx: AdminContext, now_us: int):
    """Dispatch one admin request. Returns (AdminReply, list of scheduler outcomes to deliver)."""
    s = ctx.scheduler
    match req:
        case p.Status():
            return _status(ctx), []
        case p.Queues():
            rows = s.queues(now_us)
            if req.policy_class is not None:
                rows = [r for r in rows if r.name == req.policy_class]
                if not rows:
                    return _err(p.ErrorCode.NOT_FOUND, f"no class named {req.policy_class!r}"), []
            return p.QueuesReply(classes=rows), []
        case p.Workers():
            return p.WorkersReply(workers=_flag_hash_mismatch(ctx, s.workers())), []
        case p.Leases():
            if req.policy_class is not None and all(cq.name != req.policy_class for cq in s.pq.classes):
                return _err(p.ErrorCode.NOT_FOUND, f"no class named {req.policy_class!r}"), []
            if req.worker_id is not None and all(w.worker_id != req.worker_id for w in s.workers()):
                return _err(p.ErrorCode.NOT_FOUND, f"no worker {req.worker_id} is registered"), []
            if req.worker_id is None and req.policy_class is None:
                rows, total = s.leases(now_us, limit=req.limit), s.active_leases
            else:  # total counts the leases that match the filter (bounded by max_slots)
                matching = s.leases(
                    now_us, worker_id=req.worker_id, policy_class=req.policy_class, limit=max(1, s.active_leases)
                )
                rows, total = matching[: req.limit], len(matching)
            return p.LeasesReply(leases=rows, total=total), []
        case p.Drain() | p.Undrain():
            drained = isinstance(req, p.Drain)
            try:
                outcomes = s.set_drained(req.worker_id, req.dp_rank, drained, now_us)
            except KeyError:
                return _err(p.ErrorCode.NOT_FOUND, f"unknown worker {_w(req)}"), []
            log.info("%s worker=%s", "drained" if drained else "undrained", _w(req))
            return p.OkReply(message=f"{'drained' if drained else 'undrained'} {_w(req)}"), outcomes
        case p.AddWorker():
            key = WorkerKey(req.worker_id, req.dp_rank)
            if req.kv_events_endpoint and ctx.kv_events is None:
                return _err(p.ErrorCode.INVALID, "this daemon has no KV-event subscriber"), []
            problem = _add_worker_problem(req)
            if problem:  # checked before anything is registered: a corrected retry is not "already registered"
                return _err(p.ErrorCode.INVALID, problem), []
            row = s.ledger.row_of(key)
            if (
                row is not None
                and _same_capacities(s, row, req)
                and runtime_workers.kept_matches(ctx.kv_index, s.ledger.arrays.w_generation, row, req)
            ):
                return p.OkReply(message=f"{key} already registered with these settings"), []
            restoring = _restored_bare(ctx, req, row)
            if not restoring:
                try:
                    s.add_worker(key, req.total_kv_blocks, req.max_num_batched_tokens)
                except ValueError as exc:
                    return _err(p.ErrorCode.INVALID, str(exc)), []
            if req.kv_events_endpoint:
                try:
                    _add_kv_source(ctx, req, s.ledger.row_of(key))
                except zmq.ZMQError as exc:  # e.g. an ipc path longer than the OS allows: undo the add
                    if not restoring:
                        s.remove_worker(req.worker_id, req.dp_rank, now_us)
                    return _err(p.ErrorCode.INVALID, f"kv_events_endpoint {req.kv_events_endpoint!r}: {exc}"), []
            if req.url:
                ctx.worker_urls[req.worker_id] = req.url
            runtime_workers.remember(ctx.kv_index, s.ledger.arrays.w_generation, s.ledger.row_of(key), req)
            done = "restored url / KV events of" if restoring else "added"
            log.info(
                "worker %s worker=%d:%d kv_events=%s", done, req.worker_id, req.dp_rank, req.kv_events_endpoint or "-"
            )
            return p.OkReply(message=f"{done} {req.worker_id}:{req.dp_rank}"), s.drain_cleanup(now_us)
        case p.RemoveWorker():
            try:
                rows = s.rows_of(req.worker_id, req.dp_rank)  # the rows RemoveWorker frees
                outcomes = s.remove_worker(req.worker_id, req.dp_rank, now_us)
            except KeyError:
                return _err(p.ErrorCode.NOT_FOUND, f"unknown worker {_w(req)}"), []
            for row in rows:
                runtime_workers.forget(ctx.kv_index, row)
            if ctx.kv_events is not None:
                for row in rows:
                    ctx.kv_events.remove_source(row)
            if ctx.hash_check is not None:
                for row in rows:
                    ctx.hash_check.bad_rows.pop(row, None)
            if s.ledger.ranks_of(req.worker_id) == 0:
                ctx.worker_urls.pop(req.worker_id, None)
            log.info("worker removed worker=%s", _w(req))
            return p.OkReply(message=f"removed {_w(req)}"), outcomes
        case p.Cancel():
            told = s.cancel(req.request_id, now_us)
            if told is None:
                return _err(p.ErrorCode.NOT_FOUND, f"no queued request or lease {req.request_id!r}"), []
            log.info("cancelled by operator request_id=%s", req.request_id)
            return p.OkReply(message=f"cancelled {req.request_id}"), told + s.drain_cleanup(now_us)
        case p.Reload():
            return _reload(req, ctx), s.drain_cleanup(now_us)
        case p.Explain():
            reply = s.explain(req.request_id)
            if reply is None:
                return _err(p.ErrorCode.NOT_FOUND, f"no recent decision for {req.request_id!r}"), []
            return reply, []
    return _err(p.ErrorCode.INVALID, f"unsupported admin request {type(req).__name__}"), []


def _flag_hash_mismatch(ctx: AdminContext, rows: list) -> list:
    """Set `hash_mismatch` on the rows whose latest KV-event hash check failed."""
    bad = getattr(ctx.hash_check, "bad_rows", None)
    if not bad:
        return rows

    keys = set()
    for row in list(bad):
        try:
            keys.add(tuple(ctx.scheduler.ledger.key_of(row)))
        except (KeyError, IndexError, ValueError):
            continue
    return [msgspec.structs.replace(w, hash_mismatch=True) if (w.worker_id, w.dp_rank) in keys else w for w in rows]


def _restored_bare(ctx: AdminContext, req: p.AddWorker, row: int | None) -> bool:
    """True when `req` re-adds a rank that a restarted daemon re-adopted from shared memory with the
    same capacities but without what lives only in the old process: its `url` and its KV-event
    subscription (a rank added at runtime, not listed in the config). Re-running the same
    `add-worker` then restores them instead of answering "already registered"."""
    if row is None or not (req.url or req.kv_events_endpoint) or not _same_capacities(ctx.scheduler, row, req):
        return False
    has_stream = ctx.kv_events is not None and any(st.src.row == row for st in ctx.kv_events.streams)
    return req.worker_id not in ctx.worker_urls and not has_stream


def _same_capacities(s, row: int, req: p.AddWorker) -> bool:
    a = s.ledger.arrays
    return (int(a.w_total_kv_blocks[row]), int(a.w_max_batched_tokens[row])) == (
        req.total_kv_blocks,
        req.max_num_batched_tokens,
    )


def _add_worker_problem(req: p.AddWorker) -> str | None:
    """What is wrong with an AddWorker's endpoints or URL (the rules of `[[workers]]`), or None."""
    for key in ("kv_events_endpoint", "kv_replay_endpoint"):
        value = getattr(req, key)
        problem = endpoint_problem(value) if value else None
        if problem:
            return f"{key} {value!r}: {problem}"
    problem = url_problem(req.url) if req.url else None
    return f"url {req.url!r}: {problem}" if problem else None


def _add_kv_source(ctx: AdminContext, req: p.AddWorker, row: int) -> None:
    """Subscribe to the new rank's KV events (the endpoints are the rank's own: no dp offset)."""
    ctx.kv_events.remove_source(row)  # a row reused after RemoveWorker starts from a clean stream
    ctx.kv_events.add_source(
        KvEventSource(
            row,
            req.kv_events_endpoint,
            req.kv_replay_endpoint or None,
            req.kv_events_topic,
            req.kv_events_stale_after_s,
        )
    )
    ctx.scheduler.set_event_fed(row, True)


def _status(ctx: AdminContext) -> p.StatusReply:
    s = ctx.scheduler
    now = time.monotonic()
    t0, d0 = ctx.decisions_window
    total = s.decisions_total
    rate = (total - d0) / (now - t0) if now > t0 else 0.0
    if now - t0 > 10:
        ctx.decisions_window[:] = [now, total]
    return p.StatusReply(
        instance=ctx.instance,
        daemon_epoch=ctx.daemon_epoch,
        uptime_s=now - ctx.started_s,
        workers=len(s.workers()),
        active_leases=s.active_leases,
        queued=s.queued,
        deferred=s.deferred,
        decisions_total=total,
        decisions_per_s=rate,
        connections=ctx.connections(),
        endpoint=ctx.endpoint,
        block_size=ctx.block_size,
    )


def _reload(req: p.Reload, ctx: AdminContext):
    path = req.path or ctx.config_path
    if path is None:
        return _err(p.ErrorCode.INVALID, "the daemon was started without --config; give a path")
    try:
        cfg, given = load_config_keys(path, overrides=ctx.config_overrides)
        # keys only the environment or the start's flags set were set at the start too: the file decides
        from_file = given - load_config_keys(None, overrides=ctx.config_overrides)[1]
        if not any(k.startswith("selector.") for k in from_file):  # e.g. a profile-only file: the selector stays
            cfg = msgspec.structs.replace(cfg, selector=ctx.scheduler.admitter.selector_cfg)
        rebuilt = ctx.scheduler.reload(cfg)
    except (ConfigError, ValueError) as exc:
        log.warning("reload refused path=%s reason=%s", path, exc)
        return _err(p.ErrorCode.INVALID, f"reload refused, old profile kept: {exc}")
    log.info("profile reloaded path=%s classes=%d", path, len(cfg.classes))
    message = f"reloaded {path}: {len(cfg.classes)} classes"
    pending = restart_only_changes(ctx.running, cfg, given) if ctx.running is not None else []
    if pending:
        log.warning("reload: not applied, need a restart: %s", ", ".join(pending))
        message += f"; not applied (need a restart; workers also via add-worker / remove-worker): {', '.join(pending)}"
    if rebuilt:
        keys = ", ".join(rebuilt)
        log.warning(
            "reload: selector rebuilt as %s for changed keys %s (docs/DESIGN.md reload: learnt state is "
            "kept only when the type is unchanged)",
            cfg.selector.type,
            keys,
        )
        message += f"; selector rebuilt ({cfg.selector.type}) for changed {keys}"
    return p.OkReply(message=message)


def _err(code: p.ErrorCode, message: str) -> p.AdminError:
    return p.AdminError(code=int(code), message=message)


def _w(req) -> str:
    return f"{req.worker_id}" if req.dp_rank is None else f"{req.worker_id}:{req.dp_rank}"
