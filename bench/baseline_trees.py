"""A bench's measurement run against two `kvsched/` trees: this checkout's and, with `--baseline
REV`, that git revision's (exported to a temporary directory), each in its own child process,
alternating so both see the same machine load; the caller pools the samples and takes medians.

Used by `bench_actor.py` and `bench_link.py`: each is its own child (`--child` + its arguments),
prints its measurement as the last line of JSON, and the parent collects one dict per run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def add_tree_args(ap: argparse.ArgumentParser) -> None:
    """`--alternate`, `--baseline` and the hidden `--child` flag."""
    ap.add_argument(
        "--alternate",
        type=int,
        default=3,
        help="With --baseline: this tree and the baseline run alternately this many times each.",
    )
    ap.add_argument("--baseline", help="Also measure the kvsched/ package of this git revision (exported).")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)


def export_revision(rev: str, prefix: str) -> tuple[str, str]:
    """Export `rev`'s kvsched/ into a new temporary directory: ("@<short rev>", that directory)."""
    tmp = tempfile.mkdtemp(prefix=prefix)
    short = subprocess.run(
        ["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    arch = subprocess.run(["git", "archive", rev, "kvsched"], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", tmp], input=arch.stdout, check=True)
    return f"@{short}", tmp


def run_child(script: str, pythonpath: str | None, args: list[str]) -> dict:
    """`script --child *args` in a child process importing `kvsched` from `pythonpath` (None = this
    tree; numba's cache then goes beside it); the JSON of its last output line."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        env["NUMBA_CACHE_DIR"] = str(Path(pythonpath) / ".numba-cache")
    out = subprocess.run(
        [sys.executable, script, "--child", *args], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def alternate_trees(
    script: str, args: list[str], baseline: str | None, rounds: int, prefix: str
) -> Iterator[tuple[str, dict]]:
    """(tree name, child result) for this tree and, with `baseline`, that revision, alternately,
    `rounds` times each (once without a baseline). Each child reports the `kvsched` directory it
    imported (`result["kvsched"]`), checked against the tree asked for."""
    trees: list[tuple[str, str | None]] = [("this tree", None)]
    tmp = None
    if baseline:
        label, tmp = export_revision(baseline, prefix)
        trees.append((label, tmp))
    for _ in range(rounds if baseline else 1):
        for name, path in trees:
            got = run_child(script, path, args)
            assert (path is None) == (not got["kvsched"].startswith(tmp or "//")), got["kvsched"]
            yield name, got


def median(xs: list[float]) -> float:
    """The upper median (the middle sample of an odd count)."""
    return sorted(xs)[len(xs) // 2]
