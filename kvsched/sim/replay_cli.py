"""The `kvsched replay` command (registered on the CLI's typer app by `kvsched/cli/__init__.py`)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from ..config.selectors import installed_selectors


def selector_types() -> tuple[str, ...]:
    """The `[selector] type` values the config accepts: the installed selectors (the `kvsched.selectors`
    entry points, `kvsched.config.selectors`), which `core.selector.create_selector` builds."""
    return tuple(installed_selectors())


SELECTOR_HELP = "Worker selection (docs/ROUTING.md): " + ", ".join(selector_types()) + "."


EXIT_OK = 0
EXIT_DAEMON_ERROR = 1
EXIT_UNREACHABLE = 3
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a Ctrl-C

CLASS_RULE_HELP = (
    "How requests get a policy class (names must be the profile's classes): "
    "'none' = every request in the profile's default_class; "
    "'isl:latency<4096,agents<16384,batch' = ISL bands, the first band whose bound the ISL is below "
    "(a last name without a bound takes the rest; 'isl' alone = the profile's classes in order with "
    "bounds 4096, 16384, ... x4); "
    "'hash:latency=60,agents=30,batch=10' = weighted, deterministic by request index; "
    "'column:NAME' = a trace column holding the class name (empty = default class)."
)


def replay(
    trace: Annotated[
        Path,
        typer.Argument(
            help="Trace file: Mooncake .jsonl (hash_ids) or Azure .csv (no hashes).",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
    ],
    routers: Annotated[int, typer.Option(min=1, max=64, help="Router processes replaying the arrivals.")] = 4,
    workers: Annotated[
        int, typer.Option(min=1, max=1024, help="Simulated engines (workers 0..N-1, one rank each).")
    ] = 4,
    speedup: Annotated[
        float,
        typer.Option(
            min=0.001,
            help=(
                "Compress the whole timeline: arrivals, engine time and the scheduler's TTLs, half-lives and queue "
                "timeouts."
            ),
        ),
    ] = 1.0,
    load_scale: Annotated[
        float, typer.Option(min=0.001, help="Compress arrivals only (more load on the same fleet).")
    ] = 1.0,
    limit: Annotated[int | None, typer.Option(min=1, help="Replay only the first N requests.")] = None,
    virtual: Annotated[
        bool, typer.Option("--virtual", help="Discrete-event driver in process (no daemon, no sockets).")
    ] = False,
    endpoint: Annotated[
        str | None, typer.Option(help="Use this running daemon instead of starting a private one.")
    ] = None,
    admin_endpoint: Annotated[str | None, typer.Option(help="Its admin socket (for the final ledger check).")] = None,
    out: Annotated[Path, typer.Option(help="Directory for summary.json, results.jsonl and fleet.json.")] = Path(
        "out/replay"
    ),
    block_size: Annotated[
        int | None, typer.Option(min=1, help="Tokens per KV block (default: the trace's, 512 for Mooncake).")
    ] = None,
    kv_blocks: Annotated[
        int | None, typer.Option(min=1, help="KV blocks per engine (default: Llama-3-8B on an H100-80GB).")
    ] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1, help="Per-step token budget per engine.")] = 8192,
    selector: Annotated[str, typer.Option(help=SELECTOR_HELP)] = "kv",
    seed: Annotated[int, typer.Option(help="Seed for the selector's tie-breaks.")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print summary.json instead of the table.")] = False,
    profile: Annotated[
        Path | None,
        typer.Option(
            help="Scheduling profile (TOML): default_class + [[classes]], optional [selector] / [overload]. "
            "The replay's own [daemon] / [[workers]] (block size, capacities) win; --selector / --seed win "
            "over [selector] type / seed.",
            exists=True,
            dir_okay=False,
            readable=True,
        ),
    ] = None,
    class_rule: Annotated[str, typer.Option(help=CLASS_RULE_HELP)] = "none",
    kv_events: Annotated[
        bool,
        typer.Option(
            "--kv-events/--no-kv-events",
            help=(
                "Engines publish their cache changes as vLLM KV events the daemon subscribes to (--virtual: applied in "
                "process); off = the approximate index only."
            ),
        ),
    ] = True,
    kv_encoding: Annotated[
        str, typer.Option(help="KV-event encoding: array (vLLM before PR #42892) | map (after).")
    ] = "array",
    kv_transport: Annotated[
        str, typer.Option(help="KV-event sockets: ipc (replay runtime dir) | tcp (loopback).")
    ] = "ipc",
    overlap_mode: Annotated[
        str | None,
        typer.Option(help="--virtual only: events | approx | none (default: events, or approx with --no-kv-events)."),
    ] = None,
    daemon_ready_timeout: Annotated[
        float,
        typer.Option(
            min=0.0,
            help=(
                "Seconds to wait for the private daemon to be ready (its first start on a machine compiles the kernels:"
                " ~1 min on a busy 2-core machine, cached afterwards). On failure its log is kept as --out/daemon.log "
                "and its shared memory removed."
            ),
        ),
    ] = 300.0,
) -> None:
    """Replay a request trace through the scheduler and a simulated fleet; print a summary.

    Starts a private daemon (unless --endpoint), a simulated fleet process (engines with a KV prefix cache,
    continuous batching and H100 / Llama-3-8B step times) and --routers router processes that replay the trace's
    arrivals: schedule through the daemon, stream from the fleet, release. With --virtual the same engine model and
    scheduler core run in process, in virtual time (fast and reproducible: use it for policy comparisons). Writes
    summary.json and results.jsonl to --out.

    With --profile and --class-rule each request is sent with a policy class and the summary gains a per-class
    section (requests, rejections, queue wait and TTFT p50/p99, dispatch share, uncached-token share).

    Example: kvsched replay kvsched/data/mooncake_slice.jsonl --routers 4 --workers 4 --speedup 20

    Example: kvsched replay TRACE --virtual --profile examples/profile-multiclass.toml --class-rule
    hash:latency=60,agents=30,batch=10
    """
    import msgspec
    from rich.console import Console

    from ..config.selectors import selector_problem
    from ..errors import ConfigError, DaemonUnavailable, KvschedError
    from .classes import ClassRuleError, check_class_names, parse_class_rule
    from .replay import ReplayOptions, load_profile, profile_class_names, run_replay
    from .summary import class_table, summary_table

    problem = selector_problem(selector)
    if problem is not None:  # not installed: the message lists the installed ones (or names kvsched-bench)
        raise typer.BadParameter(problem, param_hint="--selector")
    for name, value, allowed in (
        ("--kv-encoding", kv_encoding, ("array", "map")),
        ("--kv-transport", kv_transport, ("ipc", "tcp")),
        ("--overlap-mode", overlap_mode or "events", ("events", "approx", "none")),
    ):
        if value not in allowed:
            raise typer.BadParameter(f"{value!r} is not one of {', '.join(allowed)}", param_hint=name)
    try:
        profile_cfg = load_profile(profile) if profile is not None else None
    except ConfigError as exc:
        raise typer.BadParameter(str(exc), param_hint="--profile") from None
    try:
        rule = parse_class_rule(class_rule, profile_class_names(profile_cfg))
        check_class_names(rule.names, profile_class_names(profile_cfg))
    except ClassRuleError as exc:
        raise typer.BadParameter(str(exc), param_hint="--class-rule") from None
    console = Console(stderr=json_out, width=None if sys.stdout.isatty() else 160)
    opts = ReplayOptions(
        trace=trace,
        routers=routers,
        workers=workers,
        speedup=speedup,
        load_scale=load_scale,
        limit=limit,
        virtual=virtual,
        endpoint=endpoint,
        admin_endpoint=admin_endpoint,
        out=out,
        block_size=block_size,
        kv_blocks=kv_blocks,
        max_num_batched_tokens=max_num_batched_tokens,
        selector=selector,
        seed=seed,
        profile=profile,
        class_rule=class_rule,
        kv_events=kv_events,
        kv_encoding=kv_encoding,
        kv_transport=kv_transport,
        overlap_mode=overlap_mode,
        daemon_ready_timeout_s=daemon_ready_timeout,
    )
    try:
        summary = run_replay(opts, console)
    except KeyboardInterrupt:  # run_replay has stopped its processes and removed their shared memory
        log = out / "daemon.log"
        typer.echo(
            "kvsched replay: interrupted"
            + (
                ""
                if virtual
                else "; cleaned up (processes stopped, shared memory removed"
                + (f"; daemon log {log})" if log.exists() and not endpoint else ")")
            ),
            err=True,
        )
        raise typer.Exit(EXIT_INTERRUPTED) from None
    except ClassRuleError as exc:  # a column value naming an unknown class
        raise typer.BadParameter(str(exc), param_hint="--class-rule") from None
    except DaemonUnavailable as exc:
        typer.echo(f"kvsched replay: {exc}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    except (KvschedError, RuntimeError, ValueError) as exc:
        typer.echo(f"kvsched replay: {exc}", err=True)
        raise typer.Exit(EXIT_DAEMON_ERROR) from None
    if json_out:
        typer.echo(msgspec.json.encode(summary).decode())
    else:
        console.print(summary_table(summary))
        if summary.classes:
            console.print(class_table(summary))
        for note in summary.notes:
            console.print(f"note: {escape(note)}")
        console.print(f"summary: {out / 'summary.json'}")
    if summary.unfinished or summary.aborted:
        raise typer.Exit(EXIT_DAEMON_ERROR)
