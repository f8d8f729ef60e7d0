"""Per-worker-row KV-event stream state, applied to the overlap indexes (pure; docs/DESIGN.md §6).

One `KvEventApplier` serves every worker row. The I/O layer (`daemon/kv_events.py`) hands it each
live batch (`on_live`), each replayed batch (`on_replay`) and each replay end marker
(`on_replay_end`); the applier says when a replay must be requested and from which seq.

Rules (per row):

* **In order**: live seq N after last seq L. N == L + 1: apply. N > L + 1: seqs [L+1, N) are
  *missing* (a gap; counted), N is applied at once and a replay from L+1 is requested (one replay in
  flight per row; gaps found meanwhile are asked for when it ends).
* **Restart**: N <= L means the engine's publisher restarted (its seq starts again at 0): both
  indexes forget the row, the state is reset, then N is handled as the first batch.
* **First batch** (at start, or after a restart) with N > 0: seqs [0, N) are missing and a replay from
  0 is requested (`replay_on_first`), so a daemon that starts after its engines learns their caches
  from the publisher's ring buffer.
* **Replay**: a replayed batch is applied only if its seq is still missing (duplicates, and seqs
  the live stream will deliver, are skipped). While anything is missing, every live event leaves a
  *tombstone* `(key, tier) -> (seq, stored?)` and a live `AllBlocksCleared` records its seq; a
  replayed event older than the tombstone of a key (or than that clear) is skipped for that key, so
  a replay **never resurrects a block a newer live event removed** (nor removes one a newer live
  event stored). A replayed `AllBlocksCleared` clears the row, then re-applies the newer live stores.
* **End of replay**: seqs still missing that existed when the request was sent are lost (the
  publisher's buffer no longer has them; counted); tombstones are dropped once nothing is missing.
* **Restored row** (`restore`: a restarted daemon kept the row's entries and its last applied seq L
  in shared memory): a *catch-up* replay from L+1 is requested at once. Until its end marker, a
  replayed batch newer than everything applied is applied like a live one (and advances the row),
  so the publisher's ring buffer brings the row up to date without waiting for the engine to
  publish; a live batch that such a replay already applied is a duplicate, not a restart. A live
  seq <= L still means the engine restarted (row cleared). If the ring buffer no longer holds L+1,
  the seqs before its oldest are lost (counted).
* **Reconnect** (`reconnected`: a handshake with the row's publisher completed, the first one
  included): batches published while nobody listened never reach the SUB socket, and an idle engine
  publishes no later batch that would reveal the gap, so a catch-up replay is requested at once,
  like a restored row's. A row that knows seq L asks from L itself (a *probe*): a publisher that
  still holds L answers with it; one that answers with nothing at all no longer holds L, so it
  restarted while we were away: the row is forgotten (counted as a restart). A row that knows
  nothing asks from 0 (when `replay_on_first`).
* **Unfilled** (`unfilled`, the gap half of the staleness rule in `kvevents/staleness.py`): the row
  has missing seqs, or seqs replay gave up on (lost), that its index should have seen. A first
  batch's [0, N) is the publisher's history from before the daemon listened, not a gap of the
  stream: losing the part the ring buffer no longer holds leaves the index knowing less, not
  wrong. Seqs before a live `AllBlocksCleared` no longer matter either. Lost seqs stay unfilled
  until the row's index is rebuilt from a known state (that clear, or an engine restart).
* **Persisted seq**: with a `seq_store`, the row's *applied-through* seq (every batch <= it applied:
  the seq before the oldest missing one, else the last seq) is written there after every change, so
  a daemon restarted from it replays nothing twice that matters and misses nothing it can still get.

Tiers: `Stored`/`Removed` with medium GPU (or no medium) go to the `device` index; any other medium
(CPU, disk, ...) to the `offload` index (ignored when None). `AllBlocksCleared` clears both.
Entries are permanent (`ttl_us=None`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from typing import Protocol

import numpy as np
import numpy.typing as npt

from ..shm.overlap import OverlapIndex
from .format import Cleared, DecodedBatch, KvEventFormatError, Removed, Stored, decode_batch


class SeqStore(Protocol):
    """Where each worker row's applied-through seq persists (e.g. `kvsched.shm.kv_index.KvIndexSegment`)."""

    @property
    def last_seq(self) -> npt.NDArray[np.int64]:
        """int64[rows]: the row's applied-through seq, -1 = none."""

    @property
    def present(self) -> npt.NDArray[np.uint8]:
        """uint8[rows]: zeroed when the row is reset."""


