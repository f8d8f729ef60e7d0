"""`kvsched replay`: replay a request trace through the scheduler and a simulated fleet.

Wall-clock mode: a private daemon (unless `endpoint` names a running one) with the fleet's
capacities, the fleet process, and R router processes; routers replay the arrivals, schedule through
the daemon, stream from the fleet and release. Virtual mode (`virtual=True`): the same engine model
and core in process, in virtual time. Both end with the same `Summary` (`summary.json`) and the
per-request `results.jsonl` in `out_dir`.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from ..config import Config, config_from_dict, load_config
from .classes import (ClassAssignment, assign_classes, check_class_names, parse_class_rule,
                      read_class_column)
from .fleet_spec import FleetSpec, config_dict, config_toml
from .summary import RequestResult, Summary, read_results, summarize, write_results, write_summary
from .trace import Trace, load_trace

log = logging.getLogger(__name__)

ROUTER_READY_TIMEOUT_S = 120.0  # spawned routers import numpy/zmq/client and parse the trace
START_LEAD_S = 0.3  # t0 is this far after the go signal, so no router starts late
LEDGER_ZERO_TIMEOUT_S = 10.0  # releases are asynchronous: wait this long for the aggregates
DYNAMO_SUBSCRIBE_S = 1.0  # after registering engines with Dynamo: time for its KV-event subscriptions


@dataclass(slots=True)
class ReplayOptions:
    """Everything `kvsched replay` takes (see `replay_cli.replay` for the meaning of each)."""

    trace: Path
    routers: int = 4
    workers: int = 4
    speedup: float = 1.0
    load_scale: float = 1.0
    limit: int | None = None
    virtual: bool = False
    endpoint: str | None = None
    admin_endpoint: str | None = None
    out: Path = Path("out/replay")
    block_size: int | None = None
    kv_blocks: int | None = None
    max_num_batched_tokens: int = 8192
    selector: str = "kv"
    seed: int | None = 0
    keep_runtime_dir: bool = False
    notes: list[str] = field(default_factory=list)
    profile: Path | None = None  # TOML with default_class + [[classes]] (+ [selector], [overload])
    class_rule: str = "none"  # see classes.py / --class-rule
    kv_events: bool = True  # engines publish KV events to the daemon (virtual: overlap_mode "events")
    kv_encoding: str = "array"  # "array" | "map" (vLLM event encodings)
    kv_transport: str = "ipc"  # KV-event sockets: "ipc" (runtime dir) | "tcp" (loopback)
    overlap_mode: str | None = None  # virtual only: "events" | "approx" | "none"; None = from kv_events
    router_via: str = "daemon"  # wall only: "daemon" | "dynamo" (NVIDIA Dynamo's selection service routes)
    overlap_sample_every: int = 0  # wall, daemon routing: compare the daemon's and Dynamo's overlap every N-th row


def fleet_spec_for(opts: ReplayOptions, trace: Trace) -> FleetSpec:
    """The fleet shape for this trace: block size (512 for Mooncake) and room for its longest request."""
    block_size = opts.block_size or trace.block_size
    longest = int((trace.hash_offsets[1:] - trace.hash_offsets[:-1]).max()) if len(trace) else 0
    longest = max(longest, int(-(-int(trace.isl.max()) // block_size)) if len(trace) else 0)
    return FleetSpec(
        workers=opts.workers,
        block_size=block_size,
        kv_blocks=opts.kv_blocks,
        max_num_batched_tokens=opts.max_num_batched_tokens,
        max_blocks_per_request=max(256, longest),
    )


def run_replay(opts: ReplayOptions, console=None) -> Summary:
    """Run one replay (wall-clock or virtual), write `summary.json` + `results.jsonl`, return the summary."""
    trace = load_trace(opts.trace, opts.limit)
    if opts.block_size is not None:
        trace.block_size = opts.block_size
    if len(trace) == 0:
        raise ValueError(f"{opts.trace}: no requests")
    spec = fleet_spec_for(opts, trace)
    profile = load_profile(opts.profile) if opts.profile is not None else None
    classes = resolve_classes(opts, trace, profile)
    opts.out.mkdir(parents=True, exist_ok=True)
    if opts.virtual:
        results, wall_s, ledger_zero = _run_virtual(opts, trace, spec, console, profile, classes)
        routers = 0
    else:
        results, wall_s, ledger_zero = _run_wall(opts, trace, spec, console, profile, classes)
        routers = opts.routers
    write_results(sorted(results, key=lambda r: r.index), opts.out / "results.jsonl")
    summary = summarize(
        results,
        mode="virtual" if opts.virtual else "wall",
        trace=str(opts.trace),
        workers=spec.workers,
        routers=routers,
        selector="dynamo" if opts.router_via == "dynamo" and not opts.virtual else opts.selector,
        speedup=1.0 if opts.virtual else opts.speedup,
        load_scale=opts.load_scale,
        wall_time_s=wall_s,
        infinite_cache_hit_tokens=trace.infinite_cache_hit_tokens(),
        fleet_lru_hit_tokens=trace.fleet_lru_hit_tokens(spec.workers * spec.blocks_per_engine),
        ledger_zero=ledger_zero,
        notes=opts.notes,
        profile=str(opts.profile) if opts.profile is not None else None,
        class_rule=opts.class_rule,
        class_order=profile_class_names(profile),
    )
    write_summary(summary, opts.out)
    return summary


# ---------------------------------------------------------------------------- classes


def load_profile(path: Path) -> Config:
    """A scheduling profile (any kvsched config file; `include` honoured). Raises ConfigError."""
    return load_config(path)


def profile_class_names(profile: Config | None) -> list[str]:
    """The profile's class names in order (no profile: the default config's single class)."""
    return [c.name for c in (profile or Config()).classes]


def resolve_classes(opts: ReplayOptions, trace: Trace, profile: Config | None) -> ClassAssignment:
    """Every trace row's policy class under `opts.class_rule`.

    Raises:
        ClassRuleError: the rule does not parse, or names (or a trace column holds) a class the
            profile does not define; the message lists the profile's classes.
    """
    known = profile_class_names(profile)
    rule = parse_class_rule(opts.class_rule, known)
    column = read_class_column(opts.trace, rule.column, opts.limit) if rule.kind == "column" else None
    default = (profile or Config()).default_class
    assignment = assign_classes(rule, trace.isl, default, column)
    check_class_names(assignment.names, known)
    return assignment


def replay_config_dict(spec: FleetSpec, opts: ReplayOptions, profile: Config | None,
                       time_scale: float = 1.0, kv_events: tuple = ()) -> dict[str, Any]:
    """The replay's config with the profile merged in (the shape TOML parses to).

    The replay's own `[daemon]` and `[[workers]]` always win (block size, capacities, endpoints come
    from the simulated fleet; the profile's are ignored). From the profile: `default_class`,
    `[[classes]]`, `[overload]` and `[selector]` except `type` (from --selector) and `seed` (from
    --seed unless that is None). Wall-clock durations (`selector.approx_ttl_s`, each class's
    `queue_timeout_s`) are divided by `time_scale` (the speedup) so they keep their simulated length.
    """
    raw = config_dict(spec, opts.selector, opts.seed, time_scale, kv_events)
    if profile is None:
        return raw
    sel = _set_fields(profile.selector)
    sel.pop("type", None)
    if opts.seed is not None:
        sel.pop("seed", None)
    sel["approx_ttl_s"] = profile.selector.approx_ttl_s / time_scale
    raw["selector"].update(sel)
    overload = _set_fields(profile.overload)
    if overload:
        raw["overload"] = overload
    raw["default_class"] = profile.default_class
    raw["classes"] = []
    for c in profile.classes:
        d = _set_fields(c)
        if c.queue_timeout_s is not None:
            d["queue_timeout_s"] = c.queue_timeout_s / time_scale
        raw["classes"].append(d)
    return raw


def _set_fields(struct: msgspec.Struct) -> dict[str, Any]:
    """A struct as a dict without its None fields (TOML has no null), nested structs as dicts."""
    return {k: v for k, v in msgspec.to_builtins(struct).items() if v is not None}


def replay_config(spec: FleetSpec, opts: ReplayOptions, profile: Config | None, time_scale: float = 1.0) -> Config:
    """`replay_config_dict` validated into a `Config` (the virtual driver's)."""
    return config_from_dict(replay_config_dict(spec, opts, profile, time_scale), where="replay config")


def config_dict_toml(raw: dict[str, Any]) -> str:
    """TOML text of a config dict: top-level scalars, tables of scalars, arrays of tables (whose
    values are scalars or one level of sub-tables, e.g. `[classes.admission]`)."""
    lines = ["# written by kvsched replay: the simulated fleet's capacities + the --profile classes", ""]
    lines += [f"{k} = {_toml_value(v)}" for k, v in raw.items() if not isinstance(v, (dict, list))]
    for key, value in raw.items():
        if isinstance(value, dict):
            lines += ["", f"[{key}]", *(f"{k} = {_toml_value(v)}" for k, v in value.items())]
        elif isinstance(value, list):
            for item in value:
                lines += ["", f"[[{key}]]"]
                lines += [f"{k} = {_toml_value(v)}" for k, v in item.items() if not isinstance(v, dict)]
                for sub, table in ((k, v) for k, v in item.items() if isinstance(v, dict)):
                    lines += [f"[{key}.{sub}]", *(f"{k} = {_toml_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"cannot write {v!r} to the replay's TOML")
        return repr(v)
    if isinstance(v, str):
        return msgspec.json.encode(v).decode()  # a JSON string is a valid TOML basic string
    raise TypeError(f"unsupported TOML value {v!r}")


# ---------------------------------------------------------------------------- virtual


def _run_virtual(opts: ReplayOptions, trace: Trace, spec: FleetSpec, console, profile: Config | None,
                 classes: ClassAssignment):
    from .virtual import run_virtual

    config = replay_config(spec, opts, profile) if profile is not None else None
    with _progress_bar(console, len(trace), "virtual replay") as advance:
        run = run_virtual(trace, spec, selector=opts.selector, load_scale=opts.load_scale, seed=opts.seed,
                          config=config, progress=advance, classes=classes,
                          overlap_mode=opts.overlap_mode or ("events" if opts.kv_events else "approx"))
    return run.results, run.wall_time_s, ledger_is_zero_inprocess(run.scheduler)


def ledger_is_zero_inprocess(scheduler) -> bool | None:
    """True when every worker row of an in-process scheduler's ledger is back to zero load."""
    arrays = getattr(getattr(scheduler, "ledger", None), "arrays", None)
    if arrays is None:
        return None
    names = [n for n in ("w_active_blocks", "w_active_prefill", "w_active_requests") if hasattr(arrays, n)]
    if not names:
        return None
    return all(int(abs(getattr(arrays, n)).sum()) == 0 for n in names)


# ---------------------------------------------------------------------------- wall clock


@dataclass(slots=True)
class _Procs:
    runtime_dir: Path
    daemon: object | None = None
    fleet: mp.Process | None = None
    routers: list = field(default_factory=list)
    fleet_stop: object | None = None
    dynamo: object | None = None  # kvsched.sim.dynamo.DynamoService


def _run_wall(opts: ReplayOptions, trace: Trace, spec: FleetSpec, console, profile: Config | None,
              classes: ClassAssignment):
    from .fleet import FleetParams, fleet_main, kv_event_endpoints
    from .router import RouterParams, router_main

    ctx = mp.get_context("spawn")
    procs = _Procs(Path(tempfile.mkdtemp(prefix="kvsched-replay-")))
    run_tag = f"{os.getpid():x}{int(time.time()) % 100000:x}"
    previous = signal.signal(signal.SIGTERM, _sigterm_to_exit)  # SIGTERM cleans up like Ctrl-C
    try:
        use_dynamo = opts.router_via == "dynamo" or opts.overlap_sample_every > 0
        if use_dynamo and not opts.kv_events:
            raise ValueError("Dynamo needs the engines' KV events (drop --no-kv-events)")
        transport = "tcp" if use_dynamo else opts.kv_transport  # Dynamo's subscriber gets loopback tcp
        kv_eps = kv_event_endpoints(spec, procs.runtime_dir, transport) if opts.kv_events else ()
        endpoint, admin = _start_daemon(opts, spec, procs, profile, kv_eps)
        dynamo_url = _start_dynamo(procs) if use_dynamo else None
        if procs.daemon is not None and console is not None:  # its sockets are in a private directory
            console.print(f"daemon admin endpoint: {admin}\n  inspect it while it runs: kvsched --admin-endpoint {admin} status",
                          markup=False, highlight=False, soft_wrap=True)
        fleet_ep = f"ipc://{procs.runtime_dir}/fleet.sock"
        go, t0, counter = ctx.Event(), ctx.Value("d", 0.0), ctx.Value("i", 0)
        procs.fleet_stop, fleet_ready = ctx.Event(), ctx.Event()
        tick_ms = min(5.0, max(1.0, 50.0 / opts.speedup))  # <= ~50 ms of simulated time per wake
        fparams = FleetParams(fleet_ep, spec, opts.speedup, tick_ms=tick_ms, stats_path=str(opts.out / "fleet.json"),
                              kv_events=kv_eps, kv_encoding=opts.kv_encoding, kv_token_ids=use_dynamo)
        procs.fleet = ctx.Process(target=fleet_main, args=(fparams, fleet_ready, go, t0, procs.fleet_stop),
                                  name="kvsched-fleet", daemon=True)
        procs.fleet.start()
        readies = []
        for k in range(opts.routers):
            ready = ctx.Event()
            rp = RouterParams(k, opts.routers, str(opts.trace), opts.limit, endpoint, fleet_ep,
                              str(procs.runtime_dir / f"router-{k}.jsonl"), opts.speedup, opts.load_scale,
                              run_tag, opts.block_size, classes.names, classes.codes.astype("<u4").tobytes(),
                              dynamo_url=dynamo_url, route_via_dynamo=opts.router_via == "dynamo",
                              admin_endpoint=admin, overlap_sample_every=opts.overlap_sample_every,
                              overlap_path=str(procs.runtime_dir / f"overlap-{k}.jsonl"))
            proc = ctx.Process(target=router_main, args=(rp, ready, go, t0, counter), name=f"kvsched-router-{k}",
                               daemon=True)
            proc.start()
            procs.routers.append(proc)
            readies.append(ready)
        _wait_ready([fleet_ready, *readies], [procs.fleet, *procs.routers], ROUTER_READY_TIMEOUT_S)
        if procs.dynamo is not None:  # its subscribers connect once: the fleet's publishers must be bound
            from .dynamo import register_fleet

            register_fleet(procs.dynamo, spec.keys(), [pub for pub, _ in kv_eps], spec.block_size)
            time.sleep(DYNAMO_SUBSCRIBE_S)
        t0.value = time.monotonic() + START_LEAD_S
        go.set()
        start = time.monotonic()
        with _progress_bar(console, len(trace), f"replay x{opts.speedup:g}") as advance:
            failure = _watch(procs, counter, advance)
        wall_s = time.monotonic() - start
        if failure:
            opts.notes.append(failure)
        ledger_zero = _ledger_zero(admin) if admin else None
        results = _merge(procs, opts.routers, trace, run_tag, opts.load_scale, classes)
        _merge_overlap_samples(procs.runtime_dir, opts.routers, opts.out / "overlap_samples.jsonl")
        return results, wall_s, ledger_zero
    finally:
        _stop_all(procs, keep=opts.keep_runtime_dir)
        signal.signal(signal.SIGTERM, previous)


def _sigterm_to_exit(signum, frame) -> None:  # noqa: ANN001 - signal handler signature
    """Turn SIGTERM into SystemExit so the `finally` stops the daemon, fleet and routers."""
    raise SystemExit(128 + signum)


def _start_daemon(opts: ReplayOptions, spec: FleetSpec, procs: _Procs, profile: Config | None,
                  kv_eps: tuple = ()) -> tuple[str, str | None]:
    if opts.endpoint:
        opts.notes.append(f"external daemon at {opts.endpoint}: its [[workers]] must be 0..{spec.workers - 1}")
        if kv_eps:
            opts.notes.append("external daemon: the fleet publishes KV events at "
                              + ", ".join(pub for pub, _ in kv_eps) + " (list them in its [[workers]])")
        return opts.endpoint, opts.admin_endpoint
    from ..daemon.process import DaemonProcess

    cfg = procs.runtime_dir / "replay.toml"
    if profile is None:
        selector = "kv" if opts.router_via == "dynamo" else opts.selector  # the daemon only watches then
        cfg.write_text(config_toml(spec, selector, opts.seed, time_scale=opts.speedup, kv_events=kv_eps))
    else:
        cfg.write_text(config_dict_toml(replay_config_dict(spec, opts, profile, time_scale=opts.speedup,
                                                           kv_events=kv_eps)))
        load_config(cfg, env={})  # fail here, naming the file, rather than in the daemon's log
    procs.daemon = DaemonProcess.start(cfg, instance=f"replay-{os.getpid()}", runtime_dir=procs.runtime_dir)
    return procs.daemon.endpoint, procs.daemon.admin_endpoint


def _start_dynamo(procs: _Procs) -> str:
    """Start NVIDIA Dynamo's selection service (engines are registered once the fleet is up); its URL."""
    from .dynamo import DynamoService, dynamo_unavailable_reason

    reason = dynamo_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"replay via dynamo: {reason}")
    procs.dynamo = DynamoService().start()
    return procs.dynamo.base


def _merge_overlap_samples(runtime_dir: Path, routers: int, dest: Path) -> None:
    """Concatenate the routers' overlap samples (daemon vs Dynamo, `Router._sample_overlap`), if any."""
    parts = [runtime_dir / f"overlap-{k}.jsonl" for k in range(routers)]
    text = "".join(p.read_text() for p in parts if p.exists())
    if text:
        dest.write_text(text)
    elif dest.exists():
        dest.unlink()


def _wait_ready(events, processes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for ev in events:
        while not ev.wait(0.1):
            dead = [p.name for p in processes if not p.is_alive()]
            if dead:
                raise RuntimeError(f"replay: {', '.join(dead)} exited during start-up")
            if time.monotonic() > deadline:
                raise RuntimeError(f"replay: processes not ready within {timeout_s:.0f}s")


def _watch(procs: _Procs, counter, advance) -> str | None:
    """Feed the progress bar until every router exits; returns a failure note, if any."""
    while any(p.is_alive() for p in procs.routers):
        advance(counter.value)
        if procs.fleet is not None and not procs.fleet.is_alive():
            return f"fleet process exited early (code {procs.fleet.exitcode})"
        if procs.daemon is not None and not procs.daemon.alive():
            return f"daemon exited early; log tail:\n{procs.daemon.log_tail()}"
        time.sleep(0.2)
    advance(counter.value)
    bad = [f"{p.name}={p.exitcode}" for p in procs.routers if p.exitcode]
    return f"router exit codes: {', '.join(bad)}" if bad else None


def _ledger_zero(admin_endpoint: str) -> bool | None:
    """Ask the daemon's admin socket until every worker's aggregates are zero (releases are async)."""
    from .. import protocol as p
    from ..client.admin import AdminClient
    from ..errors import KvschedError

    deadline = time.monotonic() + LEDGER_ZERO_TIMEOUT_S
    while True:
        try:
            with AdminClient(admin_endpoint) as admin:
                reply = admin.call(p.Workers())
        except KvschedError as exc:
            log.warning("replay: ledger check failed err=%s", exc)
            return None
        if not isinstance(reply, p.WorkersReply):
            return None
        zero = all(w.active_blocks == 0 and w.active_prefill_tokens == 0 and w.active_requests == 0
                   for w in reply.workers)
        if zero or time.monotonic() > deadline:
            return zero
        time.sleep(0.1)


def _merge(procs: _Procs, routers: int, trace: Trace, run_tag: str, load_scale: float,
           classes: ClassAssignment) -> list[RequestResult]:
    """Results of every router; rows no router reported (a router died) count as unfinished."""
    by_index: dict[int, RequestResult] = {}
    for k in range(routers):
        path = procs.runtime_dir / f"router-{k}.jsonl"
        if path.exists():
            for r in read_results(path):
                by_index[r.index] = r
    arrivals = trace.scaled_arrivals_us(load_scale)
    for i in range(len(trace)):
        if i not in by_index:
            by_index[i] = RequestResult(index=i, request_id=f"{run_tag}-{i}", arrival_us=int(arrivals[i]),
                                        isl=int(trace.isl[i]), osl=int(trace.osl[i]), policy_class=classes.name_of(i),
                                        detail="no result: its router exited early")
    return [by_index[i] for i in range(len(trace))]


def _stop_all(procs: _Procs, keep: bool) -> None:
    for proc in procs.routers:
        if proc.is_alive():
            proc.terminate()
        proc.join(5)
    if procs.fleet is not None:
        if procs.fleet_stop is not None:
            procs.fleet_stop.set()
        procs.fleet.join(5)
        if procs.fleet.is_alive():
            procs.fleet.terminate()
            procs.fleet.join(2)
    if procs.dynamo is not None:
        procs.dynamo.stop()
    if procs.daemon is not None:
        try:
            procs.daemon.stop(timeout_s=10)
        except Exception as exc:  # stopping must not hide the run's own result
            log.warning("replay: daemon stop failed err=%s", exc)
    if not keep:
        shutil.rmtree(procs.runtime_dir, ignore_errors=True)


# ---------------------------------------------------------------------------- progress


class _progress_bar:
    """Context manager yielding `advance(done)`; a rich bar when a console is given, else a no-op."""

    def __init__(self, console, total: int, label: str) -> None:
        self.console, self.total, self.label = console, total, label
        self._progress = None
        self._task = None

    def __enter__(self):
        if self.console is None:
            return lambda done: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=self.console, transient=False)
        self._progress.start()
        self._task = self._progress.add_task(self.label, total=self.total)
        last = [0.0]

        def advance(done: int) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.1 or done >= self.total:
                last[0] = now
                self._progress.update(self._task, completed=done)

        return advance

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
