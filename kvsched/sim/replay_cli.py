"""The `kvsched replay` command (registered on the CLI's typer app by `kvsched/cli.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

EXIT_OK = 0
EXIT_DAEMON_ERROR = 1
EXIT_UNREACHABLE = 3


def replay(
    trace: Annotated[Path, typer.Argument(help="Trace file: Mooncake .jsonl (hash_ids) or Azure .csv (no hashes).",
                                          exists=True, dir_okay=False, readable=True)],
    routers: Annotated[int, typer.Option(min=1, max=64, help="Router processes replaying the arrivals.")] = 4,
    workers: Annotated[int, typer.Option(min=1, max=1024, help="Simulated engines (workers 0..N-1, one rank each).")] = 4,
    speedup: Annotated[float, typer.Option(min=0.001, help="Compress the whole timeline (arrivals and engine time).")] = 1.0,
    load_scale: Annotated[float, typer.Option(min=0.001, help="Compress arrivals only (more load on the same fleet).")] = 1.0,
    limit: Annotated[Optional[int], typer.Option(min=1, help="Replay only the first N requests.")] = None,
    virtual: Annotated[bool, typer.Option("--virtual", help="Discrete-event driver in process (no daemon, no sockets).")] = False,
    endpoint: Annotated[Optional[str], typer.Option(help="Use this running daemon instead of starting a private one.")] = None,
    admin_endpoint: Annotated[Optional[str], typer.Option(help="Its admin socket (for the final ledger check).")] = None,
    out: Annotated[Path, typer.Option(help="Directory for summary.json, results.jsonl and fleet.json.")] = Path("out/replay"),
    block_size: Annotated[Optional[int], typer.Option(min=1, help="Tokens per KV block (default: the trace's, 512 for Mooncake).")] = None,
    kv_blocks: Annotated[Optional[int], typer.Option(min=1, help="KV blocks per engine (default: Llama-3-8B on an H100-80GB).")] = None,
    max_num_batched_tokens: Annotated[int, typer.Option(min=1, help="Per-step token budget per engine.")] = 8192,
    selector: Annotated[str, typer.Option(help="Worker selection: kv, round_robin, random, least_loaded, power_of_two.")] = "kv",
    seed: Annotated[int, typer.Option(help="Seed for the selector's tie-breaks.")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print summary.json instead of the table.")] = False,
) -> None:
    """Replay a request trace through the scheduler and a simulated fleet; print a summary.

    Starts a private daemon (unless --endpoint), a simulated fleet process (engines with a KV prefix cache, continuous batching and H100 / Llama-3-8B step times) and --routers router processes that replay the trace's arrivals: schedule through the daemon, stream from the fleet, release. With --virtual the same engine model and scheduler core run in process, in virtual time (fast and reproducible: use it for policy comparisons). Writes summary.json and results.jsonl to --out.

    Example: kvsched replay kvsched/data/mooncake_slice.jsonl --routers 4 --workers 4 --speedup 20
    """
    import msgspec
    from rich.console import Console

    from ..errors import DaemonUnavailable, KvschedError
    from .replay import ReplayOptions, run_replay
    from .summary import summary_table

    if selector not in ("kv", "round_robin", "random", "least_loaded", "power_of_two"):
        raise typer.BadParameter(f"unknown selector {selector!r}", param_hint="--selector")
    console = Console(stderr=json_out)
    opts = ReplayOptions(
        trace=trace, routers=routers, workers=workers, speedup=speedup, load_scale=load_scale, limit=limit,
        virtual=virtual, endpoint=endpoint, admin_endpoint=admin_endpoint, out=out, block_size=block_size,
        kv_blocks=kv_blocks, max_num_batched_tokens=max_num_batched_tokens, selector=selector, seed=seed,
    )
    try:
        summary = run_replay(opts, console)
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
        for note in summary.notes:
            console.print(f"note: {note}")
        console.print(f"summary: {out / 'summary.json'}")
    if summary.unfinished or summary.aborted:
        raise typer.Exit(EXIT_DAEMON_ERROR)
