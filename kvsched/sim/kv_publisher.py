"""A vLLM-format KV-event publisher: PUB socket + replay ROUTER with a bounded ring buffer.

Speaks the wire format `kvsched.kvevents.format` decodes (the one vLLM's `ZmqEventPublisher` uses):
`[topic, seq (8 bytes big-endian), payload]` on PUB, and on the replay ROUTER a request
`[b"", start_seq]` answered by `[b"", seq, payload]` per buffered batch with seq >= start (or
`[b"", topic, seq, payload]` when `replay_with_topic`), then `[b"", END_SEQ, b""]`.

Used by tests and by the simulated fleet. Synchronous and single-threaded: engines call
`block_stored(...)`, `block_removed(...)`, `all_cleared()` to queue events and `flush()` to publish
them as one batch; replay requests are answered by `service_replay()` (called by `flush()`, or from
a loop reader via `attach(loop)`).

Encodings (`encoding=`): "array" = events as positional arrays, tag first (older vLLM; trailing
fields at their default omitted); "map" = events as maps with a "type" key, fields at their default
omitted (newer vLLM). The batch itself is always `[ts, events, data_parallel_rank]`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, cast

import msgspec
import zmq

from ..kvevents.format import END_SEQ, REMOVED_FIELDS, STORED_FIELDS, seq_from_bytes, seq_to_bytes
from ..shm.mix import U64_MASK

# Fields that have a default in vLLM's structs (omitted when equal to it); the others are required.
_STORED_DEFAULTED = frozenset({"extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"})
_REMOVED_DEFAULTED = frozenset({"group_idx"})


def _hash_out(h: int, as_bytes: bool) -> int | bytes:
    h &= U64_MASK
    return h.to_bytes(32, "big") if as_bytes else h


class KvEventPublisher:
    """Publishes vLLM-format KV-event batches; answers replay requests from a ring buffer.

    Args:
        ctx: the zmq.Context to make sockets from.
        endpoint: PUB endpoint (bound when `bind`, else connected).
        replay_endpoint: ROUTER endpoint for replay (always bound), or None.
        topic: topic frame of every message.
        encoding: "array" | "map" (module docstring).
        dp_rank: `data_parallel_rank` written into every batch.
        buffer_steps: batches kept for replay (oldest dropped first).
        replay_with_topic: reply `[b"", topic, seq, payload]` instead of `[b"", seq, payload]`.
        hashes_as_bytes: send hashes as 32-byte big-endian digests (low 64 bits = the hash).
        first_seq: seq of the first batch (a restarted engine starts again at 0).
    """

    def __init__(
        self,
        ctx: zmq.Context,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        encoding: str = "array",  # "array" | "map", checked here
        dp_rank: int = 0,
        buffer_steps: int = 10_000,
        replay_with_topic: bool = False,
        hashes_as_bytes: bool = False,
        first_seq: int = 0,
        bind: bool = True,
    ) -> None:
        if encoding not in ("array", "map"):
            raise ValueError(f"unknown encoding {encoding!r} (expected 'array' or 'map')")
        self.topic = topic.encode()
        self.encoding = encoding
        self.dp_rank = dp_rank
        self.replay_with_topic = replay_with_topic
        self.hashes_as_bytes = hashes_as_bytes
        self.seq = first_seq  # seq of the next batch
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.replays_served = 0
        self._pending: list[Any] = []
        self._enc = msgspec.msgpack.Encoder()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        (self.pub.bind if bind else self.pub.connect)(endpoint)
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT) if bind else endpoint  # resolves tcp ":*"
        self.replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        if replay_endpoint is not None:
            self.replay = ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            # A replay answer is up to the whole ring buffer plus the end marker; a ROUTER silently
            # drops what exceeds its send high-water mark, so size it for that (0 = unlimited).
            self.replay.setsockopt(zmq.SNDHWM, 0)
            self.replay.bind(replay_endpoint)
            self.replay_endpoint = self.replay.getsockopt_string(zmq.LAST_ENDPOINT)
        self._loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ events
    def _event(self, tag: str, names: tuple[str, ...], defaulted: frozenset[str], values: dict[str, Any]) -> Any:
        if self.encoding == "map":
            ev: dict[str, Any] = {"type": tag}
            ev.update({k: values.get(k) for k in names if not (k in defaulted and values.get(k) is None)})
            return ev
        arr = [tag] + [values.get(k) for k in names]
        while len(arr) > 1 and names[len(arr) - 2] in defaulted and arr[-1] is None:
            arr.pop()
        return arr

    def block_stored(
        self,
        hashes: Iterable[int],
        parent: int | None = None,
        block_size: int = 16,
        *,
        medium: str | None = "GPU",
        token_ids: list[int] | None = None,
        lora_id: int | None = None,
        group_idx: int | None = None,
        extra_keys: list | None = None,
    ) -> None:
        """Queue a BlockStored event for chained `hashes` (u64), whose first block follows `parent`."""
        hs = [_hash_out(int(h), self.hashes_as_bytes) for h in hashes]
        self._pending.append(
            self._event(
                "BlockStored",
                STORED_FIELDS,
                _STORED_DEFAULTED,
                {
                    "block_hashes": hs,
                    "parent_block_hash": None if parent is None else _hash_out(int(parent), self.hashes_as_bytes),
                    "token_ids": list(token_ids) if token_ids is not None else [],
                    "block_size": block_size,
                    "lora_id": lora_id,
                    "medium": medium,
                    "group_idx": group_idx,
                    "extra_keys": extra_keys,
                },
            )
        )

    def block_removed(self, hashes: Iterable[int], *, medium: str | None = "GPU", group_idx: int | None = None) -> None:
        """Queue a BlockRemoved event for `hashes` (u64)."""
        hs = [_hash_out(int(h), self.hashes_as_bytes) for h in hashes]
        self._pending.append(
            self._event(
                "BlockRemoved",
                REMOVED_FIELDS,
                _REMOVED_DEFAULTED,
                {"block_hashes": hs, "medium": medium, "group_idx": group_idx},
            )
        )

    def all_cleared(self) -> None:
        """Queue an AllBlocksCleared event."""
        self._pending.append({"type": "AllBlocksCleared"} if self.encoding == "map" else ["AllBlocksCleared"])

    def flush(self, ts: float | None = None, *, drop: bool = False) -> int | None:
        """Publish the queued events as one batch; returns its seq (None if nothing was queued).

        `drop=True` buffers the batch for replay but does not send it (fault injection: a gap).
        """
        self.service_replay()
        if not self._pending:
            return None
        payload = self._enc.encode([time.time() if ts is None else ts, self._pending, self.dp_rank])
        self._pending = []
        return self.publish_raw(payload, drop=drop)

    def publish_raw(self, payload: bytes, *, drop: bool = False) -> int:
        """Publish an already-encoded payload under the next seq (buffered for replay). Returns the seq."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not drop:
            self.pub.send_multipart((self.topic, seq_to_bytes(seq), payload))
        return seq

    # ------------------------------------------------------------------ replay
    def service_replay(self) -> int:
        """Answer every waiting replay request (NOBLOCK). Returns the number answered."""
        if self.replay is None:
            return 0
        n = 0
        while True:
            try:
                frames = self.replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return n
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                continue
            ident, start = frames[0], seq_from_bytes(frames[2])
            for seq, payload in list(self.buffer):
                if seq >= start:
                    parts = (
                        (ident, b"", self.topic, seq_to_bytes(seq), payload)
                        if self.replay_with_topic
                        else (ident, b"", seq_to_bytes(seq), payload)
                    )
                    self.replay.send_multipart(parts)
            self.replay.send_multipart((ident, b"", END_SEQ, b""))
            self.replays_served += 1
            n += 1

    def _on_replay_readable(self) -> None:
        self.service_replay()
        readable = self.replay is not None and cast(int, self.replay.getsockopt(zmq.EVENTS)) & zmq.POLLIN
        if readable and self._loop is not None:
            self._loop.call_soon(self._on_replay_readable)

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Answer replay requests from `loop`'s reader callbacks (until `close()`)."""
        if self.replay is None:
            return
        self._loop = loop
        loop.add_reader(cast(int, self.replay.getsockopt(zmq.FD)), self._on_replay_readable)
        loop.call_soon(self._on_replay_readable)

    def close(self) -> None:
        """Close both sockets (linger 0)."""
        if self.replay is not None:
            if self._loop is not None:
                self._loop.remove_reader(cast(int, self.replay.getsockopt(zmq.FD)))
                self._loop = None
            self.replay.close(0)
            self.replay = None
        self.pub.close(0)
