"""vLLM's RequestQueue interface: the container of one lane (a class's shared heap or one
worker's pinned lane).

All three implementations are one binary heap of `(key, uid, entry)` with lazy deletion: removal
drops the entry from an id index in O(1) and the heap root is skipped when dead; the heap is
compacted (rebuilt from the live index, O(n)) only when dead items outnumber live ones, so removal is
O(log n) amortised and never an O(n) scan per request. The ordering lives in the keys
(`kvsched.core.ordering`).

Differences from vLLM's `request_queue.py` (docs/DESIGN.md §4.5), on purpose:
* `prepend_requests(reqs)` keeps the given order: the first given ends at the head (vLLM's
  `extendleft` reverses it).
* `remove_request` / `remove_requests` accept request ids or entries; `remove_requests` takes any
  iterable (normally a set) and ignores ids that are not queued.
* `remove_request` of an absent request raises `ValueError` (as `deque.remove` / `list.remove` do).

Extensions used by the scheduler's class queues (not in vLLM): `discard_requests(rs)` removes
without compacting (`discard_entry` likewise, only the very entry given); `get(id)` finds one;
`compact()` compacts once when dead items outnumber live ones, so a cleanup batch costs at most one
compaction per container. (The scheduler requeues with `add_request` on an entry
flagged `requeued`, whose FCFS key keeps a burst of requeues in their original order; vLLM's repeated
`prepend_request` would reverse it.)

Source: vLLM `vllm/v1/core/sched/request_queue.py` (RequestQueue ABC, FCFSRequestQueue,
PriorityRequestQueue, create_request_queue); docs/DESIGN.md §4.5 The RequestQueue container.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .ordering import BAND_PREPENDED, Key, QueueEntry, fcfs_key, priority_key, wspt_key

_PREPEND_SEQ = itertools.count(1)  # process-wide: later prepends sort before earlier ones
_UID = itertools.count(1)  # heap tie-breaker so entries themselves are never compared


class RequestQueue(ABC):
    """Ordered container of waiting `QueueEntry`s (vLLM's method names).

    Invariant: `len(self)` == number of live entries; every live entry's `.key` is the key it is
    stored under; a request id appears at most once.
    """

    @abstractmethod
    def add_request(self, request: QueueEntry) -> None:
        """Add by the queue's ordering key. Raises ValueError if the id is already queued."""

    @abstractmethod
    def pop_request(self) -> QueueEntry:
        """Remove and return the head. Raises IndexError("pop from an empty queue")."""

    @abstractmethod
    def peek_request(self) -> QueueEntry:
        """Return the head without removing it. Raises IndexError("peek from an empty queue")."""

    @abstractmethod
    def prepend_request(self, request: QueueEntry) -> None:
        """Put a request back at the head (FCFS) or by its key (priority / WSPT: no head exists)."""

    @abstractmethod
    def prepend_requests(self, requests: Iterable[QueueEntry]) -> None:
        """Prepend several, keeping the given order (the first given ends at the head)."""

    @abstractmethod
    def remove_request(self, request: QueueEntry | str) -> QueueEntry:
        """Remove one entry (or request id) and return it. Raises ValueError if absent."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[QueueEntry | str]) -> list[QueueEntry]:
        """Remove every given entry / request id that is queued (absent ones are ignored);
        at most one compaction. Returns the removed entries."""

    @abstractmethod
    def discard_requests(self, requests: Iterable[QueueEntry | str]) -> list[QueueEntry]:
        """As `remove_requests`, but never compacts (call `compact()` once per batch)."""

    @abstractmethod
    def compact(self) -> bool:
        """Rebuild the storage if dead items outnumber live ones; True if it did (O(n))."""

    @abstractmethod
    def __iter__(self) -> Iterator[QueueEntry]:
        """Entries in dispatch order; never mutates the queue (O(n log n))."""

    @abstractmethod
    def __len__(self) -> int: ...

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: QueueEntry | str) -> bool:
        return _rid(request) in self._live_index()

    def get(self, request_id: str) -> QueueEntry | None:
        """The queued entry with this id, or None. O(1)."""
        item = self._live_index().get(request_id)
        return None if item is None else item[2]

    @abstractmethod
    def discard_entry(self, entry: QueueEntry) -> bool:
        """As `discard_requests` of one entry, but only when this very entry (not only its id) is
        queued here. True when it was removed."""

    @abstractmethod
    def _live_index(self) -> dict[str, list[Any]]: ...


def _rid(request: QueueEntry | str) -> str:
    return request if isinstance(request, str) else request.request_id


class HeapRequestQueue(RequestQueue):
    """A RequestQueue ordered by `key_fn` (a function of `kvsched.core.ordering`)."""

    __slots__ = ("_head_prepend", "_heap", "_index", "_key_fn")
    _head_prepend: bool  # True: prepend puts at the head (FCFS); False: by key

    def __init__(self, key_fn: Callable[[QueueEntry], Key], head_prepend: bool) -> None:
        self._key_fn = key_fn
        self._heap: list[list[Any]] = []  # [key, uid, entry]; dead items stay until skipped/compacted
        self._index: dict[str, list[Any]] = {}  # request_id -> its live heap item
        self._head_prepend = head_prepend

    def _live_index(self) -> dict[str, list[Any]]:
        return self._index

    def _push(self, entry: QueueEntry, key: Key) -> None:
        if entry.request_id in self._index:
            raise ValueError(f"request {entry.request_id!r} is already queued")
        entry.key = key
        item = [key, next(_UID), entry]
        self._index[entry.request_id] = item
        heapq.heappush(self._heap, item)

    def _clean_root(self) -> None:
        heap, index = self._heap, self._index
        while heap and index.get(heap[0][2].request_id) is not heap[0]:
            heapq.heappop(heap)

    def _maybe_compact(self) -> bool:
        if len(self._heap) > 2 * len(self._index) + 32:
            self._heap = list(self._index.values())
            heapq.heapify(self._heap)
            return True
        return False

    def compact(self) -> bool:
        return self._maybe_compact()

    def add_request(self, request: QueueEntry) -> None:
        self._push(request, self._key_fn(request))

    def pop_request(self) -> QueueEntry:
        self._clean_root()
        if not self._heap:
            raise IndexError("pop from an empty queue")
        item = heapq.heappop(self._heap)
        del self._index[item[2].request_id]
        entry: QueueEntry = item[2]
        return entry

    def peek_request(self) -> QueueEntry:
        self._clean_root()
        if not self._heap:
            raise IndexError("peek from an empty queue")
        entry: QueueEntry = self._heap[0][2]
        return entry

    def prepend_request(self, request: QueueEntry) -> None:
        if self._head_prepend:
            self._push(request, (BAND_PREPENDED, -next(_PREPEND_SEQ)))
        else:
            self.add_request(request)

    def prepend_requests(self, requests: Iterable[QueueEntry]) -> None:
        for request in reversed(list(requests)):
            self.prepend_request(request)

    def remove_request(self, request: QueueEntry | str) -> QueueEntry:
        item = self._index.pop(_rid(request), None)
        if item is None:
            raise ValueError(f"request {_rid(request)!r} is not in the queue")
        self._maybe_compact()
        entry: QueueEntry = item[2]
        return entry

    def remove_requests(self, requests: Iterable[QueueEntry | str]) -> list[QueueEntry]:
        removed = self.discard_requests(requests)
        if removed:
            self._maybe_compact()
        return removed

    def discard_entry(self, entry: QueueEntry) -> bool:
        index = self._index
        item = index.pop(entry.request_id, None)  # one lookup: a dead flooder's cancel runs this per entry
        if item is None:
            return False
        if item[2] is not entry:  # another entry with this id: it stays
            index[entry.request_id] = item
            return False
        return True

    def discard_requests(self, requests: Iterable[QueueEntry | str]) -> list[QueueEntry]:
        removed = []
        for request in requests:
            item = self._index.pop(_rid(request), None)
            if item is not None:
                removed.append(item[2])
        return removed

    def __iter__(self) -> Iterator[QueueEntry]:
        for item in sorted(self._index.values()):
            yield item[2]

    def __len__(self) -> int:
        return len(self._index)


class FCFSRequestQueue(HeapRequestQueue):
    """First come first served, with the FCFS jump (`priority` seconds of earlier arrival) and
    `strict_priority`; `prepend_request` goes to the head (vLLM's `appendleft`)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(fcfs_key, head_prepend=True)


class PriorityRequestQueue(HeapRequestQueue):
    """vLLM's priority order (lower `priority` first, then arrival); prepend = add (as in vLLM)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(priority_key, head_prepend=False)


class WSPTRequestQueue(HeapRequestQueue):
    """Weighted shortest processing time on uncached tokens: (1 + jump) / cost, higher first;
    prepend = add (by key)."""

    __slots__ = ()

    def __init__(self) -> None:
        super().__init__(wspt_key, head_prepend=False)


_POLICIES: dict[str, Callable[[], RequestQueue]] = {
    "fcfs": FCFSRequestQueue,
    "priority": PriorityRequestQueue,
    "wspt": WSPTRequestQueue,
}


def create_request_queue(policy: str) -> RequestQueue:
    """A new empty queue for `policy` ∈ {"fcfs", "priority", "wspt"}.

    Raises:
        ValueError: unknown policy (as vLLM's `create_request_queue`).
    """
    try:
        cls = _POLICIES[policy]
    except KeyError:
        raise ValueError(f"Unknown scheduling policy: {policy!r}; expected one of {sorted(_POLICIES)}") from None
    return cls()
