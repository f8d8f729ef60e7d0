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
from typing import TYPE_CHECKING

import msgspec

from .. import protocol as p
from ..config import Config, load_config_keys
from ..core.reload import restart_only_changes
from ..errors import ConfigError
from .registry import Outcomes, WorkerRegistry, admin_error, worker_name

if TYPE_CHECKING:
    from ..core.scheduler import Scheduler

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
        workers: the `WorkerRegistry` (AddWorker, RemoveWorker and the rows of `kvsched workers`).
        running: the config the daemon started with (`reload` names what differs in the sections it
            does not apply), or None.
    """

    scheduler: Scheduler
    instance: str
    endpoint: str
    block_size: int
    daemon_epoch: int
    config_path: str | None
    workers: WorkerRegistry
    started_s: float = field(default_factory=time.monotonic)
    connections: Callable[[], int] = lambda: 0
    decisions_window: list = field(default_factory=lambda: [time.monotonic(), 0])
    config_overrides: dict | None = None
    running: Config | None = None


def handle(req: p.AdminRequest, ctx: AdminContext, now_us: int) -> tuple[p.AdminReply, Outcomes]:
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
                    return admin_error(p.ErrorCode.NOT_FOUND, f"no class named {req.policy_class!r}"), []
            return p.QueuesReply(classes=rows), []
        case p.Workers():
            return p.WorkersReply(workers=ctx.workers.rows()), []
        case p.Leases():
            if req.policy_class is not None and all(cq.name != req.policy_class for cq in s.pq.classes):
                return admin_error(p.ErrorCode.NOT_FOUND, f"no class named {req.policy_class!r}"), []
            if req.worker_id is not None and all(w.worker_id != req.worker_id for w in s.workers()):
                return admin_error(p.ErrorCode.NOT_FOUND, f"no worker {req.worker_id} is registered"), []
            if req.worker_id is None and req.policy_class is None:
                leases, total = s.leases(now_us, limit=req.limit), s.active_leases
            else:  # total counts the leases that match the filter (bounded by max_slots)
                matching = s.leases(
                    now_us, worker_id=req.worker_id, policy_class=req.policy_class, limit=max(1, s.active_leases)
                )
                leases, total = matching[: req.limit], len(matching)
            return p.LeasesReply(leases=leases, total=total), []
        case p.Drain() | p.Undrain():
            drained = isinstance(req, p.Drain)
            try:
                outcomes = s.set_drained(req.worker_id, req.dp_rank, drained, now_us)
            except KeyError:
                return admin_error(p.ErrorCode.NOT_FOUND, f"unknown worker {worker_name(req)}"), []
            log.info("%s worker=%s", "drained" if drained else "undrained", worker_name(req))
            return p.OkReply(message=f"{'drained' if drained else 'undrained'} {worker_name(req)}"), outcomes
        case p.AddWorker():
            return ctx.workers.add(req, now_us)
        case p.RemoveWorker():
            return ctx.workers.remove(req, now_us)
        case p.Cancel():
            told = s.cancel(req.request_id, now_us)
            if told is None:
                return admin_error(p.ErrorCode.NOT_FOUND, f"no queued request or lease {req.request_id!r}"), []
            log.info("cancelled by operator request_id=%s", req.request_id)
            return p.OkReply(message=f"cancelled {req.request_id}"), told + s.drain_cleanup(now_us)
        case p.Reload():
            return _reload(req, ctx), s.drain_cleanup(now_us)
        case p.Explain():
            reply = s.explain(req.request_id)
            if reply is None:
                return admin_error(p.ErrorCode.NOT_FOUND, f"no recent decision for {req.request_id!r}"), []
            return reply, []
    return admin_error(p.ErrorCode.INVALID, f"unsupported admin request {type(req).__name__}"), []


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


def _reload(req: p.Reload, ctx: AdminContext) -> p.AdminReply:
    path = req.path or ctx.config_path
    if path is None:
        return admin_error(p.ErrorCode.INVALID, "the daemon was started without --config; give a path")
    try:
        cfg, given = load_config_keys(path, overrides=ctx.config_overrides)
        # keys only the environment or the start's flags set were set at the start too: the file decides
        from_file = given - load_config_keys(None, overrides=ctx.config_overrides)[1]
        if not any(k.startswith("selector.") for k in from_file):  # e.g. a profile-only file: the selector stays
            cfg = msgspec.structs.replace(cfg, selector=ctx.scheduler.admitter.selector_cfg)
        rebuilt = ctx.scheduler.reload(cfg)
    except (ConfigError, ValueError) as exc:
        log.warning("reload refused path=%s reason=%s", path, exc)
        return admin_error(p.ErrorCode.INVALID, f"reload refused, old profile kept: {exc}")
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