@dataclass(slots=True)
class KvEventCounters:
    """Monotonic counters for metrics (`kvsched_kv_events_*`)."""

    applied: int = 0  # events applied from the live stream
    replayed: int = 0  # events applied from replay replies
    unknown_types: int = 0  # events skipped: unknown tag
    unknown_fields: int = 0  # fields skipped: unknown map key / extra array position
    malformed_events: int = 0  # events skipped: a known field had the wrong type
    malformed_batches: int = 0  # payloads that were not an event batch (seq still consumed)
    gaps: int = 0  # seq gaps seen on live streams
    restarts: int = 0  # seq decreases (engine restarted): row cleared
    replay_requests: int = 0  # replay requests asked for
    replay_lost: int = 0  # missing batches the replay could not supply
    replay_duplicates: int = 0  # replayed batches skipped (not missing)
    resurrect_skipped: int = 0  # replayed block updates skipped: a newer live event won
    tombstone_overflows: int = 0  # replays abandoned because too many tombstones piled up

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class LiveResult:
    """What `on_live` did."""

    applied: int  # events applied from this batch
    replay_from: int | None  # send a replay request for seqs >= this now (None = nothing to ask)
    restarted: bool  # the seq went backwards: the row was cleared first (drop any replay in flight)
    first: bool  # first batch on this row since start, reset or restart


@dataclass(slots=True)
class RowStream:
    """Stream state of one worker row. Invariant: `missing` is sorted, disjoint, every hi <= last_seq."""

    last_seq: int = -1  # highest live seq applied; -1 = none yet
    missing: list[list[int]] = field(default_factory=list)  # [lo, hi) seq ranges not applied
    replay_from: int | None = None  # start seq of the replay request in flight
    replay_sent_at: int = -1  # last_seq when that request was sent
    tombs: dict[tuple[int, bool], tuple[int, bool]] = field(default_factory=dict)  # (key, device) -> (seq, stored)
    cleared_seq: int = -1  # seq of the newest live AllBlocksCleared while something is missing
    catch_up: bool = False  # a catch-up replay (restored row) is not finished: newer replayed seqs apply
    restored_seq: int = -1  # L of `restore`: a live seq <= L is an engine restart
    ahead_seq: int = -1  # highest seq applied from a catch-up replay before the live stream delivered it
    live_seq: int = -1  # highest seq received live since start / restore
    settled_below: int = 0  # seqs below this no longer matter (first-contact history, before a live clear)
    probe_seq: int = -1  # a reconnect replay asked from this known seq and has not been answered yet
    lost: bool = False  # seqs >= settled_below were given up: the index may miss stores and removals

    def applied_through(self) -> int:
        """Every batch with seq <= this was applied (-1 = nothing known)."""
        return self.missing[0][0] - 1 if self.missing else self.last_seq

    def missing_count(self) -> int:
        return sum(hi - lo for lo, hi in self.missing)

    def matters(self, ranges: Iterable[Sequence[int]]) -> bool:
        """True if any [lo, hi) seq range in `ranges` reaches above `settled_below`."""
        return any(hi > self.settled_below for _lo, hi in ranges)

    def take_missing(self, seq: int) -> bool:
        """Mark `seq` as no longer missing; False if it was not missing."""
        for i, (lo, hi) in enumerate(self.missing):
            if lo <= seq < hi:
                parts = [r for r in ([lo, seq], [seq + 1, hi]) if r[0] < r[1]]
                self.missing[i : i + 1] = parts
                return True
            if seq < lo:
                break
        return False


