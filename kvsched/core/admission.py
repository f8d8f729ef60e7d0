"""Admission policies: per class, decide whether a request may become ready now (docs/DESIGN.md §4.9;
after Dynamo's policy-class admission lifecycle).

Lifecycle of one request in a class that has a policy:

1. `decide(...)` is asked exactly once → `Bypass` (the policy opts out: no further events),
   `Ready(placement)` (None = any worker, or one exact `WorkerKey`), or `Defer` (held until the
   policy answers `MakeReady` for it).
2. `notify(Dispatched)` at most once (the backend accepted it), then exactly one of
   `notify(Completed(context_tokens))` / `notify(Aborted)` (released, cancelled, timed out, rejected,
   owner gone, worker removed). `notify(Reconcile())` arrives periodically (every `tick`).
3. Every `notify` may answer with `MakeReady(request_id, placement)` records; the scheduler ignores
   unknown or duplicate ids. An exact placement moves the request into that worker's lane of the same
   class (cost re-snapshotted, limits not re-applied); the policy keeps receiving its events.

Policies are pure: they see the fleet only through the `FleetView` passed in.
`create_admission_policy(cfg)` builds one from an `AdmissionConfig` (ValueError for unknown types).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

from ..config import AdmissionConfig
from .types import RequestSpec, WorkerKey


# ---- decisions ---------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Bypass:
    """The policy opts out for this request (it receives no events for it)."""


@dataclass(frozen=True, slots=True)
class Ready:
    """The request may run: on any eligible worker (placement None) or on one exact worker."""

    placement: WorkerKey | None = None


@dataclass(frozen=True, slots=True)
class Defer:
    """Hold the request until the policy answers MakeReady for it."""


Decision = Bypass | Ready | Defer


@dataclass(frozen=True, slots=True)
class MakeReady:
    """Release a deferred request (or pin a ready one) to `placement` (None = any worker)."""

    request_id: str
    placement: WorkerKey | None = None


# ---- events ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Dispatched:
    request_id: str


@dataclass(frozen=True, slots=True)
class Completed:
    request_id: str
    context_tokens: int  # isl + output tokens


@dataclass(frozen=True, slots=True)
class Aborted:
    request_id: str


@dataclass(frozen=True, slots=True)
class Reconcile:
    """Periodic wake-up (every Scheduler.tick)."""


Event = Dispatched | Completed | Aborted | Reconcile


@dataclass(frozen=True, slots=True)
class FleetView:
    """What a policy may know about the fleet (sums over registered workers)."""

    booked_blocks: int  # KV blocks booked by active leases (ledger w_active_blocks)
    total_kv_blocks: int  # KV blocks of every registered worker
    block_size: int  # tokens per block


class AdmissionPolicy(ABC):
    """Contract of an admission policy (see the module docstring for the lifecycle)."""

    name: str = ""

    @abstractmethod
    def decide(self, request_id: str, spec: RequestSpec, fleet: FleetView, now_us: int) -> Decision:
        """Asked once per request of the class."""

    @abstractmethod
    def notify(self, event: Event, fleet: FleetView, now_us: int) -> list[MakeReady]:
        """Told about a request's lifecycle (or Reconcile); unknown ids are ignored."""

    @abstractmethod
    def reconfigure(self, cfg: AdmissionConfig) -> None:
        """Apply changed options of the same type (config reload)."""

    @abstractmethod
    def tracked(self) -> int:
        """Requests the policy currently tracks (reload refuses to replace a busy policy)."""


