"""The worker registry: the lifecycle of a worker rank end to end — add, remove, and restore after a
restart (docs/PROTOCOL.md `add_worker` / `remove_worker`, docs/KV_EVENTS.md "Restarts keep the cache view").

The Scheduler owns a rank's ledger row (capacities, bookings, `Scheduler.add_worker` /
`remove_worker`); the `WorkerRegistry` owns everything else a rank has in the daemon:

* `urls`: worker id -> base URL sent in `Admitted.url` (the actor reads it; only the registry writes it);
* the rank's KV-event source (it adds and removes the subscriber's sources, and marks the row event-fed);
* the runtime-worker record of a rank added by `kvsched add-worker`: its URL and KV-event endpoints,
  kept in the row's record of the KV-index segment (`KvIndexSegment.store_meta`) so that a restarted
  daemon, which re-adopts the row from the ledger, restores them too. A record names the identity of
  the row it was written for (worker id, rank, the ledger's `w_generation`); a record whose row now
  holds another worker, or that a `[[workers]]` entry of the config covers, is dropped (the config wins);
* the KV-event hash check's verdict of a row (`HashCheck.bad_rows`), forgotten with the row and shown
  as `hash_mismatch` by `kvsched workers`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
import zmq

from .. import protocol as p
from ..config import Config, url_problem
from ..core.types import Admit, Reject
from ..endpoints import endpoint_problem
from ..protocol import WorkerKey
from .kv_sources import KvEventSource, sources_for_worker

if TYPE_CHECKING:
    from ..core.scheduler import Scheduler
    from ..kvevents.hash_check import HashCheck
    from ..shm.kv_index import KvIndexSegment
    from .kv_events import KvEventSubscriber

log = logging.getLogger(__name__)

Outcomes = list[Admit | Reject]


class RuntimeWorker(msgspec.Struct, array_like=True, frozen=True):
    """One runtime-added rank as kept in shared memory (the fields of its `AddWorker`)."""

    worker_id: int
    dp_rank: int
    generation: int  # the ledger's w_generation of its row when it was added
    url: str = ""
    kv_events_endpoint: str | None = None
    kv_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    kv_events_stale_after_s: float | None = None

    def source(self, row: int) -> KvEventSource:
        """The KV-event source of this rank in ledger row `row` (its endpoints are its own: no dp offset)."""
        assert self.kv_events_endpoint
        return KvEventSource(
            row,
            self.kv_events_endpoint,
            self.kv_replay_endpoint or None,
            self.kv_events_topic,
            self.kv_events_stale_after_s,
        )


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(RuntimeWorker)


def admin_error(code: p.ErrorCode, message: str) -> p.AdminError:
    """An `AdminError` reply."""
    return p.AdminError(code=int(code), message=message)


def worker_name(req: p.AddWorker | p.RemoveWorker | p.Drain | p.Undrain) -> str:
    """`worker_id` or `worker_id:dp_rank` of an admin request, for replies and log lines."""
    return f"{req.worker_id}" if req.dp_rank is None else f"{req.worker_id}:{req.dp_rank}"


class WorkerRegistry:
    """Adds, removes and restores worker ranks; owns their URLs, KV-event sources and kept records.

    Args:
        config: the config the daemon started with (`[[workers]]`: URLs, KV-event endpoints).
        scheduler: the `Scheduler` (the ranks' ledger rows).
        kv_index: the KV-index segment where runtime-added ranks are kept, or None (nothing kept).
        restarted: True when the ledger was re-attached: the kept records of re-adopted rows are restored.
    Attributes:
        urls: worker id -> base URL (`Admitted.url`).
        runtime: row -> `RuntimeWorker` restored at start.
        kv_events / hash_check: the KV-event subscriber and hash check (`attach`), or None.
    """

    def __init__(self, config: Config, scheduler: Scheduler, kv_index: KvIndexSegment | None, restarted: bool) -> None:
        self.config = config
        self.scheduler = scheduler
        self.ledger = scheduler.ledger
        self.kv_index = kv_index
        self.kv_events: KvEventSubscriber | None = None
        self.hash_check: HashCheck | None = None
        self.runtime = self._restored() if restarted and kv_index is not None else {}
        if self.runtime:
            log.info(
                "runtime workers restored with their url / KV events workers=%s",
                ",".join(f"{r.worker_id}:{r.dp_rank}" for r in self.runtime.values()),
            )
        self.urls: dict[int, str] = {
            **{r.worker_id: r.url for r in self.runtime.values() if r.url},
            **{w.worker_id: w.url for w in config.workers if w.url},
        }

    # ------------------------------------------------------------------ start
    def kv_sources(self) -> list[KvEventSource]:
        """The KV-event sources of the configured ranks and of the restored runtime ones; marks their
        rows event-fed in the Scheduler."""
        out = []
        for w in self.config.workers:
            rows = {r: self.ledger.row_of(WorkerKey(w.worker_id, r)) for r in range(w.dp_size)}
            out += sources_for_worker(w, {r: row for r, row in rows.items() if row is not None})
        out += [rec.source(row) for row, rec in sorted(self.runtime.items()) if rec.kv_events_endpoint]
        for src in out:
            self.scheduler.set_event_fed(src.row, True)
        return out

    def attach(self, kv_events: KvEventSubscriber, hash_check: HashCheck | None) -> None:
        """The subscriber whose sources `add` / `remove` change, and the hash check whose rows they forget."""
        self.kv_events, self.hash_check = kv_events, hash_check

    # ------------------------------------------------------------------ add / remove
    def add(self, req: p.AddWorker, now_us: int) -> tuple[p.AdminReply, Outcomes]:
        """Register a rank (or restore the URL / KV events of a rank a restarted daemon re-adopted),
        subscribe to its KV events, keep its record. Returns (reply, outcomes of the cleanup pass);
        a request that cannot be applied is answered an `AdminError` and changes nothing."""
        s, key = self.scheduler, WorkerKey(req.worker_id, req.dp_rank)
        if req.kv_events_endpoint and self.kv_events is None:
            return admin_error(p.ErrorCode.INVALID, "this daemon has no KV-event subscriber"), []
        problem = _add_worker_problem(req)
        if problem:  # checked before anything is registered: a corrected retry is not "already registered"
            return admin_error(p.ErrorCode.INVALID, problem), []
        row = self.ledger.row_of(key)
        if row is not None and self._same_capacities(row, req) and self._kept_matches(row, req):
            return p.OkReply(message=f"{key} already registered with these settings"), []
        restoring = self._restored_bare(req, row)
        if not restoring:
            try:
                s.add_worker(key, req.total_kv_blocks, req.max_num_batched_tokens)
            except ValueError as exc:
                return admin_error(p.ErrorCode.INVALID, str(exc)), []
        row = self.ledger.row_of(key)
        assert row is not None
        rec = self._record(req, row)
        if req.kv_events_endpoint:
            assert self.kv_events is not None
            self.kv_events.remove_source(row)  # a row reused after RemoveWorker starts from a clean stream
            try:
                self.kv_events.add_source(rec.source(row))
            except zmq.ZMQError as exc:  # e.g. an ipc path longer than the OS allows: undo the add
                if not restoring:
                    s.remove_worker(req.worker_id, req.dp_rank, now_us)
                return admin_error(p.ErrorCode.INVALID, f"kv_events_endpoint {req.kv_events_endpoint!r}: {exc}"), []
            s.set_event_fed(row, True)
        if req.url:
            self.urls[req.worker_id] = req.url
        self._remember(row, rec)
        done = "restored url / KV events of" if restoring else "added"
        log.info("worker %s worker=%d:%d kv_events=%s", done, req.worker_id, req.dp_rank, req.kv_events_endpoint or "-")
        return p.OkReply(message=f"{done} {req.worker_id}:{req.dp_rank}"), s.drain_cleanup(now_us)

    def remove(self, req: p.RemoveWorker, now_us: int) -> tuple[p.AdminReply, Outcomes]:
        """Unregister a worker (every rank when `dp_rank` is None): its leases are revoked, its KV-event
        sources, kept records and hash verdicts dropped, its URL forgotten with its last rank."""
        s = self.scheduler
        try:
            rows = s.rows_of(req.worker_id, req.dp_rank)  # the rows RemoveWorker frees
            outcomes = s.remove_worker(req.worker_id, req.dp_rank, now_us)
        except KeyError:
            return admin_error(p.ErrorCode.NOT_FOUND, f"unknown worker {worker_name(req)}"), []
        for row in rows:
            if self.kv_index is not None:
                self.kv_index.clear_meta(row)
            if self.kv_events is not None:
                self.kv_events.remove_source(row)
            if self.hash_check is not None:
                self.hash_check.bad_rows.pop(row, None)
        if s.ranks_of(req.worker_id) == 0:
            self.urls.pop(req.worker_id, None)
        log.info("worker removed worker=%s", worker_name(req))
        return p.OkReply(message=f"removed {worker_name(req)}"), outcomes

    def rows(self) -> list[p.WorkerRow]:
        """`Scheduler.workers()`, with `hash_mismatch` set on the rows whose latest KV-event hash check failed."""
        rows = self.scheduler.workers()
        bad = self.hash_check.bad_rows if self.hash_check is not None else None
        if not bad:
            return rows
        keys = set()
        for row in list(bad):
            try:
                keys.add(tuple(self.ledger.key_of(row)))
            except (KeyError, IndexError, ValueError):
                continue
        return [msgspec.structs.replace(w, hash_mismatch=True) if (w.worker_id, w.dp_rank) in keys else w for w in rows]

    # ------------------------------------------------------------------ kept records
    def _record(self, req: p.AddWorker, row: int) -> RuntimeWorker:
        """The record kept for `req` on ledger row `row` (at the row's current generation)."""
        return RuntimeWorker(
            req.worker_id,
            req.dp_rank,
            int(self.ledger.arrays.w_generation[row]),
            req.url,
            req.kv_events_endpoint,
            req.kv_replay_endpoint,
            req.kv_events_topic,
            req.kv_events_stale_after_s,
        )

    def _remember(self, row: int, rec: RuntimeWorker) -> None:
        """Keep `rec` for row `row`. A record too long for the row is logged and not kept (the repeated
        `add-worker` still restores it)."""
        if self.kv_index is None:
            return
        try:
            self.kv_index.store_meta(row, _enc.encode(rec))
        except ValueError as exc:
            log.warning("runtime worker %d:%d not kept for restarts: %s", rec.worker_id, rec.dp_rank, exc)

    def _kept(self, row: int) -> RuntimeWorker | None:
        raw = None if self.kv_index is None else self.kv_index.load_meta(row)
        if raw is None:
            return None
        try:
            return _dec.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return None

    def _kept_matches(self, row: int, req: p.AddWorker) -> bool:
        """True when row `row` holds a record equal to what `req` would write (a repeated `add-worker`)."""
        kept = self._kept(row)
        return kept is not None and kept == self._record(req, row)

    def _restored(self) -> dict[int, RuntimeWorker]:
        """Row -> record of every registered row whose record matches its current identity and whose
        worker id the config does not declare. Unreadable or mismatched records are cleared."""
        assert self.kv_index is not None
        a, out = self.ledger.arrays, {}
        config_ids = {w.worker_id for w in self.config.workers}
        for row in range(self.kv_index.max_workers):
            if self.kv_index.load_meta(row) is None:
                continue
            rec = self._kept(row)
            same = (
                rec is not None
                and bool(a.w_present[row])
                and (int(a.w_worker_id[row]), int(a.w_dp_rank[row]), int(a.w_generation[row]))
                == (rec.worker_id, rec.dp_rank, rec.generation)
            )
            if rec is None or not same or rec.worker_id in config_ids:
                self.kv_index.clear_meta(row)
                continue
            out[row] = rec
        return out

    def _restored_bare(self, req: p.AddWorker, row: int | None) -> bool:
        """True when `req` re-adds a rank that a restarted daemon re-adopted from shared memory with the
        same capacities but without what lives only in the old process: its `url` and its KV-event
        subscription (a rank added at runtime, not listed in the config). Re-running the same
        `add-worker` then restores them instead of answering "already registered"."""
        if row is None or not (req.url or req.kv_events_endpoint) or not self._same_capacities(row, req):
            return False
        has_stream = self.kv_events is not None and any(st.src.row == row for st in self.kv_events.streams)
        return req.worker_id not in self.urls and not has_stream

    def _same_capacities(self, row: int, req: p.AddWorker) -> bool:
        a = self.ledger.arrays
        return (int(a.w_total_kv_blocks[row]), int(a.w_max_batched_tokens[row])) == (
            req.total_kv_blocks,
            req.max_num_batched_tokens,
        )


def _add_worker_problem(req: p.AddWorker) -> str | None:
    """What is wrong with an AddWorker's endpoints or URL (the rules of `[[workers]]`), or None."""
    for key in ("kv_events_endpoint", "kv_replay_endpoint"):
        value = getattr(req, key)
        problem = endpoint_problem(value) if value else None
        if problem:
            return f"{key} {value!r}: {problem}"
    problem = url_problem(req.url) if req.url else None
    return f"url {req.url!r}: {problem}" if problem else None
