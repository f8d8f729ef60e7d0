"""vLLM KV-cache events: wire format (`format`), per-row stream state applied to the overlap
indexes (`apply`), and a vLLM-format publisher for tests and the simulated fleet (`publisher`).
The socket side lives in `kvsched.daemon.kv_events`."""

from .apply import KvEventApplier, KvEventCounters, LiveResult, credited_overlap
from .format import (
    END_SEQ, Cleared, DecodedBatch, KvEventFormatError, Removed, Stored, block_key, decode_batch,
    normalize_hash, offset_endpoint,
)
from .publisher import KvEventPublisher

__all__ = [
    "END_SEQ", "Cleared", "DecodedBatch", "KvEventApplier", "KvEventCounters", "KvEventFormatError",
    "KvEventPublisher", "LiveResult", "Removed", "Stored", "block_key", "credited_overlap", "decode_batch",
    "normalize_hash", "offset_endpoint",
]
