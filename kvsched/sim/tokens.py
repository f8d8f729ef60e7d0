"""Deterministic synthetic token ids for trace blocks (the traces carry block hash ids, no text).

Routers that identify blocks by token ids (NVIDIA Dynamo's selector hashes the `token_ids` of each
`BlockStored` event and drops events without them) need the same ids from the engines' KV events and
from the requests. Block i of any request gets `token_ids_for([hash_i], B)`: B ids drawn from the
block's hash alone, so every request sharing a block sends the same ids for it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from ..shm.mix import GOLDEN, U64_MASK, mix64_array

VOCAB = 32_000  # ids are in [0, VOCAB)
_U64 = np.uint64


def token_ids_for(block_hashes: Iterable[int], block_size: int) -> list[int]:
    """The concatenated token ids of consecutive blocks (a request's prompt, or a BlockStored run):
    block i's `block_size` ids are SplitMix64 of hash_i + k·golden (k = 1..block_size), modulo VOCAB."""
    h = np.fromiter((int(x) & U64_MASK for x in block_hashes), dtype=_U64)
    if h.size == 0:
        return []
    with np.errstate(over="ignore"):
        z = mix64_array(h[:, None] + (np.arange(1, block_size + 1, dtype=_U64) * _U64(GOLDEN))[None, :])
    return (z % _U64(VOCAB)).astype(np.int64).ravel().tolist()


class TokenIdPublisher:
    """A `SimEngine.cache_listener` that forwards to a `KvEventPublisher`, adding each stored block's
    synthetic token ids (`block_size` per block) to its BlockStored events."""

    __slots__ = ("publisher",)

    def __init__(self, publisher) -> None:
        self.publisher = publisher

    def block_stored(self, hashes, parent=None, block_size: int = 16) -> None:
        self.publisher.block_stored(hashes, parent, block_size, token_ids=token_ids_for(hashes, block_size))

    def block_removed(self, hashes) -> None:
        self.publisher.block_removed(hashes)

    def __getattr__(self, name):  # flush, close, service_replay, ... of the publisher
        return getattr(self.publisher, name)
