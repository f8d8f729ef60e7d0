"""`kvsched-daemon`: the process lifecycle — start (segments, kernels, sockets, READY), serve, stop.

`Daemon.run()` awaits `start()` → `serve()` → `stop()` (docs/DESIGN.md §10.3). Signal handlers only set flags;
the actor's loop notices them. Segments outlive the process; they are unlinked only on a clean stop
with no live lease, or by `--purge`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer
import zmq
from zmq.auth.thread import ThreadAuthenticator

from .. import protocol as p
from ..config import Config, check_endpoints, env_hint, ignored_env, load_config
from ..endpoints import daemon_endpoints
from ..errors import ConfigError, KvschedError, ShmLayoutError
from ..shm.segments import Segments, ledger_name, progress_name
from ..shm.warm import warm_kernels
from .actor import Actor
from .admin import AdminContext, handle
from .connections import ConnectionTable
from .health import Health, HttpServer, available_workers, metrics_host_problem
from .instance_lock import InstanceLock, purge_instance
from .kv_events import KvEventSubscriber
from .logging_setup import setup_logging
from .metrics import Metrics
from .notify import Notifier
from .registry import WorkerRegistry
from .sockets import (
    ADMIN_SOCKET_MODE,
    DATA_SOCKET_MODE,
    bind_router,
    close_socket,
    load_curve_secret,
    start_curve_auth,
    transport_cut,
)
from .wiring import (
    KV_CATCH_UP_WAIT_S,
    build_kv_subscriber,
    build_scheduler,
    install_hash_check,
    kv_metrics_tick,
    open_segments,
    segment_bytes,
    warm_decision_path,
)

log = logging.getLogger(__name__)


class Daemon:
    """One daemon instance. Create with a validated `Config`; call `asyncio.run(d.run())` (uvloop).

    Args:
        config: the validated configuration.
        config_path: the file `reload` re-reads (None = defaults only).
        overrides: flag overrides re-applied on reload.
    """

    def __init__(self, config: Config, config_path: str | None = None, overrides: dict | None = None) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = overrides
        d = config.daemon
        (self.endpoint, data_src), (self.admin_endpoint, admin_src) = daemon_endpoints(
            d.instance, d.endpoint, d.admin_endpoint
        )
        flags = (overrides or {}).get("daemon", {})
        self.endpoint_sources = (_source(data_src, "endpoint", flags), _source(admin_src, "admin_endpoint", flags))
        self.should_exit = False
        self.force_exit = False
        self.ctx: zmq.Context | None = None
        self.auth: ThreadAuthenticator | None = None
        self.data_sock: zmq.Socket | None = None
        self.admin_sock: zmq.Socket | None = None
        self.segments: Segments | None = None
        self.restarted = False
        self.lock: InstanceLock | None = None
        self.actor: Actor | None = None
        self.kv_events: KvEventSubscriber | None = None
        self.notifier: Notifier | None = None
        self.health: Health | None = None
        self.http: HttpServer | None = None

    async def run(self) -> None:
        """start → serve → stop; stop also runs when start fails half-way (nothing left behind)."""
        try:
            await self.start()
            await self.serve()
        finally:
            await self.stop()

    async def start(self) -> None:
        """Create/attach segments, build the scheduler, warm kernels, bind sockets, start the actor
        and the KV-event subscriber, then READY=1."""
        cfg = self.config
        d = cfg.daemon
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # first: a stop during start still cleans up
            loop.add_signal_handler(sig, self.on_signal, sig)
        self.lock = InstanceLock(d.instance)  # before touching segments or sockets
        self.metrics = Metrics()
        self.health = Health(d.health_stall_ms)
        if d.metrics_port:  # up before the warm-up, so probes see "starting" rather than a refused port
            self.http = HttpServer(self.health, self.metrics.registry, d.metrics_host, d.metrics_port)
        self.notifier = Notifier()
        self.notifier.status("warming kernels")
        t0 = time.monotonic()
        warm_kernels()
        warm_decision_path(cfg)
        log.info("kernels warm seconds=%.2f", time.monotonic() - t0)
        self.segments, restarted = open_segments(cfg)
        self.restarted = restarted
        self.conns = ConnectionTable(d.liveness_timeout_ms * 1000)
        self.scheduler = build_scheduler(cfg, self.segments, restarted, self.conns)
        self.ctx = zmq.Context()
        curve = load_curve_secret(d.curve_secret_key_file)
        self.auth = start_curve_auth(self.ctx, curve, d.curve_authorized_keys_dir)
        log.info(
            "endpoints data=%s data_from=%s admin=%s admin_from=%s",
            self.endpoint,
            self.endpoint_sources[0],
            self.admin_endpoint,
            self.endpoint_sources[1],
        )
        self.data_sock = bind_router(
            self.ctx,
            self.endpoint,
            mode=DATA_SOCKET_MODE,
            max_frame_bytes=transport_cut(d.max_frame_bytes),
            curve_secret_key=curve,
            heartbeat_ms=d.heartbeat_ms,
        )
        self.admin_sock = bind_router(
            self.ctx,
            self.admin_endpoint,
            mode=ADMIN_SOCKET_MODE,
            max_frame_bytes=d.max_frame_bytes,
            curve_secret_key=curve,
            heartbeat_ms=d.heartbeat_ms,
        )
        epoch = int(self.segments.ledger.epoch)
        welcome = p.Welcome(
            daemon_epoch=epoch,
            protocol_min=p.PROTOCOL_MIN,
            protocol_max=p.PROTOCOL_MAX,
            block_size=d.block_size,
            shm_ledger=ledger_name(d.instance),
            shm_progress=progress_name(d.instance),
            heartbeat_ms=d.heartbeat_ms,
            liveness_timeout_ms=d.liveness_timeout_ms,
            max_frame_bytes=d.max_frame_bytes,
            hash_seed=d.kv_hash_seed,  # the one seed routers hash with (SchedulerClient.block_hashes)
        )
        self.metrics.bind(self.scheduler)
        self.workers = WorkerRegistry(cfg, self.scheduler, self.segments.kv_index, restarted)
        self.admin_ctx = AdminContext(
            scheduler=self.scheduler,
            instance=d.instance,
            endpoint=self.endpoint,
            block_size=d.block_size,
            daemon_epoch=epoch,
            config_path=self.config_path,
            config_overrides=self.overrides,
            workers=self.workers,
            running=cfg,
        )
        self.actor = actor = Actor(
            loop,
            self.scheduler,
            self.data_sock,
            welcome,
            d,
            self.metrics,
            admin_handler=lambda req, t: handle(req, self.admin_ctx, t),
            admin_sock=self.admin_sock,
            worker_urls=self.workers.urls,
            conns=self.conns,
        )
        self.admin_ctx.connections = lambda: len(actor.conns)
        self.actor.ticker.on_tick.append(self.notifier.watchdog_tick)
        arrays = self.scheduler.ledger.arrays
        self.health.watch_workers(lambda: available_workers(arrays.w_present, arrays.w_flags))
        self.actor.ticker.on_tick.append(self.health.stamp)  # liveness: every tick
        self.actor.ticker.on_second.append(self.health.tick)  # + available workers (readiness), once a second
        self.actor.start()
        self.kv_events = build_kv_subscriber(
            self.scheduler,
            loop,
            self.ctx,
            self.workers.kv_sources(),
            self.segments.kv_index,
            self.segments.kv_index_restored,
        )
        self.workers.attach(self.kv_events, install_hash_check(cfg, self.kv_events, self.scheduler, self.metrics))
        self.actor.ticker.on_second.append(kv_metrics_tick(self.kv_events, self.metrics))  # counters: not every tick
        self.kv_events.start()  # restored rows ask their engines for a catch-up replay now
        await self.kv_events.wait_caught_up(KV_CATCH_UP_WAIT_S)
        status = f"serving {self.endpoint} epoch={epoch} workers={len(self.scheduler.workers())}"
        self.notifier.ready(status)
        self.health.mark_ready()
        log.info(
            "ready endpoint=%s admin=%s epoch=%d restarted=%s", self.endpoint, self.admin_endpoint, epoch, restarted
        )
        # A line on stdout that wrappers (DaemonProcess, scripts) can wait for.
        print(f"KVSCHED_READY {self.endpoint} {self.admin_endpoint}", flush=True)

    def on_signal(self, sig: int) -> None:
        """SIGTERM / SIGINT: ask the daemon to stop (a second one: stop without waiting for leases)."""
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True
        log.info("signal received signal=%s", signal.Signals(sig).name)

    async def serve(self) -> None:
        """Run until SIGTERM/SIGINT, then the bounded graceful shutdown (`drain`)."""
        while not self.should_exit:
            await asyncio.sleep(0.05)
        await self.drain()

    async def drain(self) -> None:
        """Graceful shutdown, bounded by `daemon.shutdown_timeout_s`: stop admitting, answer every
        waiting request `shutting_down` (clients keep it and re-send it to the next daemon), and keep
        serving releases, progress and heartbeats of live leases until none is left, the timeout
        passes, or a second signal arrives. Reaping of dead routers goes on meanwhile."""
        if self.actor is None:
            return
        timeout_s = self.config.daemon.shutdown_timeout_s
        if self.notifier is not None:
            self.notifier.stopping()
        if self.health is not None:
            self.health.mark_stopping()
        self.actor.begin_shutdown()
        live = self.scheduler.active_leases
        log.info("stopping live_leases=%d shutdown_timeout_s=%.1f", live, timeout_s)
        deadline = time.monotonic() + timeout_s
        while self.scheduler.active_leases > 0 and time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(0.02)
        if self.scheduler.active_leases:
            log.warning(
                "shutdown timeout with live leases live_leases=%d (kept for the next start)",
                self.scheduler.active_leases,
            )

    async def stop(self) -> None:
        """STOPPING=1, stop accepting, answer waiting requests `shutting_down`, close every socket
        (linger 0), unlink segments when no lease is live. Runs after a failed start too: every
        step is attempted even when an earlier one fails, so nothing hangs and nothing is left."""

        def step(what: str, fn: Callable[..., object], *args: object) -> None:
            try:
                fn(*args)
            except Exception:
                log.exception("stop step failed step=%s", what)

        if self.notifier is not None:
            step("notify", self.notifier.stopping)
        if self.health is not None:
            step("health", self.health.mark_stopping)
        if self.actor is not None:
            step("shutdown", self.actor.begin_shutdown)
            step("stop reading", self.actor.stop_reading)
        if self.kv_events is not None:
            step("kv events", self.kv_events.stop)
            self.kv_events = None
        if self.ctx is not None:
            for attr, endpoint in (("data_sock", self.endpoint), ("admin_sock", self.admin_endpoint)):
                sock = getattr(self, attr, None)
                if sock is not None:
                    step(attr, close_socket, sock, endpoint)
            if self.auth is not None:
                step("curve auth", self.auth.stop)
            step("zmq context", self.ctx.destroy, 0)  # closes any socket left open (linger 0): never hangs
            self.ctx = None
        if self.segments is not None:
            scheduler = getattr(self, "scheduler", None)
            # a start that failed before the scheduler existed keeps the segments only if they held leases
            live = scheduler.active_leases if scheduler is not None else int(self.restarted)
            step("segments close", self.segments.close)
            if live == 0:
                step("segments unlink", self.segments.unlink)
                log.info("stopped; segments unlinked")
            else:
                log.info("stopped; segments kept for restart live_leases=%d", live)
            self.segments = None
        if self.notifier is not None:
            step("notify close", self.notifier.close)
        if self.http is not None:
            step("http", self.http.close)
            self.http = None
        if self.lock is not None:
            step("instance lock", self.lock.release)
            self.lock = None


app = typer.Typer(add_completion=False, rich_markup_mode=None)


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"kvsched-daemon {__version__}")
        raise typer.Exit(0)


@app.command()
def daemon_main(
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="TOML config file (see examples/kvsched.toml).")
    ] = None,
    instance: Annotated[
        str | None, typer.Option(help="Instance name (sockets, segments); default from config or 'default'.")
    ] = None,
    workers: Annotated[
        int | None,
        typer.Option(
            "--workers",
            min=1,
            help="Shortcut: register N workers (ids 0..N-1, dp_rank 0) with default capacities; "
            "an error when the config lists [[workers]].",
        ),
    ] = None,
    endpoint: Annotated[str | None, typer.Option(help="Data socket endpoint (overrides discovery).")] = None,
    admin_endpoint_opt: Annotated[str | None, typer.Option("--admin-endpoint", help="Admin socket endpoint.")] = None,
    check_config: Annotated[
        Path | None,
        typer.Option(
            "--check-config",
            help="Validate FILE as a start with the other flags (e.g. --workers) would, and exit (0 ok, 2 invalid).",
        ),
    ] = None,
    purge: Annotated[
        bool,
        typer.Option(
            "--purge",
            help="Remove a stopped instance's shared-memory segments, lock file and leftover ipc socket files, "
            "and exit.",
        ),
    ] = False,
    log_level: Annotated[str | None, typer.Option(help="debug | info | warning | error")] = None,
    log_format: Annotated[str | None, typer.Option(help="text | json")] = None,
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """Run the kvsched scheduling daemon (one per worker pool).

    Routers connect to the data socket (discovery: $KVSCHED_ENDPOINT, else
    ipc://<rundir>/<instance>.sock); the `kvsched` CLI talks to the admin socket.
    Under systemd (Type=notify) it sends READY=1 once sockets are bound and kernels warm.
    """
    overrides: dict = {"daemon": {}}
    for key, value in (
        ("instance", instance),
        ("endpoint", endpoint),
        ("admin_endpoint", admin_endpoint_opt),
        ("log_level", log_level),
        ("log_format", log_format),
    ):
        if value is not None:
            overrides["daemon"][key] = value
    if check_config is not None:  # the same checks as a start with these flags (--workers included)
        try:
            cfg = _load(check_config, overrides, workers)
        except ConfigError as exc:
            typer.echo(f"invalid: {exc}", err=True)
            raise typer.Exit(2) from None
        for name in ignored_env(os.environ)[1]:
            typer.echo(f"warning: {_ignored_env_line(name)}", err=True)
        problems = check_endpoints(cfg) + [
            m for m in [metrics_host_problem(cfg.daemon.metrics_host, cfg.daemon.metrics_port)] if m
        ]
        if problems:
            typer.echo(f"invalid: {check_config}: " + "; ".join(problems), err=True)
            raise typer.Exit(2)
        typer.echo(
            f"ok: {check_config}: {len(cfg.classes)} classes, {len(cfg.workers)} workers, "
            f"shared memory {segment_bytes(cfg) / 2**20:.1f} MiB"
        )
        raise typer.Exit(0)
    try:
        cfg = _load(config, overrides, workers)
    except ConfigError as exc:
        typer.echo(f"kvsched-daemon: {exc}", err=True)
        raise typer.Exit(2) from None
    setup_logging(cfg.daemon.log_level, cfg.daemon.log_format)
    _log_ignored_env()
    if purge:
        _purge(cfg)
    daemon = Daemon(cfg, str(config) if config else None, overrides)
    for sig in (signal.SIGTERM, signal.SIGINT):  # until the loop installs its own (first thing in start)
        signal.signal(sig, lambda signum, _frame: daemon.on_signal(signum))
    log.info("starting instance=%s pid=%d", cfg.daemon.instance, os.getpid())
    try:
        import uvloop

        uvloop.run(daemon.run())
    except (KvschedError, ShmLayoutError) as exc:
        log.error("daemon failed: %s", exc)
        typer.echo(f"kvsched-daemon: {exc}", err=True)
        raise typer.Exit(1) from None
    except Exception as exc:
        log.error("daemon failed: %s: %s", type(exc).__name__, exc, exc_info=True)
        typer.echo(f"kvsched-daemon: {type(exc).__name__}: {exc}", err=True)
        raise typer.Exit(1) from None


def _source(source: str, key: str, flags: dict) -> str:
    """Where a bound endpoint came from, for the log: "--endpoint" / "--admin-endpoint" (flag),
    "KVSCHED_DAEMON_<KEY>" (the config's env override), "config file", "KVSCHED_ENDPOINT" /
    "KVSCHED_ADMIN_ENDPOINT" (discovery variable: the config left it "") or "discovery"."""
    if source != "config":
        return source
    if key in flags:
        return "--" + key.replace("_", "-")
    env_name = f"KVSCHED_DAEMON_{key.upper()}"
    return env_name if os.environ.get(env_name) else "config file"


def _log_ignored_env() -> None:
    """Log the `KVSCHED_` variables the config loader ignored (`kvsched.config.ignored_env`): one
    debug line per Kubernetes service link, one warning per other name. Neither stops the daemon."""
    links, unknown = ignored_env(os.environ)
    for name in links:
        log.debug("environment variable ignored name=%s reason=kubernetes-service-link", name)
    for name in unknown:
        log.warning("%s", _ignored_env_line(name))


def _ignored_env_line(name: str) -> str:
    return f"environment variable {name} ignored: not one kvsched reads ({env_hint()})"


def _load(config: Path | None, overrides: dict, workers: int | None) -> Config:
    """The config a start uses: the file (None = defaults), env, the flags' `overrides`, and
    `--workers N` (ranks 0..N-1) unless the file lists [[workers]] (then a ConfigError)."""
    cfg = load_config(config, overrides=overrides)
    if workers is not None and cfg.workers:
        raise ConfigError(
            f"--workers {workers} conflicts with the {len(cfg.workers)} [[workers]] of {config}: give one or the other"
        )
    if workers is not None:
        cfg = load_config(config, overrides={**overrides, "workers": [{"worker_id": i} for i in range(workers)]})
    return cfg


def _purge(cfg: Config) -> None:
    """Unlink a stopped instance's segments, lock file and the ipc socket files of the endpoints it
    binds (resolved as a start would: config, flags, discovery); refuse while its daemon runs."""
    d = cfg.daemon
    instance = d.instance
    endpoints = [endpoint for endpoint, _ in daemon_endpoints(instance, d.endpoint, d.admin_endpoint)]
    try:
        found = purge_instance(instance, endpoints)
    except ConfigError as exc:
        typer.echo(f"kvsched-daemon: refusing to purge: {exc}", err=True)
        raise typer.Exit(1) from None
    if found:
        typer.echo(f"purged {', '.join(found)}")
    else:
        typer.echo(f"nothing to purge for instance {instance!r}")
    raise typer.Exit(0)


def main() -> None:
    """Console-script entry point of `kvsched-daemon`.

    Everything is closed by the time the command returns (sockets, segments, lock, metrics
    server), so the process then leaves with `os._exit` after flushing logs and stdio: the
    interpreter's own teardown of the loaded numba/LLVM state takes up to seconds more, longer on a
    busy machine, during which the process still existed after logging "stopped"
    (a service manager waits for it). No atexit work is needed: none is registered by kvsched.
    """
    try:
        app(prog_name="kvsched-daemon")
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken pipe: nothing more to say
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
