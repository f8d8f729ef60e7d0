"""Log configuration of the daemon: one line per event on stderr, key=value text or JSON lines."""

from __future__ import annotations

import logging
import sys

import msgspec


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (the rendered key=value message)."""

    _enc = msgspec.json.Encoder()

    def format(self, record: logging.LogRecord) -> str:
        doc = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return self._enc.encode(doc).decode()


def setup_logging(level: str = "info", fmt: str = "text") -> None:
    """Configure the root logger once: stderr, `level`, `text` (key=value) or `json` lines."""
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
