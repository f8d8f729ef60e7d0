"""argparse types shared by `kvsched-gateway` and `kvsched-sim-engine`.

Each raises `argparse.ArgumentTypeError`, so a bad value ends in argparse's usage line plus
"error: argument --FLAG: ..." and exit 2, not a traceback.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level_arg(text: str) -> str:
    """`--log-level`: one of LOG_LEVELS, any case; returns it upper-cased."""
    level = text.upper()
    if level not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"unknown log level {text!r}; use one of {', '.join(LOG_LEVELS)}")
    return level


def int_range_arg(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (`high` None: no upper bound), e.g. `--workers`,
    bounded as the config's key."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be >= {low}, got {value}" if high is None else f"must be in [{low}, {high}], got {value}"
            )
        return value

    return parse


positive_int_arg = int_range_arg(1)  # an integer >= 1 (a count or size, e.g. `--block-size` in tokens)


def ready_file_arg(text: str) -> str:
    """`--ready-file`: a path whose directory exists and is writable (the file is written later,
    once serving, so a script waiting for it must not see it early); not a directory itself."""
    path = Path(text)
    parent = path.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: directory {str(parent)!r} does not exist")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: is a directory; give a file path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: directory {str(parent)!r} is not writable")
    return text
