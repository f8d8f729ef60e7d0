"""Rate-limited warning lines for misbehaving peers (a flood of bad frames must not flood the log)."""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    """Log at most one line per `key` every `interval_s` seconds; counts what it suppressed.

    Args:
        logger: where lines go.
        interval_s: minimum seconds between two lines with the same key.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 5.0) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warning(self, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            self._log.warning(msg + " suppressed=%d", *args, suppressed)
        else:
            self._log.warning(msg, *args)
