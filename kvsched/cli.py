"""`kvsched`: inspect and operate a running daemon over its admin socket, and replay traces.

Exit codes: 0 ok, 1 the daemon answered with an error, 2 usage error (typer), 3 daemon unreachable.
Every read command takes `--json` (one JSON object on stdout, for scripts).
"""

from __future__ import annotations

import sys
import time
from typing import Annotated, Callable, Optional

import msgspec
import typer
import zmq
from rich.console import Console
from rich.live import Live
from rich.table import Table

from . import protocol as p
from .errors import DaemonUnavailable, ProtocolError

EXIT_OK = 0
EXIT_DAEMON_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

app = typer.Typer(add_completion=False, no_args_is_help=True, rich_markup_mode=None,
                  help="Inspect and operate a kvsched daemon; replay request traces through one.")
console = Console(width=None if sys.stdout.isatty() else 160)
_opts: dict = {"admin_endpoint": None, "instance": "default", "timeout_s": 5.0}


@app.callback()
def _common(
    admin_endpoint: Annotated[Optional[str], typer.Option("--admin-endpoint", envvar="KVSCHED_ADMIN_ENDPOINT",
                                                          help="Admin socket (default: discovery from --instance).")] = None,
    instance: Annotated[str, typer.Option(help="Daemon instance name used for discovery.")] = "default",
    timeout_s: Annotated[float, typer.Option("--timeout-s", help="Seconds to wait for the daemon.")] = 5.0,
) -> None:
    """Inspect and operate a kvsched daemon; replay request traces through one."""
    _opts.update(admin_endpoint=admin_endpoint, instance=instance, timeout_s=timeout_s)


