"""vLLM KV-cache events: wire format (`format`), per-row stream state applied to the overlap
indexes (`apply`), engine hash checks (`hash_check`). Pure: no sockets, so the scheduling core may
import it. The socket side lives in `kvsched.daemon.kv_events`; the vLLM-format publisher used by
tests and the simulated fleet is `kvsched.sim.kv_publisher`."""

from .apply import KvEventApplier, KvEventCounters, LiveResult
from .format import (
    END_SEQ,
    Cleared,
    DecodedBatch,
    KvEventFormatError,
    Removed,
    Stored,
    block_key,
    decode_batch,
    normalize_hash,
    offset_endpoint,
)

__all__ = [
    "END_SEQ",
    "Cleared",
    "DecodedBatch",
    "KvEventApplier",
    "KvEventCounters",
    "KvEventFormatError",
    "LiveResult",
    "Removed",
    "Stored",
    "block_key",
    "decode_batch",
    "normalize_hash",
    "offset_endpoint",
]
