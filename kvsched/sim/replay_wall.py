"""The processes of a wall-clock `kvsched replay`: a private daemon (unless an endpoint names a
running one), optionally NVIDIA Dynamo's selection service, the fleet process and R router
processes; start them, release them together at t0, watch them, merge the routers' results, and
stop everything (also on Ctrl-C / SIGTERM). The replay's config is `replay_config.py`'s; the
summary is `summary.py`'s.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import tempfile
import time
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import TYPE_CHECKING

from .. import protocol as p
from ..client.admin import AdminClient
from ..config import Config, config_env_names, load_config
from ..daemon.instance_lock import purge_instance
from ..daemon.process import DaemonProcess
from ..errors import ConfigError, DaemonUnavailable, KvschedError
from .classes import ClassAssignment
from .dynamo import DynamoService, dynamo_unavailable_reason
from .fleet import FleetParams, fleet_main, kv_event_endpoints
from .fleet_spec import FleetSpec, config_toml
from .progress_bar import progress_bar
from .replay_config import ReplayOptions, config_dict_toml, replay_config_dict
from .router import ROUTER_READY_TIMEOUT_S, RouterParams, router_main
from .summary import RequestResult, read_results
from .trace import Trace

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.synchronize import Event

    from ..daemon.process import DaemonProcess
    from .dynamo import DynamoService

log = logging.getLogger(__name__)

START_LEAD_S = 0.3  # t0 is this far after the go signal, so no router starts late
LEDGER_ZERO_TIMEOUT_S = 10.0  # releases are asynchronous: wait this long for the aggregates
DYNAMO_SUBSCRIBE_S = 1.0  # after registering engines with Dynamo: time for its KV-event subscriptions
DAEMON_WAIT_NOTE_S = (5.0, 15.0)  # while the private daemon starts: first progress line after 5 s, then every 15 s


@dataclass(slots=True)
class _Procs:
    runtime_dir: Path
    instance: str | None = None  # the private daemon's instance (names its /dev/shm segments)
    daemon: DaemonProcess | None = None
    fleet: BaseProcess | None = None
    routers: list[BaseProcess] = field(default_factory=list)
    fleet_stop: Event | None = None
    dynamo: DynamoService | None = None


def run_wall(
    opts: ReplayOptions, trace: Trace, spec: FleetSpec, console, profile: Config | None, classes: ClassAssignment
) -> tuple[list[RequestResult], float, bool | None]:
    """Run the wall-clock replay; (per-request results in trace order, wall time s, whether the
    daemon's per-worker aggregates were back to zero at the end — None: not asked)."""
    ctx = mp.get_context("spawn")
    _start_resource_tracker_ignoring_sighup()
    procs = _Procs(Path(tempfile.mkdtemp(prefix="kvsched-replay-")))
    run_tag = f"{os.getpid():x}{int(time.time()) % 100000:x}"
    previous = signal.signal(signal.SIGTERM, _sigterm_to_exit)  # SIGTERM cleans up like Ctrl-C
    previous_hup = signal.signal(signal.SIGHUP, _sigterm_to_exit)  # so does a closed terminal (the daemon
    # runs in its own session: the hangup never reaches it, and only this cleanup stops it)
    try:
        use_dynamo = opts.router_via == "dynamo" or opts.overlap_sample_every > 0
        if use_dynamo and not opts.kv_events:
            raise ValueError("Dynamo needs the engines' KV events (drop --no-kv-events)")
        transport = "tcp" if use_dynamo else opts.kv_transport  # Dynamo's subscriber gets loopback tcp
        kv_eps = kv_event_endpoints(spec, procs.runtime_dir, transport) if opts.kv_events else ()
        endpoint, admin = _start_daemon(opts, spec, procs, profile, kv_eps, console)
        dynamo_url = _start_dynamo(procs) if use_dynamo else None
        if procs.daemon is not None and console is not None:  # its sockets are in a private directory
            console.print(
                f"daemon admin endpoint: {admin}\n  inspect it while it runs: kvsched --admin-endpoint {admin} status",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
        fleet_ep = f"ipc://{procs.runtime_dir}/fleet.sock"
        go, t0, counter = ctx.Event(), ctx.Value("d", 0.0), ctx.Value("i", 0)
        procs.fleet_stop, fleet_ready = ctx.Event(), ctx.Event()
        tick_ms = min(5.0, max(1.0, 50.0 / opts.speedup))  # <= ~50 ms of simulated time per wake
        fparams = FleetParams(
            fleet_ep,
            spec,
            opts.speedup,
            tick_ms=tick_ms,
            stats_path=str(opts.out / "fleet.json"),
            kv_events=kv_eps,
            kv_encoding=opts.kv_encoding,
            kv_token_ids=use_dynamo,
        )
        procs.fleet = ctx.Process(
            target=fleet_main, args=(fparams, fleet_ready, go, t0, procs.fleet_stop), name="kvsched-fleet", daemon=True
        )
        _start_ignoring_sigint(procs.fleet)
        readies = []
        for k in range(opts.routers):
            ready = ctx.Event()
            rp = RouterParams(
                k,
                opts.routers,
                str(opts.trace),
                opts.limit,
                endpoint,
                fleet_ep,
                str(procs.runtime_dir / f"router-{k}.jsonl"),
                opts.speedup,
                opts.load_scale,
                run_tag,
                opts.block_size,
                classes.names,
                classes.codes.astype("<u4").tobytes(),
                dynamo_url=dynamo_url,
                route_via_dynamo=opts.router_via == "dynamo",
                admin_endpoint=admin,
                overlap_sample_every=opts.overlap_sample_every,
                overlap_path=str(procs.runtime_dir / f"overlap-{k}.jsonl"),
            )
            proc = ctx.Process(
                target=router_main, args=(rp, ready, go, t0, counter), name=f"kvsched-router-{k}", daemon=True
            )
            _start_ignoring_sigint(proc)
            procs.routers.append(proc)
            readies.append(ready)
        _wait_ready([fleet_ready, *readies], [procs.fleet, *procs.routers], ROUTER_READY_TIMEOUT_S, procs.daemon)
        if procs.dynamo is not None:  # its subscribers connect once: the fleet's publishers must be bound
            procs.dynamo.register_fleet(spec.worker_keys(), [pub for pub, _ in kv_eps], spec.block_size)
            time.sleep(DYNAMO_SUBSCRIBE_S)
        t0.value = time.monotonic() + START_LEAD_S
        go.set()
        start = time.monotonic()
        with progress_bar(console, len(trace), f"replay x{opts.speedup:g}") as advance:
            failure = _watch(procs, counter, advance)
        wall_s = time.monotonic() - start
        if failure:
            opts.notes.append(failure)
        ledger_zero = _ledger_zero(admin) if admin else None
        results = _merge(procs, opts.routers, trace, run_tag, opts.load_scale, classes)
        _merge_overlap_samples(procs.runtime_dir, opts.routers, opts.out / "overlap_samples.jsonl")
        return results, wall_s, ledger_zero
    finally:
        previous_int = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the cleanup short
        try:
            _stop_all(procs, keep=opts.keep_runtime_dir)
        finally:
            signal.signal(signal.SIGINT, previous_int)
            signal.signal(signal.SIGTERM, previous)
            signal.signal(signal.SIGHUP, previous_hup)


def _start_ignoring_sigint(proc: BaseProcess) -> None:
    """Start a spawned child with SIGINT ignored (inherited across exec; Python then installs no
    KeyboardInterrupt handler): a Ctrl-C to the process group interrupts this process only, whose
    cleanup stops the children (SIGTERM / the fleet's stop event) without a traceback from each."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc.start()
    finally:
        signal.signal(signal.SIGINT, previous)


def _start_resource_tracker_ignoring_sighup() -> None:
    """Start multiprocessing's resource tracker (the process that the spawned fleet and routers report
    their semaphores to) with SIGHUP ignored. It ignores SIGINT and SIGTERM itself, not SIGHUP: a
    closed terminal killed it, the next child to report relaunched it, and the new tracker printed a
    KeyError traceback for every semaphore it had never seen. A tracker already running is kept."""
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)  # inherited as ignored across its exec
    try:
        resource_tracker.ensure_running()
    finally:
        signal.signal(signal.SIGHUP, previous)


def _sigterm_to_exit(signum, frame) -> None:
    """Turn SIGTERM / SIGHUP into SystemExit so the `finally` stops the daemon, fleet and routers."""
    raise SystemExit(128 + signum)


def _start_daemon(
    opts: ReplayOptions, spec: FleetSpec, procs: _Procs, profile: Config | None, kv_eps: tuple = (), console=None
) -> tuple[str, str | None]:
    """Start the private daemon (its log: `<out>/daemon.log`), or note the external one; (endpoint, admin).

    Raises:
        DaemonUnavailable: it exited or was not ready within `opts.daemon_ready_timeout_s` (the
            message names the kept log; `_stop_all` removes its shared memory).
    """
    if opts.endpoint:
        opts.notes.append(f"external daemon at {opts.endpoint}: its [[workers]] must be 0..{spec.workers - 1}")
        if kv_eps:
            opts.notes.append(
                "external daemon: the fleet publishes KV events at "
                + ", ".join(pub for pub, _ in kv_eps)
                + " (list them in its [[workers]])"
            )
        return opts.endpoint, opts.admin_endpoint

    cfg = procs.runtime_dir / "replay.toml"
    log_path = opts.out / "daemon.log"  # kept after the run (the runtime dir is removed)
    log_path.unlink(missing_ok=True)
    if profile is None:
        selector = "kv" if opts.router_via == "dynamo" else opts.selector  # the daemon only watches then
        cfg.write_text(config_toml(spec, selector, opts.seed, time_scale=opts.speedup, kv_events=kv_eps))
    else:
        cfg.write_text(
            config_dict_toml(replay_config_dict(spec, opts, profile, time_scale=opts.speedup, kv_events=kv_eps))
        )
        load_config(cfg, env={})  # fail here, naming the file, rather than in the daemon's log
    procs.instance = f"replay-{os.getpid()}"
    procs.daemon = DaemonProcess.start(
        cfg,
        instance=procs.instance,
        runtime_dir=procs.runtime_dir,
        log_path=log_path,
        env=_daemon_env(console),
        ready_timeout_s=opts.daemon_ready_timeout_s,
        on_wait=_wait_note(console),
    )
    return procs.daemon.endpoint, procs.daemon.admin_endpoint


def _daemon_env(console) -> dict[str, str]:
    """This process's environment without the `KVSCHED_<SECTION>_<KEY>` config overrides: the config
    the replay writes is the whole of its daemon's (the summary reports it; `--virtual` reads no
    environment either). Names what it drops in one line."""
    env = dict(os.environ)
    dropped = config_env_names(env)
    for name in dropped:
        del env[name]
    if dropped:
        line = f"replay: not passed to its daemon (the replay writes the daemon's config): {', '.join(dropped)}"
        if console is not None:
            console.print(line, markup=False, highlight=False, soft_wrap=True)
        else:
            log.warning("%s", line)
    return env


def _wait_note(console):
    """`on_wait` for `DaemonProcess.start`: a line after 5 s and every 15 s after, so a cold start
    (numba compiling the kernels, cached for later starts) does not look like a hang."""
    if console is None:
        return None
    first, every = DAEMON_WAIT_NOTE_S
    due = [first]

    def note(elapsed_s: float) -> None:
        if elapsed_s >= due[0]:
            due[0] += every
            console.print(
                f"daemon compiling kernels (first start, cached afterwards)… {elapsed_s:.0f}s",
                markup=False,
                highlight=False,
            )

    return note


def _start_dynamo(procs: _Procs) -> str:
    """Start NVIDIA Dynamo's selection service (engines are registered once the fleet is up); its URL."""
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