def _call(request: p.AdminRequest) -> p.AdminReply:
    from .client.admin import AdminClient

    try:
        client = AdminClient(_opts["admin_endpoint"], instance=_opts["instance"], timeout_s=_opts["timeout_s"])
    except zmq.ZMQError as exc:
        typer.echo(f"kvsched: bad admin endpoint {_opts['admin_endpoint']!r}: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE)
    try:
        reply = client.call(request)
    except DaemonUnavailable as exc:
        typer.echo(f"kvsched: daemon unreachable: {exc}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE)
    except ProtocolError as exc:
        typer.echo(f"kvsched: {exc}", err=True)
        raise typer.Exit(EXIT_DAEMON_ERROR)
    finally:
        client.close()
    if isinstance(reply, p.AdminError):
        typer.echo(f"kvsched: daemon error {reply.code}: {reply.message}", err=True)
        raise typer.Exit(EXIT_DAEMON_ERROR)
    return reply


def _render(reply: p.AdminReply, json_out: bool, table: Callable[[p.AdminReply], Table] | None = None) -> None:
    if json_out:
        sys.stdout.write(msgspec.json.encode(reply).decode() + "\n")
    elif table is not None:
        console.print(table(reply))
    else:
        console.print(getattr(reply, "message", reply))


def _table(title: str, columns: list[str], rows: list[list[object]]) -> Table:
    t = Table(title=title)
    for c in columns:
        t.add_column(c, justify="right" if c not in ("class", "ordering", "request_id", "state", "worker") else "left")
    for r in rows:
        t.add_row(*[f"{v:.3f}" if isinstance(v, float) else str(v) for v in r])
    return t


def _status_table(r: p.StatusReply) -> Table:
    rows = [["instance", r.instance], ["epoch", r.daemon_epoch], ["uptime_s", round(r.uptime_s, 1)],
            ["endpoint", r.endpoint], ["block_size", r.block_size], ["workers", r.workers],
            ["connections", r.connections], ["active leases", r.active_leases], ["queued", r.queued],
            ["deferred", r.deferred], ["decisions", r.decisions_total], ["decisions/s", round(r.decisions_per_s, 1)]]
    t = Table(title="kvsched status", show_header=False)
    t.add_column("field")
    t.add_column("value")
    for k, v in rows:
        t.add_row(k, str(v))
    return t


def _queues_table(r: p.QueuesReply) -> Table:
    return _table("queues", ["class", "ordering", "quantum", "depth", "deferred", "isl_tokens", "oldest_wait_s",
                             "deficit", "blocked_lanes"],
                  [[c.name, c.ordering, c.quantum, c.depth, c.deferred, c.isl_tokens, c.oldest_wait_s, c.deficit,
                    c.blocked_lanes] for c in r.classes])


def _workers_table(r: p.WorkersReply) -> Table:
    return _table("workers", ["worker", "active_blocks", "capacity", "prefill_tokens", "requests", "drained",
                              "overloaded", "stale"],
                  [[f"{w.worker_id}:{w.dp_rank}", w.active_blocks, w.total_kv_blocks, w.active_prefill_tokens,
                    w.active_requests, w.drained, w.overloaded, w.stale] for w in r.workers])


def _leases_table(r: p.LeasesReply) -> Table:
    return _table(f"leases ({len(r.leases)} of {r.total})",
                  ["request_id", "worker", "class", "slot", "isl_tokens", "cached_tokens", "output_tokens", "age_s", "state"],
                  [[x.request_id, f"{x.worker_id}:{x.dp_rank}", x.policy_class, x.slot, x.isl_tokens,
                    x.cached_tokens, x.output_tokens, x.age_s, x.state] for x in r.leases])


def _explain_table(r: p.ExplainReply) -> Table:
    names = list(dict.fromkeys(k for x in r.rows for k in x.terms))  # the selector's cost terms, in order
    return _table(f"decision for {r.request_id}: chose {r.chosen_worker_id}:{r.chosen_dp_rank}",
                  ["worker", "eligible", "overlap_blocks", "potential_blocks", "potential_prefill", *names, "cost"],
                  [[f"{x.worker_id}:{x.dp_rank}", x.eligible, x.overlap_blocks, x.potential_blocks,
                    x.potential_prefill_tokens, *[round(x.terms[k], 2) if k in x.terms else "" for k in names],
                    round(x.cost, 2)] for x in r.rows])


JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts).")]


def _parse_worker(spec: str) -> tuple[int, int | None]:
    try:
        if ":" in spec:
            wid, rank = spec.split(":", 1)
            return int(wid), int(rank)
        return int(spec), None
    except ValueError:
        raise typer.BadParameter(f"expected WORKER or WORKER:RANK, got {spec!r}") from None


@app.command()
def status(json_out: JsonOpt = False) -> None:
    """Show the daemon's epoch, uptime, workers, active leases, queue sizes and decision rate."""
    _render(_call(p.Status()), json_out, _status_table)


@app.command()
def queues(
    policy_class: Annotated[Optional[str], typer.Argument(help="Only this class.")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Show each class's depth, deferred count, ISL tokens, oldest wait, DRR deficit and blocked lanes."""
    _render(_call(p.Queues(policy_class=policy_class)), json_out, _queues_table)


@app.command()
def workers(json_out: JsonOpt = False) -> None:
    """Show each worker rank's active KV blocks / capacity, prefill tokens, requests and flags."""
    _render(_call(p.Workers()), json_out, _workers_table)


@app.command()
def leases(
    worker: Annotated[Optional[int], typer.Option("--worker", help="Only leases on this worker id.")] = None,
    policy_class: Annotated[Optional[str], typer.Option("--class", help="Only this class.")] = None,
    limit: Annotated[int, typer.Option(help="At most this many rows.")] = 100,
    json_out: JsonOpt = False,
) -> None:
    """List active leases (request, worker, class, tokens, age, state)."""
    _render(_call(p.Leases(worker_id=worker, policy_class=policy_class, limit=limit)), json_out, _leases_table)


@app.command()
def drain(worker: Annotated[str, typer.Argument(help="WORKER (all ranks) or WORKER:RANK.")]) -> None:
    """Stop new admissions on a worker; running leases finish normally."""
    wid, rank = _parse_worker(worker)
    _render(_call(p.Drain(worker_id=wid, dp_rank=rank)), False)


@app.command()
def undrain(worker: Annotated[str, typer.Argument(help="WORKER (all ranks) or WORKER:RANK.")]) -> None:
    """Resume admissions on a drained worker."""
    wid, rank = _parse_worker(worker)
    _render(_call(p.Undrain(worker_id=wid, dp_rank=rank)), False)


@app.command("add-worker")
def add_worker(
    worker: Annotated[str, typer.Argument(help="WORKER or WORKER:RANK (rank 0 by default).")],
    total_kv_blocks: Annotated[int, typer.Option(help="KV blocks of this rank.")] = 8192,
    max_num_batched_tokens: Annotated[int, typer.Option(help="Per-step token budget of this rank.")] = 8192,
) -> None:
    """Register a worker rank at runtime."""
    wid, rank = _parse_worker(worker)
    _render(_call(p.AddWorker(worker_id=wid, dp_rank=rank or 0, total_kv_blocks=total_kv_blocks,
                              max_num_batched_tokens=max_num_batched_tokens)), False)


@app.command("remove-worker")
def remove_worker(worker: Annotated[str, typer.Argument(help="WORKER (all ranks) or WORKER:RANK.")]) -> None:
    """Remove a worker: its bookings are released and requests pinned to it are rejected."""
    wid, rank = _parse_worker(worker)
    _render(_call(p.RemoveWorker(worker_id=wid, dp_rank=rank)), False)


@app.command()
def cancel(request_id: Annotated[str, typer.Argument(help="The request to cancel.")]) -> None:
    """Cancel a queued request (it never dispatches) or abort an active lease."""
    _render(_call(p.Cancel(request_id=request_id)), False)


@app.command()
def reload(path: Annotated[Optional[str], typer.Argument(help="Profile file (default: the daemon's --config).")] = None) -> None:
    """Re-read the scheduling profile; an invalid file is refused and the old profile kept."""
    _render(_call(p.Reload(path=path)), False)


@app.command()
def explain(request_id: Annotated[str, typer.Argument(help="A recently decided request.")], json_out: JsonOpt = False) -> None:
    """Show the per-worker overlap, projected load and cost behind a recent decision."""
    _render(_call(p.Explain(request_id=request_id)), json_out, _explain_table)


@app.command()
def top(
    interval_s: Annotated[float, typer.Option("--interval-s", help="Refresh period (s).")] = 1.0,
    iterations: Annotated[int, typer.Option(help="Stop after N refreshes (0 = until Ctrl-C).")] = 0,
) -> None:
    """Live view of status, queues and workers, refreshed every --interval-s."""
    from rich.console import Group

    def frame() -> Group:
        return Group(_status_table(_call(p.Status())), _queues_table(_call(p.Queues())),
                     _workers_table(_call(p.Workers())))

    n = 0
    try:
        with Live(frame(), console=console, refresh_per_second=4) as live:
            while iterations == 0 or n < iterations - 1:
                time.sleep(interval_s)
                live.update(frame())
                n += 1
    except KeyboardInterrupt:
        pass


def _register_replay() -> None:
    try:
        from .sim.replay_cli import replay
    except ImportError:  # the simulator package is optional at import time
        return
    app.command()(replay)


_register_replay()


def main() -> None:
    """Console-script entry point of `kvsched`."""
    app(prog_name="kvsched")


if __name__ == "__main__":
    main()
