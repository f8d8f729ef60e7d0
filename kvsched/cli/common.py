"""What every `kvsched` command shares: the global options, the admin call, exit codes, rendering.

Start-up cost matters for a CLI: this module (and every command module) imports neither numpy nor
the scheduling core; the admin client is imported when a command first talks to the daemon.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import typer
import zmq
from rich.console import Console
from rich.table import Table

from .. import protocol as p
from ..client.admin import AdminClient
from ..errors import DaemonUnavailable, ProtocolError

EXIT_OK = 0
EXIT_DAEMON_ERROR = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3

console = Console(width=None if sys.stdout.isatty() else 160)

# Filled by the app callback from --admin-endpoint / --instance / --timeout-s (one process = one call).
opts: dict[str, Any] = {"admin_endpoint": None, "instance": "default", "timeout_s": 5.0}

JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object (for scripts).")]
WorkerArg = Annotated[str, typer.Argument(help="WORKER (all ranks) or WORKER:RANK.")]


def call(request: p.AdminRequest) -> p.AdminReply:
    """Send one admin request to the daemon chosen by the global options; return its reply.

    Exits (typer.Exit) with EXIT_USAGE for a malformed endpoint, EXIT_UNREACHABLE when no daemon
    answers (at once when the ipc socket file does not exist), EXIT_DAEMON_ERROR for an `AdminError`
    reply (printed as `kvsched: <error name>: <message>`) or an undecodable reply.
    """
    try:
        client = AdminClient(opts["admin_endpoint"], instance=opts["instance"], timeout_s=opts["timeout_s"])
    except ValueError as exc:  # names what is wrong with the endpoint
        typer.echo(f"kvsched: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    except zmq.ZMQError as exc:
        typer.echo(f"kvsched: bad admin endpoint {opts['admin_endpoint']!r}: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    try:
        reply = client.call(request)
    except DaemonUnavailable as exc:
        typer.echo(f"kvsched: daemon unreachable: {exc}", err=True)
        raise typer.Exit(EXIT_UNREACHABLE) from None
    except ProtocolError as exc:
        typer.echo(f"kvsched: {exc}", err=True)
        raise typer.Exit(EXIT_DAEMON_ERROR) from None
    finally:
        client.close()
    if isinstance(reply, p.AdminError):
        typer.echo(f"kvsched: {p.error_code_name(reply.code)}: {reply.message}", err=True)
        raise typer.Exit(EXIT_DAEMON_ERROR)
    return reply


def to_json(obj: object) -> str:
    """One line of JSON for a reply struct (or a dict of them)."""
    return msgspec.json.encode(obj).decode()


def render(reply: p.AdminReply, json_out: bool, table: Callable[[Any], Table] | None = None) -> None:
    """Print `reply` as JSON (--json), as the table `table` builds, or its message."""
    if json_out:
        sys.stdout.write(to_json(reply) + "\n")
    elif table is not None:
        console.print(table(reply))
    else:
        console.print(getattr(reply, "message", reply))


def check_request_id(request_id: str) -> str:
    """A request id as the wire accepts it (1..`MAX_REQUEST_ID_BYTES` bytes of UTF-8,
    docs/PROTOCOL.md); anything else is a usage error (exit 2) before any call."""
    size = len(request_id.encode("utf-8", "surrogatepass"))
    if not 1 <= size <= p.MAX_REQUEST_ID_BYTES:
        raise typer.BadParameter(f"a request id has 1..{p.MAX_REQUEST_ID_BYTES} bytes, got {size}")
    return request_id


def parse_worker(spec: str) -> tuple[int, int | None]:
    """`"3"` -> (3, None), `"3:1"` -> (3, 1); anything else — a worker id outside u32 or a rank
    outside u16 (the wire bounds, docs/PROTOCOL.md) included — is a usage error."""
    try:
        if ":" in spec:
            wid_s, rank_s = spec.split(":", 1)
            wid, rank = int(wid_s), int(rank_s)
        else:
            wid, rank = int(spec), None
    except ValueError:
        raise typer.BadParameter(f"expected WORKER or WORKER:RANK, got {spec!r}") from None
    if not 0 <= wid <= 0xFFFF_FFFF:
        raise typer.BadParameter(f"worker id {wid} is outside 0..4294967295")
    if rank is not None and not 0 <= rank <= 0xFFFF:
        raise typer.BadParameter(f"rank {rank} is outside 0..65535")
    return wid, rank
