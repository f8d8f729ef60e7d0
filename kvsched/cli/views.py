"""Read-only commands: `status`, `queues`, `workers`, `leases`, `explain`, `top` (tables or --json)."""

from __future__ import annotations

import os
import sys
import time
from typing import Annotated, Any

import typer
from rich.table import Table

from .. import protocol as p
from .common import JsonOpt, call, check_request_id, console, render, to_json

_LEFT = ("class", "ordering", "request_id", "state", "worker")


def _table(title: str, columns: list[str], rows: list[list[object]]) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="left" if c in _LEFT else "right")
    for r in rows:
        t.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r])
    return t


def status_table(r: p.StatusReply) -> Table:
    """Two-column table of a `StatusReply`."""
    rows: list[list[object]] = [
        ["instance", r.instance],
        ["epoch", r.daemon_epoch],
        ["uptime_s", round(r.uptime_s, 1)],
        ["endpoint", r.endpoint],
        ["block_size", r.block_size],
        ["workers", r.workers],
        ["connections", r.connections],
        ["active leases", r.active_leases],
        ["queued", r.queued],
        ["deferred", r.deferred],
        ["decisions", r.decisions_total],
        ["decisions/s", round(r.decisions_per_s, 1)],
    ]
    t = Table(title="kvsched status", show_header=False)
    t.add_column("field")
    t.add_column("value")
    for k, v in rows:
        t.add_row(str(k), str(v))
    return t


def queues_table(r: p.QueuesReply) -> Table:
    """One row per policy class."""
    return _table(
        "queues",
        [
            "class",
            "ordering",
            "quantum",
            "depth",
            "deferred",
            "isl_tokens",
            "oldest_wait_s",
            "deficit",
            "blocked_lanes",
        ],
        [
            [
                c.name,
                c.ordering,
                c.quantum,
                c.depth,
                c.deferred,
                c.isl_tokens,
                c.oldest_wait_s,
                c.deficit,
                c.blocked_lanes,
            ]
            for c in r.classes
        ],
    )


def workers_table(r: p.WorkersReply) -> Table:
    """One row per worker rank."""
    return _table(
        "workers",
        [
            "worker",
            "active_blocks",
            "capacity",
            "prefill_tokens",
            "requests",
            "drained",
            "overloaded",
            "stale",
            "hashes",
        ],
        [
            [
                f"{w.worker_id}:{w.dp_rank}",
                w.active_blocks,
                w.total_kv_blocks,
                w.active_prefill_tokens,
                w.active_requests,
                w.drained,
                w.overloaded,
                w.stale,
                "MISMATCH" if w.hash_mismatch else "ok",
            ]
            for w in r.workers
        ],
    )


def leases_table(r: p.LeasesReply) -> Table:
    """One row per lease; the title says how many of the matching leases are shown."""
    return _table(
        f"leases ({len(r.leases)} of {r.total})",
        ["request_id", "worker", "class", "slot", "isl_tokens", "cached_tokens", "output_tokens", "age_s", "state"],
        [
            [
                x.request_id,
                f"{x.worker_id}:{x.dp_rank}",
                x.policy_class,
                x.slot,
                x.isl_tokens,
                x.cached_tokens,
                x.output_tokens,
                x.age_s,
                x.state,
            ]
            for x in r.leases
        ],
    )


def explain_table(r: p.ExplainReply) -> Table:
    """One row per worker of a recent decision, with one column per cost term of the selector. The rows
    carry terms only when the selector picked the lowest cost (`WorkerSelector.terms`: kv, or a cost
    baseline); otherwise (round_robin, least_loaded, the kvsched-bench baselines lmetric, llmd, ...) the
    cost is the projection's, Dynamo's kv-router cost, shown for reference and headed as not used. The
    title names the selector that decided."""
    names = list(dict.fromkeys(k for x in r.rows for k in x.terms))  # the selector's cost terms, in order
    by = f" by selector {r.decided_by}" if r.decided_by else ""
    cost = "cost" if names else f"dynamo_cost (not used by {r.decided_by or 'the selector'})"
    names = [k for k in names if k != "cost"]  # a selector's one term "cost" is the total column itself
    return _table(
        f"decision for {r.request_id}: chose {r.chosen_worker_id}:{r.chosen_dp_rank}{by}",
        ["worker", "eligible", "overlap_blocks", "potential_blocks", "potential_prefill", *names, cost],
        [
            [
                f"{x.worker_id}:{x.dp_rank}",
                x.eligible,
                x.overlap_blocks,
                x.potential_blocks,
                x.potential_prefill_tokens,
                *[round(x.terms[k], 2) if k in x.terms else "" for k in names],
                round(x.cost, 2),
            ]
            for x in r.rows
        ],
    )


