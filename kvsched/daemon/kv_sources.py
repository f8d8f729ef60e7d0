"""Where the KV events of each worker row come from, and the per-source state the subscriber keeps
(docs/KV_EVENTS.md, docs/DESIGN.md §6).

* `KvEventSource`: one worker row's endpoints (engine PUB, optional replay ROUTER, already offset by
  dp_rank), topic and staleness limit; `sources_for_worker` builds them from a `WorkerConfig`.
* `SourceStream`: the sockets and timers of one source, owned by `kv_events.KvEventSubscriber`;
  `replay_backoff_s` the wait before a timed-out replay request is re-sent.

No I/O is started here: the subscriber opens, reads and closes the sockets.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import WorkerConfig
from ..kvevents.format import offset_endpoint
from ..kvevents.staleness import StreamHealth
from .reader import Reader


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """Where one worker row's events come from (endpoints already offset by dp_rank)."""

    row: int  # ledger worker row
    endpoint: str  # the engine's PUB endpoint (we connect)
    replay_endpoint: str | None = None  # the engine's replay ROUTER, or None (no replay)
    topic: str = ""  # SUB prefix filter ("" = every topic)
    # how long a disconnect or an unfilled gap is tolerated before the row is stale (s), never silence;
    # None = the subscriber's default (kvevents/staleness.py)
    stale_after_s: float | None = None


def sources_for_worker(worker_cfg: WorkerConfig, rows_by_rank: dict[int, int]) -> list[KvEventSource]:
    """The sources of one `WorkerConfig` (none without `kv_events_endpoint`).

    Args:
        worker_cfg: `kvsched.config.WorkerConfig`.
        rows_by_rank: dp_rank -> ledger row, for the ranks registered in the ledger.
    """
    if not worker_cfg.kv_events_endpoint:
        return []
    out = []
    for rank, row in sorted(rows_by_rank.items()):
        replay = worker_cfg.kv_replay_endpoint
        out.append(
            KvEventSource(
                row,
                offset_endpoint(worker_cfg.kv_events_endpoint, rank),
                offset_endpoint(replay, rank) if replay else None,
                worker_cfg.kv_events_topic,
                worker_cfg.kv_events_stale_after_s,
            )
        )
    return out


class SourceStream:
    """Sockets and timers of one source (owned and driven by `kv_events.KvEventSubscriber`)."""

    __slots__ = (
        "dealer",
        "health",
        "mon",
        "replay_attempts",
        "replay_deadline_s",
        "retry_at_s",
        "retry_from",
        "src",
        "stale",
        "sub",
    )

    def __init__(self, src: KvEventSource) -> None:
        self.src = src
        self.sub: Reader | None = None  # the SUB socket's reader
        self.mon: Reader | None = None  # the SUB's monitor socket's reader
        self.dealer: Reader | None = None  # the replay DEALER's reader, while a replay is asked
        self.health: StreamHealth | None = None  # made when the SUB connects
        self.stale = False  # as last reported through mark_stale
        self.replay_deadline_s: float | None = None  # end marker expected before this
        self.replay_attempts = 0
        self.retry_at_s: float | None = None  # re-send a failed replay request at this time
        self.retry_from = 0


def replay_backoff_s(attempt: int) -> float:
    """Wait before re-sending a replay request after `attempt` timed-out attempts (s): 0.1 s
    doubling, at most 5 s."""
    return min(5.0, 0.1 * (2 ** max(0, attempt - 1)))
