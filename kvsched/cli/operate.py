"""Commands that change the daemon: `drain`, `undrain`, `add-worker`, `remove-worker`, `cancel`, `reload`."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .. import protocol as p
from .common import WorkerArg, call, check_request_id, parse_worker, render


def drain(worker: WorkerArg) -> None:
    """Stop new admissions on a worker; running leases finish normally."""
    wid, rank = parse_worker(worker)
    render(call(p.Drain(worker_id=wid, dp_rank=rank)), False)


def undrain(worker: WorkerArg) -> None:
    """Resume admissions on a drained worker."""
    wid, rank = parse_worker(worker)
    render(call(p.Undrain(worker_id=wid, dp_rank=rank)), False)


def add_worker(
    worker: Annotated[str, typer.Argument(help="WORKER or WORKER:RANK (rank 0 by default).")],
    total_kv_blocks: Annotated[int, typer.Option(min=1, max=p.MAX_KV_BLOCKS, help="KV blocks of this rank.")] = 8192,
    max_num_batched_tokens: Annotated[
        int, typer.Option(min=1, max=p.MAX_BATCHED_TOKENS, help="Per-step token budget of this rank.")
    ] = 8192,
    kv_events_endpoint: Annotated[
        str | None,
        typer.Option(
            help="The rank's vLLM KV-event PUB endpoint (its own port: not offset again by the rank); "
            "the daemon subscribes and marks the rank stale until events flow."
        ),
    ] = None,
    kv_replay_endpoint: Annotated[
        str | None,
        typer.Option(
            help="The rank's KV-event replay endpoint (missed batches after a gap); needs --kv-events-endpoint."
        ),
    ] = None,
    kv_events_topic: Annotated[str, typer.Option(help='SUB topic filter ("" = all).')] = "",
    kv_events_stale_after_s: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            help="Publisher disconnected or a seq gap unfilled this many seconds -> rank marked stale; silence never "
            "counts (default: the daemon's, 30 s).",
        ),
    ] = None,
    url: Annotated[
        str,
        typer.Option(
            help=(
                "Base URL of the engine's OpenAI server, sent to routers in Admitted.url "
                "(kvsched-gateway forwards there)."
            )
        ),
    ] = "",
) -> None:
    """Register a worker rank at runtime, optionally with its KV-event endpoints (as in `[[workers]]`)."""
    wid, rank = parse_worker(worker)
    if kv_events_endpoint is None and (kv_replay_endpoint or kv_events_topic or kv_events_stale_after_s):
        raise typer.BadParameter(
            "needs --kv-events-endpoint",
            param_hint="--kv-replay-endpoint / --kv-events-topic / --kv-events-stale-after-s",
        )
    render(
        call(
            p.AddWorker(
                worker_id=wid,
                dp_rank=rank or 0,
                total_kv_blocks=total_kv_blocks,
                max_num_batched_tokens=max_num_batched_tokens,
                kv_events_endpoint=kv_events_endpoint,
                kv_replay_endpoint=kv_replay_endpoint,
                kv_events_topic=kv_events_topic,
                kv_events_stale_after_s=kv_events_stale_after_s,
                url=url,
            )
        ),
        False,
    )


def remove_worker(worker: WorkerArg) -> None:
    """Remove a worker: its bookings are released and requests pinned to it are rejected."""
    wid, rank = parse_worker(worker)
    render(call(p.RemoveWorker(worker_id=wid, dp_rank=rank)), False)


def cancel(
    request_id: Annotated[str, typer.Argument(help="The request to cancel.", callback=check_request_id)],
) -> None:
    """Cancel a queued request (it never dispatches) or abort an active lease (its router stops the request)."""
    render(call(p.Cancel(request_id=request_id)), False)


def reload(
    path: Annotated[
        Path | None,
        typer.Argument(
            help="Profile file, relative to this shell's directory (default: the daemon's --config).", dir_okay=False
        ),
    ] = None,
) -> None:
    """Re-read the scheduling profile; an invalid file is refused and the old profile kept.

    PATH is resolved here, against the caller's working directory, before it is sent: the daemon
    runs elsewhere (systemd starts it in /).
    """
    render(call(p.Reload(path=str(path.resolve()) if path is not None else None)), False)


def register(app: typer.Typer) -> None:
    """Add the commands that change the daemon to `app`."""
    # `kvsched drain -1`: a negative worker id is an argument (refused "outside 0..4294967295"),
    # not an unknown option ("No such option: -1"); these commands have no other options.
    worker_only = {"ignore_unknown_options": True}
    app.command(context_settings=worker_only)(drain)
    app.command(context_settings=worker_only)(undrain)
    app.command("add-worker")(add_worker)
    app.command("remove-worker", context_settings=worker_only)(remove_worker)
    app.command()(cancel)
    app.command()(reload)
