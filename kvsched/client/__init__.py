"""Router-side library: `SchedulerClient` (asyncio), `SyncSchedulerClient`, `Lease`, `AdminClient`."""

from .admin import AdminClient
from .client import SchedulerClient
from .lease import Lease
from .sync import SyncLease, SyncSchedulerClient

__all__ = ["AdminClient", "Lease", "SchedulerClient", "SyncLease", "SyncSchedulerClient"]
