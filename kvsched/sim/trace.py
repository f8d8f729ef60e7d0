"""Request traces for replay: Mooncake JSON Lines and Azure LLM inference CSV → one `Trace`.

Mooncake (`conversation_trace.jsonl`, FAST'25 release): one JSON object per line with `timestamp`
(ms since the trace start), `input_length`, `output_length` and `hash_ids` (one id per 512-token
chained prefix block; two requests sharing leading ids share that KV prefix). Ids are integers in
0..2^64-1 (u64; a line with another value is refused naming `path:line`) and are mapped to u64
block hashes with SplitMix64 (a bijection on u64, so distinct ids stay distinct) — the daemon's and
the engine's hash tables then see well-spread, non-zero keys, as with real chained hashes.

Azure (`AzureLLMInferenceTrace_*.csv`): header `TIMESTAMP,ContextTokens,GeneratedTokens`, wall-clock
timestamps; no prefix information, so every request has an empty hash list.
"""

from __future__ import annotations

import csv
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import msgspec
import numpy as np

from ..shm.mix import splitmix64_array

MOONCAKE_BLOCK_SIZE = 512  # tokens per `hash_ids` entry in the Mooncake traces
AZURE_BLOCK_SIZE = 16  # no hashes in the Azure traces; vLLM's default block size
U64_MAX = (1 << 64) - 1


# Token counts a trace line may give (0 is replayed as 1). Far above any model's context; above it the
# replay's derived `max_blocks_per_request` would exceed the daemon's own bound.
MAX_TRACE_TOKENS = 1 << 24
TraceTokens = Annotated[int, msgspec.Meta(ge=0, le=MAX_TRACE_TOKENS)]


class _MooncakeRow(msgspec.Struct):
    timestamp: float  # ms since the start of the trace
    input_length: TraceTokens
    output_length: TraceTokens
    hash_ids: list[int] = []  # each in 0..U64_MAX (checked by load_mooncake)


def splitmix64(ids: np.ndarray) -> np.ndarray:
    """SplitMix64 output for state `ids` (uint64 → uint64, a bijection): trace block id → block hash."""
    return splitmix64_array(ids)


@dataclass(slots=True)
class Trace:
    """A request trace as struct-of-arrays (row i = request i, arrival order).

    Attributes:
        arrival_us: int64[n], arrival time relative to the first request (µs, non-decreasing).
        isl: int64[n], prompt tokens (>= 1).
        osl: int64[n], output tokens (>= 1).
        hash_offsets: int64[n + 1]; request i's hashes are hashes[hash_offsets[i]:hash_offsets[i+1]].
        hashes: uint64[total], chained prefix-block hashes.
        block_size: tokens per hashed block (512 for Mooncake).
        source: file the trace came from.
        first_row: row number (0-based, data rows) of request 0 in the source file.
    """

    arrival_us: np.ndarray
    isl: np.ndarray
    osl: np.ndarray
    hash_offsets: np.ndarray
    hashes: np.ndarray
    block_size: int
    source: str = ""
    first_row: int = 0

    def __len__(self) -> int:
        return int(self.arrival_us.shape[0])

    def hashes_of(self, i: int) -> np.ndarray:
        """uint64[k] block hashes of request i (a view)."""
        return self.hashes[self.hash_offsets[i] : self.hash_offsets[i + 1]]

    def head(self, limit: int | None) -> Trace:
        """The first `limit` requests (all when None)."""
        if limit is None or limit >= len(self):
            return self
        end = int(self.hash_offsets[limit])
        return Trace(
            self.arrival_us[:limit].copy(),
            self.isl[:limit].copy(),
            self.osl[:limit].copy(),
            self.hash_offsets[: limit + 1].copy(),
            self.hashes[:end].copy(),
            self.block_size,
            self.source,
            self.first_row,
        )

    def scaled_arrivals_us(self, scale: float) -> np.ndarray:
        """int64[n] arrivals with the timeline compressed by `scale` (> 1 = more load)."""
        if scale <= 0:
            raise ValueError("scale must be > 0")
        return (self.arrival_us / scale).astype(np.int64)

    def infinite_cache_hit_tokens(self) -> int:
        """Prompt tokens a single infinite prefix cache would serve (upper bound of any fleet)."""
        seen: set[int] = set()
        total = 0
        bs = self.block_size
        for i in range(len(self)):
            hs = self.hashes_of(i).tolist()
            total += min(_leading_hits(hs, seen) * bs, int(self.isl[i]) - 1)
            seen.update(hs)
        return total

    def fleet_lru_hit_tokens(self, capacity_blocks: int) -> int:
        """Prompt tokens one LRU prefix cache of `capacity_blocks` blocks would serve, seeing every request.

        The achievable reference for a fleet whose caches add up to `capacity_blocks` (a router that
        partitions the working set well can beat it slightly; the true bound would be Belady's optimal
        eviction on that one cache). Per request: the leading blocks present are hits (counted like
        `infinite_cache_hit_tokens`); then every block of the request becomes most recently used, and
        least recently used blocks are evicted beyond the capacity.
        """
        cache: OrderedDict[int, None] = OrderedDict()
        total = 0
        bs = self.block_size
        for i in range(len(self)):
            hs = self.hashes_of(i).tolist()
            total += min(_leading_hits(hs, cache) * bs, int(self.isl[i]) - 1)
            for h in hs:
                cache[h] = None
                cache.move_to_end(h)
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
        return total