def status(json_out: JsonOpt = False) -> None:
    """Show the daemon's epoch, uptime, workers, active leases, queue sizes and decision rate."""
    render(call(p.Status()), json_out, status_table)


def queues(
    policy_class: Annotated[str | None, typer.Argument(help="Only this class.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Show each class's depth, deferred count, ISL tokens, oldest wait, DRR deficit and blocked lanes."""
    render(call(p.Queues(policy_class=policy_class)), json_out, queues_table)


def workers(json_out: JsonOpt = False) -> None:
    """Show each worker rank's active KV blocks / capacity, prefill tokens, requests and flags."""
    render(call(p.Workers()), json_out, workers_table)


def leases(
    worker: Annotated[
        int | None, typer.Option("--worker", min=0, max=0xFFFF_FFFF, help="Only leases on this worker id.")
    ] = None,
    policy_class: Annotated[str | None, typer.Option("--class", help="Only this class.")] = None,
    limit: Annotated[int, typer.Option(min=1, max=100_000, help="At most this many rows.")] = 100,
    json_out: JsonOpt = False,
) -> None:
    """List active leases (request, worker, class, tokens, age, state); `total` counts the matching ones."""
    render(call(p.Leases(worker_id=worker, policy_class=policy_class, limit=limit)), json_out, leases_table)


def explain(
    request_id: Annotated[str, typer.Argument(help="A recently decided request.", callback=check_request_id)],
    json_out: JsonOpt = False,
) -> None:
    """Show the per-worker overlap, projected load and cost behind a recent decision."""
    render(call(p.Explain(request_id=request_id)), json_out, explain_table)


def top(
    interval_s: Annotated[float, typer.Option("--interval-s", min=0.0, help="Refresh period (s).")] = 1.0,
    iterations: Annotated[int, typer.Option(min=0, help="Stop after N refreshes (0 = until Ctrl-C).")] = 0,
    json_out: Annotated[
        bool, typer.Option("--json", help="One JSON object per refresh, one per line: {status, queues, workers}.")
    ] = False,
) -> None:
    """Live view of status, queues and workers, refreshed every --interval-s (when the output is not
    a terminal, one full frame is printed per refresh)."""
    from rich.console import Group
    from rich.live import Live

    def snapshot() -> tuple[Any, Any, Any]:  # StatusReply, QueuesReply, WorkersReply
        return call(p.Status()), call(p.Queues()), call(p.Workers())

    def frame() -> Group:
        s, q, w = snapshot()
        return Group(status_table(s), queues_table(q), workers_table(w))

    n = 0
    try:
        if json_out:
            while True:
                s, q, w = snapshot()
                sys.stdout.write(to_json({"status": s, "queues": q, "workers": w}) + "\n")
                sys.stdout.flush()
                n += 1
                if iterations and n >= iterations:
                    return
                time.sleep(interval_s)
        if not console.is_terminal:  # piped or logged: one full frame per refresh, like `top -b`
            while True:
                with console.capture() as shot:  # rendered here, written by us: a closed pipe ends it
                    console.print(frame())
                sys.stdout.write(shot.get())
                sys.stdout.flush()
                n += 1
                if iterations and n >= iterations:
                    return
                time.sleep(interval_s)
        with Live(frame(), console=console, refresh_per_second=4) as live:
            while iterations == 0 or n < iterations - 1:
                time.sleep(interval_s)
                live.update(frame())
                n += 1
    except KeyboardInterrupt:
        pass
    except BrokenPipeError:  # `kvsched top | head`: the reader left; a normal end, status 0
        # Point stdout at /dev/null so the interpreter's final flush cannot raise again (the
        # Python `signal` module docs, "Note on SIGPIPE").
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())


def register(app: typer.Typer) -> None:
    """Add the read-only commands to `app`."""
    for fn in (status, queues, workers, leases, explain, top):
        app.command()(fn)
