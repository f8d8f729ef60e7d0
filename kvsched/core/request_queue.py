"""vLLM's RequestQueue interface: the container of one lane (a class's shared heap or one
worker's pinned lane).

The queue is one binary heap of `(key, uid, entry)` with lazy deletion: removal
drops the entry from an id index in O(1) and the heap root is skipped when dead; the heap is
compacted (rebuilt from the live index, O(n)) only when dead items outnumber live ones, so removal is
O(log n) amortised and never an O(n) scan per request. The ordering lives in the keys
(`kvsched.core.ordering`).

Differences from vLLM's `request_queue.py` (docs/DESIGN.md §4.5), on purpose: one class serves every
ordering (its key function, from `kvsched.core.ordering`, is the only difference); removal is
`discard_requests(rs)` (ids or entries; ids not queued are ignored; never compacts: `compact()` once per
batch, so a cleanup batch costs at most one compaction per container) and `discard_entry` (only the
very entry given); `get(id)` finds one. There is no `prepend_request`: the scheduler requeues with
`add_request` on an entry flagged `requeued`, whose FCFS key keeps a burst of requeues in their
original order (vLLM's repeated `prepend_request` would reverse it).

Source: vLLM `vllm/v1/core/sched/request_queue.py` (RequestQueue, create_request_queue);
docs/DESIGN.md §4.5 The RequestQueue container.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Iterator

from .ordering import KEY_FUNCS, Key, QueueEntry

_UID = itertools.count(1)  # heap tie-breaker so entries themselves are never compared


def _rid(request: QueueEntry | str) -> str:
    return request if isinstance(request, str) else request.request_id


class RequestQueue:
    """Ordered container of waiting `QueueEntry`s (vLLM's method names), ordered by `key_fn` (a
    function of `kvsched.core.ordering`).

    Invariant: `len(self)` == number of live entries; every live entry's `.key` is the key it is
    stored under; a request id appears at most once.
    """

    __slots__ = ("_heap", "_index", "_key_fn")

    def __init__(self, key_fn: Callable[[QueueEntry], Key]) -> None:
        self._key_fn = key_fn
        self._heap: list[list] = []  # [key, uid, entry]; dead items stay until skipped/compacted
        self._index: dict[str, list] = {}  # request_id -> its live heap item

    def _clean_root(self) -> None:
        heap, index = self._heap, self._index
        while heap and index.get(heap[0][2].request_id) is not heap[0]:
            heapq.heappop(heap)

    def compact(self) -> bool:
        """Rebuild the storage if dead items outnumber live ones; True if it did (O(n))."""
        if len(self._heap) > 2 * len(self._index) + 32:
            self._heap = list(self._index.values())
            heapq.heapify(self._heap)
            return True
        return False

    def add_request(self, request: QueueEntry) -> None:
        """Add by the queue's ordering key. Raises ValueError if the id is already queued."""
        if request.request_id in self._index:
            raise ValueError(f"request {request.request_id!r} is already queued")
        request.key = key = self._key_fn(request)
        item = [key, next(_UID), request]
        self._index[request.request_id] = item
        heapq.heappush(self._heap, item)

    def pop_request(self) -> QueueEntry:
        """Remove and return the head. Raises IndexError("pop from an empty queue")."""
        self._clean_root()
        if not self._heap:
            raise IndexError("pop from an empty queue")
        item = heapq.heappop(self._heap)
        del self._index[item[2].request_id]
        return item[2]

    def peek_request(self) -> QueueEntry:
        """Return the head without removing it. Raises IndexError("peek from an empty queue")."""
        self._clean_root()
        if not self._heap:
            raise IndexError("peek from an empty queue")
        return self._heap[0][2]

    def discard_entry(self, entry: QueueEntry) -> bool:
        """As `discard_requests` of one entry, but only when this very entry (not only its id) is
        queued here. True when it was removed."""
        index = self._index
        item = index.pop(entry.request_id, None)  # one lookup: a dead flooder's cancel runs this per entry
        if item is None:
            return False
        if item[2] is not entry:  # another entry with this id: it stays
            index[entry.request_id] = item
            return False
        return True

    def discard_requests(self, requests: Iterable[QueueEntry | str]) -> list[QueueEntry]:
        """Remove every given entry / request id that is queued (absent ones are ignored); never
        compacts (call `compact()` once per batch). Returns the removed entries."""
        removed = []
        for request in requests:
            item = self._index.pop(_rid(request), None)
            if item is not None:
                removed.append(item[2])
        return removed

    def get(self, request_id: str) -> QueueEntry | None:
        """The queued entry with this id, or None. O(1)."""
        item = self._index.get(request_id)
        return None if item is None else item[2]

    def __contains__(self, request: QueueEntry | str) -> bool:
        return _rid(request) in self._index

    def __iter__(self) -> Iterator[QueueEntry]:
        """Entries in dispatch order; never mutates the queue (O(n log n))."""
        for item in sorted(self._index.values()):
            yield item[2]

    def __len__(self) -> int:
        return len(self._index)

    def __bool__(self) -> bool:
        return len(self._index) > 0


def create_request_queue(policy: str) -> RequestQueue:
    """A new empty queue for `policy` ∈ {"fcfs", "priority", "wspt"}: FCFS (with the jump of
    `priority` seconds of earlier arrival and `strict_priority`), vLLM's priority order (lower
    `priority` first, then arrival), or weighted shortest processing time on uncached tokens
    ((1 + jump) / cost, higher first); `kvsched.core.ordering` states the keys.

    Raises:
        ValueError: unknown policy (as vLLM's `create_request_queue`).
    """
    try:
        key_fn = KEY_FUNCS[policy]
    except KeyError:
        raise ValueError(f"Unknown scheduling policy: {policy!r}; expected one of {sorted(KEY_FUNCS)}") from None
    return RequestQueue(key_fn)