def _wait_ready(events, processes, timeout_s: float, daemon=None) -> None:
    """Wait until every start-up event is set.

    Raises:
        DaemonUnavailable: the private `daemon` (a `DaemonProcess`, or None) exited meanwhile (the
            routers would wait for it until `timeout_s`); the message names its log.
        RuntimeError: one of `processes` exited, or `timeout_s` (s) passed.
    """
    deadline = time.monotonic() + timeout_s
    for ev in events:
        while not ev.wait(0.1):
            if daemon is not None and not daemon.alive():
                raise DaemonUnavailable(
                    f"daemon exited with code {daemon.proc.returncode} while the routers "
                    f"started; log {daemon.log_path}:\n{daemon.log_tail()}"
                )
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
        zero = all(
            w.active_blocks == 0 and w.active_prefill_tokens == 0 and w.active_requests == 0 for w in reply.workers
        )
        if zero or time.monotonic() > deadline:
            return zero
        time.sleep(0.1)


def _merge(
    procs: _Procs, routers: int, trace: Trace, run_tag: str, load_scale: float, classes: ClassAssignment
) -> list[RequestResult]:
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
            by_index[i] = RequestResult(
                index=i,
                request_id=f"{run_tag}-{i}",
                arrival_us=int(arrivals[i]),
                isl=int(trace.isl[i]),
                osl=int(trace.osl[i]),
                policy_class=classes.name_of(i),
                detail="no result: its router exited early",
            )
    return [by_index[i] for i in range(len(trace))]


