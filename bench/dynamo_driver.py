"""NVIDIA Dynamo's selector as a baseline, through its standalone selection service.

Install: `pip install -e '.[bench-dynamo]'` (`ai-dynamo-runtime>=1.6,<1.7`, a manylinux_2_28 wheel;
runs on CPU). One module for every bench that drives Dynamo (routing quality, transport).

The service (`python -m dynamo.select_service --port P`) keeps its own KV index fed by the engines'
vLLM-format KV events and its own active-load bookkeeping, with Dynamo's cost and defaults
(overlap_score_credit 1.0, prefill_load_scale 1.0, temperature 0, as its start-up log prints).
HTTP API used here (JSON bodies):

* `POST /workers` {worker_id, endpoint, block_size, kv_events_endpoints: {"<dp rank>": url}} —
  a worker is schedulable once it has an endpoint, a block size > 0 and a KV-event endpoint;
* `POST /select_and_reserve` {token_ids} → {selection_id, worker_id, dp_rank, overlap{gpu, ...},
  effective_prefill_tokens, ...}; `POST /reservations/{id}/prefill_complete`; `DELETE /reservations/{id}`;
* `POST /overlap_scores` {token_ids} → per worker `device_blocks` (cached leading blocks).

Dynamo identifies blocks by token ids: a `BlockStored` event without `token_ids` is dropped. The
traces carry only block hash ids, so engines publish synthetic token ids for every
block (`kvsched.sim.tokens`, `FleetParams.kv_token_ids`; the same ids for every request sharing that block) and
requests are sent as the concatenation of their blocks' ids.

The service lifecycle and clients live in `kvsched.sim.dynamo` (the wall-clock replay's
`router_via="dynamo"` mode uses them); this module re-exports them for the benches and adds
`overlap_agrees`, a one-worker check that the service indexes kvsched's KV events.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvsched.sim.dynamo import (
    DynamoService,
    _free_port,
)


def request_token_ids(block_hashes, block_size: int) -> list[int]:
    """A request's prompt as token ids: its blocks' synthetic ids (`kvsched.sim.tokens`), concatenated."""
    from kvsched.sim.tokens import token_ids_for

    return token_ids_for(block_hashes, block_size)


def overlap_agrees(block_size: int = 16, blocks: int = 4, settle_s: float = 1.0) -> dict:
    """Start the service, register one worker whose KV events come from kvsched's vLLM-format publisher,
    publish one BlockStored of `blocks` blocks with synthetic token ids and check that the service
    sees exactly that overlap for a request extending them (the daemon's overlap for the same events
    is `blocks`). Returns {"agrees", "dynamo_blocks", "expected_blocks"}."""
    import zmq

    from kvsched.sim.kv_publisher import KvEventPublisher

    ctx = zmq.Context.instance()
    port = _free_port()
    pub = KvEventPublisher(ctx, f"tcp://127.0.0.1:{port}")
    hashes = [0xABC0 + k for k in range(blocks + 2)]
    stored, query = hashes[:blocks], hashes
    try:
        with DynamoService() as svc:
            svc.add_worker(1, block_size, f"tcp://127.0.0.1:{port}")
            seen = 0
            deadline = time.monotonic() + 10 * settle_s
            while time.monotonic() < deadline and seen < blocks:  # PUB/SUB slow joiner: resend until seen
                pub.block_stored(stored, None, block_size, token_ids=request_token_ids(stored, block_size))
                pub.flush()
                time.sleep(settle_s)
                seen = svc.overlap_blocks(request_token_ids(query, block_size)).get((1, 0), 0)
            return {"agrees": seen == blocks, "dynamo_blocks": seen, "expected_blocks": blocks}
    finally:
        pub.close()
