"""`kvsched keys`: generate a CURVE key pair for a daemon or a remote router.

The files use ZeroMQ's certificate text format (a `curve` section with `public-key` / `secret-key`),
as read by `zmq.auth.load_certificate` and by the daemon's `curve_secret_key_file` /
`curve_authorized_keys_dir` (see the README section "Routers on other hosts").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer

from .common import EXIT_USAGE

SECRET_MODE = 0o600  # owner read/write only
PUBLIC_MODE = 0o644
DIR_MODE = 0o700  # a directory this command creates holds a secret key


def _cert_text(name: str, public: bytes, secret: bytes | None) -> str:
    kind = "secret key: give it to no one" if secret is not None else "public key: safe to share"
    lines = [f"# kvsched CURVE {kind} ({name})", "", "metadata", "curve", f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return "\n".join(lines) + "\n"


def _write(path: Path, text: str, mode: int, force: bool) -> None:
    """Create `path` with exactly `mode` (never readable by others, even for an instant)."""
    if force:
        path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)  # the umask may have removed bits the mode asks for
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def keys(
    directory: Annotated[
        Path,
        typer.Argument(
            help="Where to write NAME.key and NAME.key_secret (created with mode 0700 if missing).", file_okay=False
        ),
    ],
    name: Annotated[str, typer.Option(help="File name stem, e.g. 'server' or the router's host name.")] = "server",
    force: Annotated[bool, typer.Option("--force", help="Replace existing files of that name.")] = False,
) -> None:
    """Generate a CURVE key pair (zmq.curve_keypair): NAME.key (public, 0644) and NAME.key_secret (0600).

    For the daemon: set `[daemon] curve_secret_key_file` to server.key_secret and give server.key's
    public key to the routers (`SchedulerClient(curve_server_key=...)`). For a router: copy its NAME.key
    into the daemon's `curve_authorized_keys_dir` and load the pair with
    `zmq.auth.load_certificate("NAME.key_secret")` for `curve_client_keys`.

    Exits 2 with a one-line message when the files exist (without --force) or cannot be written.
    """
    import zmq

    if not name or "/" in name or name.startswith("."):
        raise typer.BadParameter(f"{name!r} is not a plain file name", param_hint="--name")
    public_path, secret_path = directory / f"{name}.key", directory / f"{name}.key_secret"
    existing = [str(x) for x in (public_path, secret_path) if x.exists()]
    if existing and not force:
        typer.echo(f"kvsched keys: {', '.join(existing)} already exist(s); use --force to replace", err=True)
        raise typer.Exit(EXIT_USAGE)
    public, secret = zmq.curve_keypair()
    try:
        if not directory.exists():
            directory.mkdir(mode=DIR_MODE, parents=True)
        _write(secret_path, _cert_text(name, public, secret), SECRET_MODE, force)
        _write(public_path, _cert_text(name, public, None), PUBLIC_MODE, force)
    except OSError as exc:  # unwritable / nonexistent parent (/proc), a file in the way, disk full
        typer.echo(
            f"kvsched keys: cannot write keys to {directory}: {exc.strerror or exc}"
            f"{f' ({exc.filename})' if exc.filename else ''}",
            err=True,
        )
        raise typer.Exit(EXIT_USAGE) from None
    typer.echo(
        f"public key {public_path} (mode 0644)\nsecret key {secret_path} (mode 0600)\npublic key: {public.decode()}"
    )


def register(app: typer.Typer) -> None:
    """Add `keys` to `app`."""
    app.command()(keys)