def _tokens(text: str, path, line: int, column: str) -> int:
    """A token count of an Azure CSV cell; ValueError naming `path:line` and the column otherwise."""
    try:
        n = int(text)
    except ValueError:
        raise ValueError(f"{path}:{line}: {column} {text!r} is not an integer") from None
    if not 0 <= n <= MAX_TRACE_TOKENS:
        raise ValueError(f"{path}:{line}: {column} {n} is out of range (0..{MAX_TRACE_TOKENS:,} tokens)")
    return n


def load_trace(path: str | Path, limit: int | None = None) -> Trace:
    """Load a Mooncake `.jsonl` or an Azure `.csv` trace (by extension); first `limit` rows."""
    p = Path(path)
    if p.suffix == ".jsonl":
        return load_mooncake(p, limit)
    if p.suffix == ".csv":
        return load_azure(p, limit)
    raise ValueError(f"{p}: unknown trace format (expected .jsonl Mooncake or .csv Azure)")


def load_mooncake(path: str | Path, limit: int | None = None) -> Trace:
    """Mooncake JSON Lines → `Trace` (block_size 512, hashes = splitmix64(hash_ids)).

    Raises:
        ValueError: a line that is not JSON, or whose fields have the wrong type or range (hash ids
            must be in 0..2^64-1); the message starts with `path:line`.
    """
    decoder = msgspec.json.Decoder(_MooncakeRow)
    rows: list[_MooncakeRow] = []
    with open(path, "rb") as fh:
        for n, line in enumerate(fh):
            if limit is not None and len(rows) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            try:
                row = decoder.decode(line)
            except msgspec.DecodeError as exc:  # not JSON, or a field of the wrong type (ValidationError)
                raise ValueError(f"{path}:{n + 1}: {exc}") from None
            if row.hash_ids and (min(row.hash_ids) < 0 or max(row.hash_ids) > U64_MAX):
                bad = next(h for h in row.hash_ids if not 0 <= h <= U64_MAX)
                raise ValueError(
                    f"{path}:{n + 1}: hash_ids value {bad} is out of range (ids are integers "
                    f"in 0..2^64-1 = 0..{U64_MAX})"
                )
            rows.append(row)
    counts = np.fromiter((len(r.hash_ids) for r in rows), dtype=np.int64, count=len(rows))
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    ids = np.fromiter((h for r in rows for h in r.hash_ids), dtype=np.uint64, count=int(offsets[-1]))
    ts = np.array([r.timestamp for r in rows], dtype=np.float64)
    return Trace(
        arrival_us=_relative_us(ts * 1000.0),
        isl=np.maximum(1, np.array([r.input_length for r in rows], dtype=np.int64)),
        osl=np.maximum(1, np.array([r.output_length for r in rows], dtype=np.int64)),
        hash_offsets=offsets,
        hashes=splitmix64(ids),
        block_size=MOONCAKE_BLOCK_SIZE,
        source=str(path),
    )


def load_azure(path: str | Path, limit: int | None = None) -> Trace:
    """Azure LLM inference CSV → `Trace` (no hashes; block_size 16)."""
    stamps: list[str] = []
    isl: list[int] = []
    osl: list[int] = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing columns {sorted(missing)}")
        for row in reader:
            if limit is not None and len(stamps) >= limit:
                break
            stamps.append(row["TIMESTAMP"].strip())
            isl.append(_tokens(row["ContextTokens"], path, reader.line_num, "ContextTokens"))
            osl.append(_tokens(row["GeneratedTokens"], path, reader.line_num, "GeneratedTokens"))
    t = np.array(stamps, dtype="datetime64[us]").astype(np.int64).astype(np.float64)
    order = np.argsort(t, kind="stable")
    n = len(stamps)
    return Trace(
        arrival_us=_relative_us(t[order]),
        isl=np.maximum(1, np.array(isl, dtype=np.int64)[order]),
        osl=np.maximum(1, np.array(osl, dtype=np.int64)[order]),
        hash_offsets=np.zeros(n + 1, dtype=np.int64),
        hashes=np.zeros(0, dtype=np.uint64),
        block_size=AZURE_BLOCK_SIZE,
        source=str(path),
    )


def _relative_us(t_us: np.ndarray) -> np.ndarray:
    if t_us.size == 0:
        return np.zeros(0, dtype=np.int64)
    rel = np.maximum.accumulate(t_us - t_us[0])  # never decreasing, even if the file jitters
    return np.round(rel).astype(np.int64)


def _leading_hits(hashes: list[int], cached) -> int:
    """Blocks of a request served from a prefix cache: its leading block hashes found in `cached`
    (any container of block hashes; the first miss ends the prefix)."""
    hit = 0
    for h in hashes:
        if h not in cached:
            break
        hit += 1
    return hit
