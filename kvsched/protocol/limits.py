"""What the wire allows: the protocol versions, the wire limits and the bounded field types.

The bounds live in the types (`msgspec.Meta`), so a frame outside them fails at decode and never
reaches the daemon's actor (docs/PROTOCOL.md, "Encoding rules").
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

PROTOCOL_VERSION = 2  # the version this package speaks; 2 added `Batch` / `Replies`
PROTOCOL_MIN = 1
PROTOCOL_MAX = 2
BATCH_MIN_VERSION = 2  # `Batch` and `Replies` need a connection at this version or above
DEFAULT_MAX_FRAME_BYTES = 1 << 20  # assumed when a `Welcome` does not announce its limit (version 1)

MAX_REQUEST_ID_BYTES = 128
MAX_BLOCK_HASHES = 65_536  # per request; 8 bytes each on the wire
MAX_NAME_CHARS = 128
MAX_LIST = 65_536
# Worker capacities (per rank). 2**40 KV blocks is ~10**5 times the largest GPU's (an 80 GB card
# holds ~10**6 blocks of 16 tokens); with it, sums over max_workers (4,096 = 2**12) rows and products
# with the selector's weights stay exact in int64 and float64 (< 2**53). A step budget is an int
# in vLLM (`--max-num-batched-tokens`), as a prompt's token count is here (`Tokens`).
MAX_KV_BLOCKS = 2**40
MAX_BATCHED_TOKENS = 2**31 - 1
MAX_TOKENS = 2**31 - 1  # a token count on the wire (ISL, output, context; `Tokens`): an int32, as vLLM's

U16 = Annotated[int, Meta(ge=0, le=0xFFFF)]
U32 = Annotated[int, Meta(ge=0, le=0xFFFF_FFFF)]
I32 = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]
U63 = Annotated[int, Meta(ge=0, le=2**63 - 1)]
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_BYTES)]
Name = Annotated[str, Meta(max_length=MAX_NAME_CHARS)]
Tokens = Annotated[int, Meta(ge=0, le=MAX_TOKENS)]
HashBytes = Annotated[bytes, Meta(max_length=8 * MAX_BLOCK_HASHES)]
Slot = Annotated[int, Meta(ge=-1, le=2**31 - 1)]
KvBlocks = Annotated[int, Meta(ge=1, le=MAX_KV_BLOCKS)]  # a rank's total KV blocks
BatchedTokens = Annotated[int, Meta(ge=1, le=MAX_BATCHED_TOKENS)]  # a rank's per-step token budget
