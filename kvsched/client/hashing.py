"""Block hashing for routers, kept at its earlier import path: `kvsched.client.hashing` names the same
functions and classes as `kvsched.hashing` (the ground floor's module, where they live: the hashes are
part of the wire contract, so the daemon's KV-event check and the gateway share them without the client).
New code imports `kvsched.hashing`.
"""

from __future__ import annotations

from ..hashing import (
    BlockHashCache,
    block_hashes,
    canonical_cbor,
    hashes_from_bytes,
    vllm_extra_keys,
    vllm_none_hash,
)

__all__ = [
    "BlockHashCache",
    "block_hashes",
    "canonical_cbor",
    "hashes_from_bytes",
    "vllm_extra_keys",
    "vllm_none_hash",
]
