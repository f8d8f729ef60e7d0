"""Test factories with keyword overrides (STYLE §10): entries, class configs, requests, schedulers."""

from __future__ import annotations

import itertools

from kvsched.config import ClassConfig
from kvsched.core.ordering import QueueEntry

_SEQ = itertools.count(1)


def make_entry(request_id: str | None = None, **overrides) -> QueueEntry:
    """A QueueEntry with a fresh enqueue_seq / arrival; override any field by keyword."""
    seq = next(_SEQ)
    fields = dict(request_id=request_id or f"r{seq}", enqueue_seq=seq, arrival_us=seq * 1000,
                  cost=100, isl_tokens=100)
    fields.update(overrides)
    return QueueEntry(**fields)


def make_class(name: str = "default", **overrides) -> ClassConfig:
    """A ClassConfig; override any field by keyword."""
    return ClassConfig(name=name, **overrides)