def _purge(instance: str) -> None:
    """Remove the private daemon's /dev/shm segments and lock file (`kvsched-daemon --purge`): a clean
    stop leaves nothing, but a daemon killed while starting (ready timeout, Ctrl-C) leaves them all."""
    try:
        purge_instance(instance)
    except ConfigError as exc:  # it outlived its stop: not ours to remove under it
        log.warning("replay: shared memory of instance %s left in /dev/shm: %s", instance, exc)


def _stop_all(procs: _Procs, keep: bool) -> None:
    # The fleet stops before the routers: a fleet still serving would warn about every event batch
    # it can no longer deliver to a router that was just terminated (an interrupted run's noise).
    if procs.fleet is not None:
        if procs.fleet_stop is not None:
            procs.fleet_stop.set()
        procs.fleet.join(5)
        if procs.fleet.is_alive():
            procs.fleet.terminate()
            procs.fleet.join(2)
    for proc in procs.routers:
        if proc.is_alive():
            proc.terminate()
        proc.join(5)
    if procs.dynamo is not None:
        procs.dynamo.stop()
    if procs.daemon is not None:
        try:
            procs.daemon.stop(timeout_s=10)
        except Exception as exc:  # stopping must not hide the run's own result
            log.warning("replay: daemon stop failed err=%s", exc)
    if procs.instance is not None:
        _purge(procs.instance)
    if not keep:
        shutil.rmtree(procs.runtime_dir, ignore_errors=True)
