"""`PrefixCache`: the KV blocks of one simulated engine (`sim/engine.py`), in blocks, no I/O.

The prefix cache is keyed by block hash; each cached block counts the running requests that
reference (pin) it. A block no running request references stays cached, unpinned, in LRU order
(oldest first), and is evicted first when a starting request needs room. Blocks a request holds
that are not (yet) registered under a hash are anonymous: its output blocks, and its prompt
blocks until its prefill completes and registers them (vLLM v1's block pool, simplified: no
preemption).

Invariant: used blocks = cached hash blocks (pinned or not) + anonymous blocks; the unpinned hash
blocks are exactly the LRU's keys.

Changes can be observed (`listener`, e.g. a `kvsched.sim.kv_publisher.KvEventPublisher`):
`block_stored(hashes, parent, block_size)` when blocks enter the cache (one call per contiguous run
of newly registered hashes) and `block_removed(hashes)` when blocks are evicted — the changes vLLM
publishes as BlockStored / BlockRemoved KV events.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any


class PrefixCache:
    """Reference-counted hash blocks, their LRU of unpinned ones, and the anonymous block count.

    Args:
        kv_blocks: the engine's KV capacity (blocks). block_size: tokens per block.
    Attributes:
        ref: hash -> running requests referencing the block (0: cached, unpinned, in `lru`).
        lru: unpinned cached hashes, oldest first.
        anon: allocated blocks not registered under a hash.
        listener: observer of cache changes (module docstring), or None.
    """

    __slots__ = ("anon", "block_size", "kv_blocks", "listener", "lru", "ref")

    def __init__(self, kv_blocks: int, block_size: int) -> None:
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self.ref: dict[int, int] = {}
        self.lru: OrderedDict[int, None] = OrderedDict()
        self.anon = 0
        self.listener: Any = None

    @property
    def used_blocks(self) -> int:
        """Blocks in use: cached (pinned or not) plus anonymous."""
        return len(self.ref) + self.anon

    def prefix_blocks(self, hashes: Sequence[int]) -> int:
        """Leading blocks of `hashes` present in the cache now (pinned or not): the run up to the
        first miss."""
        n = 0
        ref = self.ref
        for h in hashes:
            if h not in ref:
                break
            n += 1
        return n

    def pin_and_allocate(self, hashes: Sequence[int], hits: int, need: int) -> int:
        """A request starts: pin its first `hits` cached hashes (taking them off the LRU) and
        allocate `need` anonymous blocks, evicting unpinned blocks LRU-first while the cache is
        short (a request larger than what is free still gets its blocks: the engine over-commits
        rather than deadlocks). Returns the number of blocks evicted."""
        ref, lru = self.ref, self.lru
        for h in hashes[:hits]:
            if ref[h] == 0:
                del lru[h]
            ref[h] += 1
        short = need - (self.kv_blocks - self.used_blocks)
        evicted: list[int] = []
        while short > 0 and lru:
            h, _ = lru.popitem(last=False)
            del ref[h]
            evicted.append(h)
            short -= 1
        if evicted and self.listener is not None:
            self.listener.block_removed(evicted)
        self.anon += need
        return len(evicted)

    def register(self, hashes: Sequence[int], start: int) -> None:
        """A request's prefill completed: `hashes[start:]` (computed, held as anonymous blocks until
        now) become cache entries pinned by it. A hash another request computed concurrently is
        kept once (the request takes a reference on it; its own copy is freed)."""
        listener = self.listener
        ref, lru = self.ref, self.lru
        run: list[int] = []  # newly cached hashes, contiguous in the request
        parent: int | None = None
        for i in range(start, len(hashes)):
            h = hashes[i]
            self.anon -= 1
            r = ref.get(h)
            if r is None:
                ref[h] = 1
                if listener is not None:
                    if not run:
                        parent = hashes[i - 1] if i > 0 else None
                    run.append(h)
                continue
            # computed concurrently by another request: keep one copy
            if r == 0:
                del lru[h]
            ref[h] = r + 1
            if run:
                listener.block_stored(run, parent, self.block_size)
                run = []
        if run:
            listener.block_stored(run, parent, self.block_size)

    def release(self, hashes: Sequence[int], anon: int) -> None:
        """A request finished: unpin its registered `hashes` (tail first into the LRU, as vLLM frees
        them in reverse so shared prefixes outlive their leaves) and free its `anon` anonymous blocks."""
        ref, lru = self.ref, self.lru
        for h in reversed(hashes):
            r = ref[h] - 1
            ref[h] = r
            if r == 0:
                lru[h] = None
        self.anon -= anon
