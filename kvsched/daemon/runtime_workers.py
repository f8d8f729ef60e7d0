"""Workers added at runtime (`kvsched add-worker`) keep their URL and KV-event endpoints across a crash.

The ledger already keeps a runtime-added rank's row (capacities, bookings) in shared memory, so a
restarted daemon re-adopts it; what lived only in the old process — the base URL sent in
`Admitted.url` and the KV-event subscription — is written here into the row's record of the
KV-index segment (`KvIndexSegment.store_meta`) and read back at start. A record names the identity
of the row it was written for (worker id, rank, the ledger's `w_generation`); a record whose row now
holds another worker, or that a `[[workers]]` entry of the config covers, is ignored (the config
wins). docs/KV_EVENTS.md "Restarts keep the cache view" and docs/PROTOCOL.md `add_worker`.
"""

from __future__ import annotations

import logging

import msgspec

from .. import protocol as p

log = logging.getLogger(__name__)


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


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(RuntimeWorker)


def _record(req: p.AddWorker, generation: int) -> RuntimeWorker:
    """The record kept for `req` on a row whose ledger generation is `generation`."""
    return RuntimeWorker(
        req.worker_id,
        req.dp_rank,
        generation,
        req.url,
        req.kv_events_endpoint,
        req.kv_replay_endpoint,
        req.kv_events_topic,
        req.kv_events_stale_after_s,
    )


def remember(seg, w_generation, row: int, req: p.AddWorker) -> None:
    """Keep `req`'s URL and KV-event endpoints for ledger row `row` (no-op without a segment). A
    record too long for the row is logged and not kept (the repeated `add-worker` still restores it)."""
    if seg is None:
        return
    rec = _record(req, int(w_generation[row]))
    try:
        seg.store_meta(row, _enc.encode(rec))
    except ValueError as exc:
        log.warning("runtime worker %d:%d not kept for restarts: %s", req.worker_id, req.dp_rank, exc)


def forget(seg, row: int) -> None:
    """Drop row `row`'s record (its worker was removed)."""
    if seg is not None:
        seg.clear_meta(row)


def restored(seg, ledger_arrays, config_worker_ids: set[int]) -> dict[int, RuntimeWorker]:
    """Row -> record of every registered row whose record matches its current identity and whose
    worker id the config does not declare. Unreadable or mismatched records are cleared.

    Args:
        seg: the KV-index segment kept from the previous daemon.
        ledger_arrays: `LedgerArrays` (w_present, w_worker_id, w_dp_rank, w_generation).
        config_worker_ids: worker ids of `[[workers]]`.
    """
    a, out = ledger_arrays, {}
    for row in range(seg.max_workers):
        raw = seg.load_meta(row)
        if raw is None:
            continue
        try:
            rec = _dec.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError):
            rec = None
        same = (
            rec is not None
            and bool(a.w_present[row])
            and (int(a.w_worker_id[row]), int(a.w_dp_rank[row]), int(a.w_generation[row]))
            == (rec.worker_id, rec.dp_rank, rec.generation)
        )
        if not same or rec.worker_id in config_worker_ids:
            seg.clear_meta(row)
            continue
        out[row] = rec
    return out


def kept_matches(seg, w_generation, row: int, req: p.AddWorker) -> bool:
    """True when row `row` holds a record equal to what `req` would write (a repeated `add-worker`)."""
    raw = None if seg is None else seg.load_meta(row)
    if raw is None:
        return False
    want = _record(req, int(w_generation[row]))
    try:
        return _dec.decode(raw) == want
    except (msgspec.DecodeError, msgspec.ValidationError):
        return False
