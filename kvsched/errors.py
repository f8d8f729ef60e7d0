"""Exception hierarchy of kvsched (docs/DESIGN.md §10.4).

Inside the core a rejection is a value (`RejectReason`), never an exception; these classes are the
faces errors take at the edges: config loading, the wire, shared memory and the client API.
"""

from __future__ import annotations


class KvschedError(Exception):
    """Base of every error kvsched raises on purpose."""


class ConfigError(KvschedError):
    """A config file, environment variable or flag is invalid; the message names the key path."""


class ProtocolError(KvschedError):
    """An undecodable, oversized or out-of-order frame, or a protocol version outside the window."""


class FrameTooLarge(ProtocolError, ValueError):
    """A frame this client would send is larger than the daemon accepts (`Welcome.max_frame_bytes`,
    the daemon's `[daemon] max_frame_bytes`): the daemon's transport would drop the whole connection
    for it. Raised by `schedule()` before anything is sent (e.g. a request with tens of thousands of
    block hashes against a small limit); a waiting request whose `Enqueue` no longer fits a restarted
    daemon's limit fails with it. The message gives both sizes in bytes.
    """


class ShmLayoutError(KvschedError):
    """A shared-memory segment's magic, layout version or capacities do not match what was expected."""


class DaemonUnavailable(KvschedError):
    """The daemon could not be reached (connect or reply timeout); the message names the endpoint."""


class LeaseError(KvschedError):
    """A lease was used after release, or released twice with different outcomes."""


class LeaseLost(LeaseError):
    """The daemon no longer holds this lease: it declared the router dead after `liveness_timeout_ms`
    of silence (the router's process stopped, or a native call held the GIL that long: a blocked event
    loop alone does not, docs/PROTOCOL.md "Liveness"), or it restarted without the lease. The
    message says which. Stop streaming for the request (the worker's booking is gone) and schedule
    it again if it must still run. `reason` holds the same text.
    """

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"lease {request_id!r} was lost: {reason}")
        self.request_id = request_id
        self.reason = reason


class LeaseRevoked(LeaseLost):
    """An operator cancelled this active lease (`kvsched cancel`): the daemon released its booking.
    Abort the request (stop the engine's work and the caller's stream); do not schedule it again.
    A `LeaseLost`, so code that stops on a lost lease stops on a revoked one too. `reason` holds the
    daemon's detail.
    """

    def __init__(self, request_id: str, reason: str) -> None:
        LeaseError.__init__(self, f"lease {request_id!r} was revoked by an operator (kvsched cancel): {reason}")
        self.request_id = request_id
        self.reason = reason


class RequestRejected(KvschedError):
    """Client-side face of a `Rejected` frame (docs/DESIGN.md §2.4).

    Attributes:
        request_id: the request that was rejected.
        reason: one of the rejection reasons of docs/DESIGN.md §2.4 (str).
        detail: human-readable explanation from the daemon.
        policy_class: the class the request resolved to ("" if unknown).
        limit_kind / current / limit: for `queue_full`, which limit was hit and its figures.
    """

    reason = "rejected"

    def __init__(
        self,
        request_id: str,
        detail: str = "",
        policy_class: str = "",
        limit_kind: str | None = None,
        current: int | None = None,
        limit: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.detail = detail
        self.policy_class = policy_class
        self.limit_kind = limit_kind
        self.current = current
        self.limit = limit
        msg = f"request {request_id!r} rejected: {self.reason}"
        if detail:
            msg += f" ({detail})"
        super().__init__(msg)


class QueueFull(RequestRejected):
    """The class's queue limit was reached (`limit_kind`, `current`, `limit` say which and how far)."""

    reason = "queue_full"


class DoNotQueue(RequestRejected):
    """`do_not_queue` was set and the request would have waited."""

    reason = "do_not_queue"


class DuplicateRequest(RequestRejected):
    """A live request already uses this request_id on this daemon."""

    reason = "duplicate_request"


class NoEndpoints(RequestRejected):
    """No eligible worker: none registered, all drained or removed, or the pinned worker is unknown/drained."""

    reason = "no_endpoints"


class PinnedNotAllowed(RequestRejected):
    """The pinned worker is not in `allowed_workers`."""

    reason = "pinned_not_allowed"


class AllOverloaded(RequestRejected):
    """Every eligible worker is past its overload threshold and the request could not wait."""

    reason = "all_overloaded"


class QueueTimeout(RequestRejected):
    """The request waited longer than `deadline_ms` or the class's `queue_timeout_s`."""

    reason = "timeout"


class DaemonOverloaded(RequestRejected):
    """The daemon is out of room (per-connection in-flight cap or slot table full); retry later."""

    reason = "overloaded"


class InvalidRequest(RequestRejected):
    """The request's fields contradict each other (e.g. more block hashes than the ISL allows)."""

    reason = "invalid"


class ShuttingDown(RequestRejected):
    """The daemon is stopping."""

    reason = "shutting_down"


class RequestCancelled(RequestRejected):
    """An operator cancelled the request (`kvsched cancel`)."""

    reason = "cancelled"


REJECTION_CLASSES: dict[str, type[RequestRejected]] = {
    cls.reason: cls
    for cls in (
        QueueFull,
        DoNotQueue,
        DuplicateRequest,
        NoEndpoints,
        PinnedNotAllowed,
        AllOverloaded,
        QueueTimeout,
        DaemonOverloaded,
        InvalidRequest,
        ShuttingDown,
        RequestCancelled,
    )
}


def rejection_error(
    request_id: str,
    reason: str,
    detail: str = "",
    policy_class: str = "",
    limit_kind: str | None = None,
    current: int | None = None,
    limit: int | None = None,
) -> RequestRejected:
    """Build the `RequestRejected` subclass for `reason` (falls back to the base class)."""
    cls = REJECTION_CLASSES.get(reason, RequestRejected)
    err = cls(request_id, detail, policy_class, limit_kind, current, limit)
    if cls is RequestRejected:
        err.reason = reason
    return err
