"""`kvsched`: inspect and operate a running daemon over its admin socket, replay traces, make keys.

Exit codes: 0 ok, 1 the daemon answered with an error, 2 usage error (typer), 3 daemon unreachable.
Every read command takes `--json` (one JSON object on stdout, for scripts; `top --json` one per refresh).

One module per command group: `views` (read-only), `operate` (changes), `keys` (CURVE key pairs);
`replay` lives with the simulator (`kvsched.sim.replay_cli`).
"""

from __future__ import annotations

from typing import Annotated

import typer

from ..endpoints import instance_problem
from . import keys, operate, views
from .common import EXIT_DAEMON_ERROR, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, opts

__all__ = ["EXIT_DAEMON_ERROR", "EXIT_OK", "EXIT_UNREACHABLE", "EXIT_USAGE", "app", "main"]

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Inspect and operate a kvsched daemon; replay request traces through one.",
)


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        typer.echo(f"kvsched {__version__}")
        raise typer.Exit(EXIT_OK)


@app.callback()
def _common(
    admin_endpoint: Annotated[
        str | None,
        typer.Option(
            "--admin-endpoint",
            envvar="KVSCHED_ADMIN_ENDPOINT",
            help="Admin socket (default: discovery from --instance; `kvsched replay` prints its daemon's).",
        ),
    ] = None,
    instance: Annotated[str, typer.Option(help="Daemon instance name used for discovery.")] = "default",
    timeout_s: Annotated[float, typer.Option("--timeout-s", min=0.001, help="Seconds to wait for the daemon.")] = 5.0,
    version: Annotated[
        bool, typer.Option("--version", is_eager=True, callback=_print_version, help="Print the version and exit.")
    ] = False,
) -> None:
    """Inspect and operate a kvsched daemon; replay request traces through one."""
    bad = instance_problem(instance)
    if bad is not None:
        raise typer.BadParameter(bad, param_hint="--instance")
    if admin_endpoint is not None and not admin_endpoint.strip():
        raise typer.BadParameter(
            "empty; leave it out to discover the admin socket from --instance", param_hint="--admin-endpoint"
        )
    opts.update(admin_endpoint=admin_endpoint, instance=instance, timeout_s=timeout_s)


views.register(app)
operate.register(app)
keys.register(app)


def _register_replay() -> None:
    try:
        from ..sim.replay_cli import replay
    except ImportError:  # the simulator package is optional at import time
        return
    app.command()(replay)


_register_replay()


def main() -> None:
    """Console-script entry point of `kvsched`."""
    app(prog_name="kvsched")


if __name__ == "__main__":
    main()