class KvEventApplier:
    """Applies KV-event batches of many worker rows to a device and an offload `OverlapIndex`.

    Args:
        device: index of blocks in device (GPU) memory, KV-event entries (permanent).
        offload: index of blocks in other tiers (CPU, disk, ...), or None to ignore those events.
        replay_on_first: ask for seqs [0, N) when a row's first batch has seq N > 0.
        max_tombstones: per row; past it the replay in flight is abandoned (missing seqs lost).
        store: where each row's applied-through seq persists, or None: an object with `last_seq`
            (int64[rows], -1 = none) and `present` (uint8[rows], zeroed when the row is reset) arrays,
            e.g. `kvsched.shm.kv_index.KvIndexSegment`.
    """

    def __init__(
        self,
        device: OverlapIndex,
        offload: OverlapIndex | None = None,
        *,
        replay_on_first: bool = True,
        max_tombstones: int = 1 << 20,
        store: SeqStore | None = None,
    ) -> None:
        self.device = device
        self.offload = offload
        self.replay_on_first = replay_on_first
        self.max_tombstones = max_tombstones
        self.store = store
        self.counters = KvEventCounters()
        self._rows: dict[int, RowStream] = {}
        # Observer of every decoded live batch, `(row, DecodedBatch, now_us)`, e.g. the hash check.
        self.on_batch = None

    def _persist(self, row: int, st: RowStream) -> None:
        if self.store is not None:
            self.store.last_seq[row] = st.applied_through()

    def restore(self, row: int, last_seq: int) -> int | None:
        """Adopt a row whose entries survived a restart, all batches <= `last_seq` applied.

        Returns:
            the seq to request a catch-up replay from now (last_seq + 1), or None when last_seq < 0
            (nothing known: the row starts like a new one).
        """
        if last_seq < 0:
            return None
        st = self._rows[row] = RowStream(last_seq=last_seq, catch_up=True, restored_seq=last_seq)
        self._persist(row, st)
        return self._request(st)

    def reconnected(self, row: int) -> int | None:
        """The row's publisher completed a handshake (module docstring, "Reconnect").

        Returns:
            the seq to request a catch-up replay from now, or None: a replay is owed or in flight
            already, or the row knows nothing and `replay_on_first` is off.
        """
        st = self.stream(row)
        if st.replay_from is not None or st.missing or (st.last_seq < 0 and not self.replay_on_first):
            return None
        st.catch_up = True
        st.restored_seq = st.last_seq
        st.probe_seq = st.last_seq
        return self._request(st)

    def catching_up(self, row: int) -> bool:
        """True while the row's catch-up replay (after `restore` or `reconnected`) has not ended."""
        st = self._rows.get(row)
        return st is not None and st.catch_up

    # ------------------------------------------------------------------ queries
    def stream(self, row: int) -> RowStream:
        """The row's stream state (created empty on first use)."""
        st = self._rows.get(row)
        if st is None:
            st = self._rows[row] = RowStream()
        return st

    def replay_pending(self, row: int) -> bool:
        st = self._rows.get(row)
        return st is not None and st.replay_from is not None

    def unfilled(self, row: int) -> bool:
        """True while the row misses seqs of its stream that replay has not restored, or has lost
        some for good (module docstring, "Unfilled"); the first batch's history does not count."""
        st = self._rows.get(row)
        return st is not None and (st.lost or st.matters(st.missing))

    # ------------------------------------------------------------------ live stream
    def on_live(self, row: int, seq: int, payload: bytes, now_us: int) -> LiveResult:
        """Apply one live batch `seq` of `row`; say whether to request a replay."""
        st = self.stream(row)
        if st.live_seq < seq <= st.ahead_seq and seq > st.restored_seq:  # a catch-up replay applied it
            st.live_seq = seq
            self.counters.replay_duplicates += 1
            return LiveResult(0, None, False, False)
        restarted = st.last_seq >= 0 and seq <= st.last_seq
        if restarted:
            self.counters.restarts += 1
            self.reset_row(row)
            st = self.stream(row)
        first = st.last_seq < 0
        if first:
            st.settled_below = seq  # the publisher's history, not a gap of the stream
            if seq > 0 and self.replay_on_first:
                st.missing.append([0, seq])
        elif seq > st.last_seq + 1:
            self.counters.gaps += 1
            st.missing.append([st.last_seq + 1, seq])
        batch = self._decode(payload)
        applied = 0
        if batch is not None:
            if self.on_batch is not None:
                self.on_batch(row, batch, now_us)
            applied = self._apply_live(row, st, seq, batch, now_us)
            self.counters.applied += applied
        st.last_seq = seq
        st.live_seq = seq
        if seq > st.ahead_seq:
            st.ahead_seq = -1
        replay_from = None
        if st.missing and st.replay_from is None:
            replay_from = self._request(st)
        self._persist(row, st)
        return LiveResult(applied, replay_from, restarted, first)

    def _decode(self, payload: bytes) -> DecodedBatch | None:
        try:
            batch = decode_batch(payload)
        except KvEventFormatError:
            self.counters.malformed_batches += 1
            return None
        self.counters.unknown_types += batch.unknown_types
        self.counters.unknown_fields += batch.unknown_fields
        self.counters.malformed_events += batch.malformed
        return batch

    def _request(self, st: RowStream) -> int:
        if st.probe_seq >= 0:  # a reconnect's probe: from the seq the row knows
            st.replay_from = st.probe_seq
        else:  # the latter: catch-up only
            st.replay_from = st.missing[0][0] if st.missing else st.last_seq + 1
        st.replay_sent_at = st.last_seq
        self.counters.replay_requests += 1
        return st.replay_from

    def _index(self, device: bool) -> OverlapIndex | None:
        return self.device if device else self.offload

    def _apply_live(self, row: int, st: RowStream, seq: int, batch: DecodedBatch, now_us: int) -> int:
        record = bool(st.missing)
        n = 0
        for ev in batch.events:
            if isinstance(ev, Cleared):
                self._clear(row)
                if record:
                    st.cleared_seq = seq
                st.settled_below, st.lost = seq, False  # the index is exact again from here
                n += 1
                continue
            idx = self._index(ev.device)
            if idx is None:
                continue
            stored = isinstance(ev, Stored)
            if stored:
                idx.insert(ev.keys, row, now_us, None)
            else:
                idx.remove(ev.keys, row)
            if record:
                dev = ev.device
                for k in ev.keys.tolist():
                    st.tombs[(k, dev)] = (seq, stored)
            n += 1
        if record and len(st.tombs) > self.max_tombstones:
            self.counters.tombstone_overflows += 1
            self._give_up(st)
        return n

    # ------------------------------------------------------------------ replay
    def on_replay(self, row: int, seq: int, payload: bytes, now_us: int) -> int:
        """Apply one replayed batch if `seq` is still missing. Returns events applied."""
        st = self._rows.get(row)
        if st is not None and 0 <= st.probe_seq <= seq:
            st.probe_seq = -1  # the publisher still holds the seq we know: the same process
        if st is not None and st.catch_up and seq > st.last_seq:
            return self._catch_up(row, st, seq, payload, now_us)
        if st is None or not st.take_missing(seq):
            self.counters.replay_duplicates += 1
            return 0
        batch = self._decode(payload)
        if batch is None:
            return 0
        n = 0
        for ev in batch.events:
            if seq < st.cleared_seq:  # a newer live clear wins over everything before it
                self.counters.resurrect_skipped += 1
                continue
            if isinstance(ev, Cleared):
                self._replayed_clear(row, st, seq, now_us)
                n += 1
                continue
            idx = self._index(ev.device)
            if idx is None:
                continue
            keys = self._not_overridden(st, ev, seq)
            if keys.shape[0]:
                if isinstance(ev, Stored):
                    idx.insert(keys, row, now_us, None)
                else:
                    idx.remove(keys, row)
            n += 1
        self.counters.replayed += n
        self._persist(row, st)
        return n

    def _catch_up(self, row: int, st: RowStream, seq: int, payload: bytes, now_us: int) -> int:
        """A catch-up replay's batch newer than the row: applied as the live stream would have."""
        if st.last_seq < 0:  # a first contact through replay: what came before is history
            st.settled_below = seq
        if seq > st.last_seq + 1:  # the ring buffer no longer holds these
            self.counters.replay_lost += seq - st.last_seq - 1
            st.lost = st.lost or st.matters([(st.last_seq + 1, seq)])
        batch = self._decode(payload)
        n = 0 if batch is None else self._apply_live(row, st, seq, batch, now_us)
        st.last_seq = seq
        st.ahead_seq = seq
        self.counters.replayed += n
        self._persist(row, st)
        return n

    def _not_overridden(self, st: RowStream, ev: Stored | Removed, seq: int) -> np.ndarray:
        if not st.tombs:
            return ev.keys
        dev = ev.device
        keep = [k for k in ev.keys.tolist() if st.tombs.get((k, dev), (-1, False))[0] < seq]
        self.counters.resurrect_skipped += ev.keys.shape[0] - len(keep)
        return np.array(keep, dtype=np.uint64)

    def _replayed_clear(self, row: int, st: RowStream, seq: int, now_us: int) -> None:
        self._clear(row)
        for dev in (True, False):
            idx = self._index(dev)
            if idx is None:
                continue
            keys = [k for (k, d), (s, stored) in st.tombs.items() if d == dev and stored and s > seq]
            if keys:
                idx.insert(np.array(keys, dtype=np.uint64), row, now_us, None)

    def on_replay_end(self, row: int) -> int | None:
        """The end marker arrived. Returns the seq to request next (gaps found meanwhile) or None."""
        st = self._rows.get(row)
        if st is None or st.replay_from is None:
            return None
        if st.probe_seq >= 0:  # nothing from the seq we know on: the publisher restarted
            self.counters.restarts += 1
            self.reset_row(row)
            return None
        st.catch_up = False
        old = [r for r in st.missing if r[0] <= st.replay_sent_at]
        self.counters.replay_lost += sum(hi - lo for lo, hi in old)
        st.lost = st.lost or st.matters(old)
        st.missing = [r for r in st.missing if r[0] > st.replay_sent_at]
        st.replay_from = None
        if st.missing:
            nxt = self._request(st)
            self._persist(row, st)
            return nxt
        self._give_up(st)
        self._persist(row, st)
        return None

    def replay_failed(self, row: int, retry: bool) -> int | None:
        """The replay in flight got no end marker (timeout, socket error). Returns the seq to ask again
        when `retry`, else abandons: whatever is missing is lost."""
        st = self._rows.get(row)
        if st is None or st.replay_from is None:
            return None
        if retry and (st.missing or st.catch_up):
            return self._request(st)
        st.catch_up = False
        st.probe_seq = -1
        self._give_up(st)
        self._persist(row, st)
        return None

    def _give_up(self, st: RowStream) -> None:
        self.counters.replay_lost += st.missing_count()
        st.lost = st.lost or st.matters(st.missing)
        st.missing.clear()
        st.replay_from = None
        st.tombs.clear()
        st.cleared_seq = -1

    # ------------------------------------------------------------------ rows
    def _clear(self, row: int) -> None:
        self.device.clear_row(row)
        if self.offload is not None:
            self.offload.clear_row(row)

    def reset_row(self, row: int) -> None:
        """Forget the row: both indexes and its stream state (restart, worker removed)."""
        self._clear(row)
        self._rows.pop(row, None)
        if self.store is not None:
            self.store.last_seq[row] = -1
            self.store.present[row] = 0
