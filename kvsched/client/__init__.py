"""Router-side library: `SchedulerClient` (asyncio), `SyncSchedulerClient`, `Lease`, `AdminClient`,
and every exception `schedule()` and the leases raise.

`schedule()` raises one `RequestRejected` subclass per rejection reason (`QueueFull`, `NoEndpoints`,
`QueueTimeout`, ...; `REJECTION_CLASSES` maps each wire reason to its class), `DaemonUnavailable`
when no daemon answers and `ProtocolError` for a refused protocol version.

The client classes are imported on first use (PEP 562 module `__getattr__`): `kvsched.client.admin`
(used by the `kvsched` CLI) then does not load numpy and the scheduling types.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ..errors import (
    REJECTION_CLASSES,
    AllOverloaded,
    DaemonOverloaded,
    DaemonUnavailable,
    DoNotQueue,
    DuplicateRequest,
    FrameTooLarge,
    InvalidRequest,
    KvschedError,
    LeaseError,
    LeaseLost,
    LeaseRevoked,
    NoEndpoints,
    PinnedNotAllowed,
    ProtocolError,
    QueueFull,
    QueueTimeout,
    RequestCancelled,
    RequestRejected,
    ShuttingDown,
)

if TYPE_CHECKING:
    from .admin import AdminClient
    from .client import SchedulerClient
    from .lease import Lease
    from .sync import SyncLease, SyncSchedulerClient

_LAZY = {
    "AdminClient": "admin",
    "SchedulerClient": "client",
    "Lease": "lease",
    "SyncLease": "sync",
    "SyncSchedulerClient": "sync",
}

__all__ = [
    "REJECTION_CLASSES",
    "AdminClient",
    "AllOverloaded",
    "DaemonOverloaded",
    "DaemonUnavailable",
    "DoNotQueue",
    "DuplicateRequest",
    "FrameTooLarge",
    "InvalidRequest",
    "KvschedError",
    "Lease",
    "LeaseError",
    "LeaseLost",
    "LeaseRevoked",
    "NoEndpoints",
    "PinnedNotAllowed",
    "ProtocolError",
    "QueueFull",
    "QueueTimeout",
    "RequestCancelled",
    "RequestRejected",
    "SchedulerClient",
    "ShuttingDown",
    "SyncLease",
    "SyncSchedulerClient",
]


def __getattr__(name: str) -> Any:
    """Import a client class on first access (`from kvsched.client import SchedulerClient`)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