class SessionCapPolicy(AdmissionPolicy):
    """At most K active requests per `session_id`; the excess is deferred and released in arrival
    order as active ones complete or abort. Requests without a session bypass the policy.

    Maps: session_id -> active count; session_id -> deque of deferred request ids;
    request_id -> (session_id, is_active).
    """

    name = "session_cap"

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.k = cfg.max_active_per_session
        self._active: dict[str, int] = {}
        self._waiting: dict[str, deque[str]] = {}
        self._ids: dict[str, tuple[str, bool]] = {}

    def decide(self, request_id: str, spec: RequestSpec, fleet: FleetView, now_us: int) -> Decision:
        s = spec.session_id
        if s is None or request_id in self._ids:
            return Bypass()
        if self._active.get(s, 0) < self.k and not self._waiting.get(s):
            self._active[s] = self._active.get(s, 0) + 1
            self._ids[request_id] = (s, True)
            return Ready()
        self._waiting.setdefault(s, deque()).append(request_id)
        self._ids[request_id] = (s, False)
        return Defer()

    def notify(self, event: Event, fleet: FleetView, now_us: int) -> list[MakeReady]:
        if not isinstance(event, (Completed, Aborted)):
            return []
        st = self._ids.pop(event.request_id, None)
        if st is None:
            return []
        s, active = st
        if not active:
            self._waiting[s].remove(event.request_id)
            if not self._waiting[s]:
                del self._waiting[s]
            return []
        self._active[s] -= 1
        return self._release(s)

    def _release(self, s: str) -> list[MakeReady]:
        out = []
        waiting = self._waiting.get(s)
        while waiting and self._active[s] < self.k:
            rid = waiting.popleft()
            self._active[s] += 1
            self._ids[rid] = (s, True)
            out.append(MakeReady(rid))
        if waiting is not None and not waiting:
            del self._waiting[s]
        if self._active.get(s) == 0:
            del self._active[s]
        return out

    def reconfigure(self, cfg: AdmissionConfig) -> None:
        self.k = cfg.max_active_per_session

    def tracked(self) -> int:
        return len(self._ids)


class KvPressurePolicy(AdmissionPolicy):
    """Defer the class's new requests while booked blocks exceed `high_water_frac` of the fleet's
    total_kv_blocks; resume below `low_water_frac` (hysteresis). Deferred requests are released in
    arrival order, while the booked estimate (booked + released blocks) stays within the high mark.

    Maps: request_id -> prompt blocks, for deferred requests (arrival order).
    """

    name = "kv_pressure"

    def __init__(self, cfg: AdmissionConfig) -> None:
        self.reconfigure(cfg)
        self.pressured = False
        self._deferred: OrderedDict[str, int] = OrderedDict()

    def reconfigure(self, cfg: AdmissionConfig) -> None:
        if cfg.low_water_frac > cfg.high_water_frac:
            raise ValueError("kv_pressure: low_water_frac must be <= high_water_frac")
        self.high, self.low = cfg.high_water_frac, cfg.low_water_frac

    def _update(self, fleet: FleetView) -> bool:
        if fleet.total_kv_blocks <= 0:
            self.pressured = False
        elif fleet.booked_blocks > self.high * fleet.total_kv_blocks:
            self.pressured = True
        elif fleet.booked_blocks < self.low * fleet.total_kv_blocks:
            self.pressured = False
        return self.pressured

    def decide(self, request_id: str, spec: RequestSpec, fleet: FleetView, now_us: int) -> Decision:
        if not self._update(fleet) and not self._deferred:
            return Ready()
        self._deferred[request_id] = -(-spec.isl_tokens // max(1, fleet.block_size))
        return Defer()

    def notify(self, event: Event, fleet: FleetView, now_us: int) -> list[MakeReady]:
        if isinstance(event, Aborted):
            self._deferred.pop(event.request_id, None)
        if not self._deferred or self._update(fleet):
            return []
        out: list[MakeReady] = []
        booked = fleet.booked_blocks
        limit = self.high * fleet.total_kv_blocks
        while self._deferred:
            rid, blocks = next(iter(self._deferred.items()))
            if out and booked + blocks > limit:
                break
            del self._deferred[rid]
            booked += blocks
            out.append(MakeReady(rid))
        return out

    def tracked(self) -> int:
        return len(self._deferred)


_POLICIES: dict[str, Callable[[AdmissionConfig], AdmissionPolicy]] = {
    "session_cap": SessionCapPolicy,
    "kv_pressure": KvPressurePolicy,
}


def create_admission_policy(cfg: AdmissionConfig | None) -> AdmissionPolicy | None:
    """The policy named by `cfg.type` (None → no policy). Raises ValueError for an unknown type."""
    if cfg is None:
        return None
    try:
        cls = _POLICIES[cfg.type]
    except KeyError:
        raise ValueError(f"unknown admission policy {cfg.type!r}; expected one of {sorted(_POLICIES)}") from None
    return cls(cfg)
