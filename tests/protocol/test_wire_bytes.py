"""The wire bytes are pinned: every frame kind, encoded now, equals the bytes recorded in
`golden/wire_frames.json`, and those bytes decode back to the same frame.

The recording was made once from the single-module `kvsched/protocol.py` (commit 727bcee), before
the protocol became a package of one module per job; a change of tag, field order, default or
omission shows up here as a byte difference. Record again only for a deliberate protocol change
(docs/PROTOCOL.md says what may change: fields appended with a default; a break bumps the version):

    python tests/protocol/test_wire_bytes.py --record [path/to/protocol module file]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import msgspec
import pytest

from kvsched import protocol as p

GOLDEN = Path(__file__).resolve().parent / "golden" / "wire_frames.json"


def build(p) -> dict[str, object]:
    """One frame per kind and shape: every field set away from its default, plus the minimal forms
    whose trailing defaults are omitted on the wire."""
    enc = p.make_encoder()

    def raw(frame: msgspec.Struct) -> msgspec.Raw:
        return msgspec.Raw(enc.encode(frame))

    enqueue = p.Enqueue(
        "req-1",
        100,
        p.hashes_to_bytes([1, 2**64 - 1, 3]),
        "batch",
        2,
        -1,
        "sess-1",
        50,
        (3, 1),
        [3, 4],
        True,
        500,
        "lora-a",
        [7, 8],
    )
    admitted = p.Admitted("req-1", 3, 1, 5, 7, 2, 32, 1500, "http://10.0.0.3:8000", 2)
    return {
        # router -> daemon
        "hello": p.Hello(2, "router-a", 4321, "host-1", 4026531836),
        "hello_min": p.Hello(1),
        "enqueue": enqueue,
        "enqueue_min": p.Enqueue("req-2", 1),
        "update_dispatched": p.Update("req-1", 5, 7, "dispatched"),
        "update_prefill_done": p.Update("req-1", 5, 7, "prefill_done"),
        "update_progress": p.Update("req-1", 5, 7, "progress", 42),
        "update_requeue": p.Update("req-1", 5, 2**32 - 1, "requeue"),
        "release": p.Release("req-1", 5, 7, "aborted", 142),
        "release_cancel_queued": p.Release("req-1", -1, 0, "cancelled"),
        "release_min": p.Release("req-1"),
        "heartbeat": p.Heartbeat(2**63 - 1, 2**63 - 2),
        "heartbeat_min": p.Heartbeat(7),
        "reattach": p.Reattach(
            [p.LeaseRef("a", 1, 2)],
            [p.Enqueue("b", 10, b"\x01" * 8)],
            [p.Requeued(p.LeaseRef("c", 3, 4), p.Enqueue("c", 20, policy_class="x"))],
        ),
        "reattach_min": p.Reattach(),
        "batch": p.Batch([raw(p.Update("req-1", 5, 7, "dispatched")), raw(enqueue), raw(p.Release("req-1"))]),
        "batch_empty": p.Batch(),
        # daemon -> router
        "welcome": p.Welcome(
            12345, 1, 2, 16, "kvsched-x-ledger", "kvsched-x-progress", 1000, 5000, 1 << 20, 2**63 - 1, "0"
        ),
        "welcome_v1": p.Welcome(1, 1, 1, 16, "kvsched-x-ledger", "kvsched-x-progress", 1000, 5000),
        "admitted": admitted,
        "admitted_min": p.Admitted("req-1", 3, 0, 5, 7, 0, 0, 0),
        "rejected": p.Rejected("req-1", "queue_full", "limit", "batch", "requests", 10, 10),
        "rejected_min": p.Rejected("req-1", "cancelled"),
        "error": p.Error(int(p.ErrorCode.UNKNOWN_REQUEST), "unknown lease", "req-1", 3),
        "error_min": p.Error(int(p.ErrorCode.MALFORMED), "bad"),
        "heartbeat_ack": p.HeartbeatAck(9),
        "reattached": p.Reattached(["a"], ["b", "c"]),
        "replies": p.Replies([raw(p.HeartbeatAck(1)), raw(admitted), raw(p.Rejected("r", "timeout"))]),
        # admin requests
        "status": p.Status(),
        "queues": p.Queues(policy_class="batch"),
        "workers": p.Workers(),
        "leases": p.Leases(worker_id=1, policy_class="batch", limit=5),
        "drain": p.Drain(worker_id=1, dp_rank=0),
        "undrain": p.Undrain(worker_id=2),
        "add_worker": p.AddWorker(
            worker_id=4,
            dp_rank=1,
            total_kv_blocks=2**40,
            max_num_batched_tokens=2048,
            kv_events_endpoint="tcp://10.0.0.4:5557",
            kv_replay_endpoint="tcp://10.0.0.4:5558",
            kv_events_topic="kv",
            kv_events_stale_after_s=12.5,
            url="http://10.0.0.4:8000",
        ),
        "add_worker_min": p.AddWorker(worker_id=4),
        "remove_worker": p.RemoveWorker(worker_id=4, dp_rank=0),
        "cancel": p.Cancel(request_id="req-1"),
        "reload": p.Reload(path="/etc/kvsched/kvsched.toml"),
        "explain": p.Explain(request_id="req-1"),
        # admin replies
        "ok": p.OkReply(message="drained 1:0"),
        "admin_error": p.AdminError(code=int(p.ErrorCode.NOT_FOUND), message="no worker 9"),
        "status_reply": p.StatusReply(
            instance="default",
            daemon_epoch=3,
            uptime_s=12.5,
            workers=2,
            active_leases=4,
            queued=5,
            deferred=1,
            decisions_total=100,
            decisions_per_s=8.25,
            connections=2,
            endpoint="ipc:///run/kvsched/default.sock",
            block_size=16,
        ),
        "queues_reply": p.QueuesReply(
            classes=[
                p.ClassRow(
                    name="batch",
                    ordering="fcfs",
                    quantum=4096,
                    depth=3,
                    deferred=1,
                    isl_tokens=900,
                    oldest_wait_s=0.25,
                    deficit=-12,
                    blocked_lanes=2,
                )
            ]
        ),
        "workers_reply": p.WorkersReply(
            workers=[
                p.WorkerRow(
                    worker_id=1,
                    dp_rank=0,
                    total_kv_blocks=8192,
                    max_num_batched_tokens=8192,
                    active_blocks=10,
                    active_prefill_tokens=300,
                    active_requests=2,
                    drained=True,
                    overloaded=False,
                    stale=True,
                    hash_mismatch=True,
                )
            ]
        ),
        "leases_reply": p.LeasesReply(
            leases=[
                p.LeaseRow(
                    request_id="req-1",
                    worker_id=1,
                    dp_rank=0,
                    slot=5,
                    generation=7,
                    policy_class="batch",
                    isl_tokens=100,
                    cached_tokens=32,
                    output_tokens=3,
                    age_s=1.5,
                    state="prefill_done",
                )
            ],
            total=9,
        ),
        "explain_reply": p.ExplainReply(
            request_id="req-1",
            chosen_worker_id=1,
            chosen_dp_rank=0,
            decided_at_s=77.5,
            rows=[
                p.ExplainRow(
                    worker_id=1,
                    dp_rank=0,
                    eligible=True,
                    overlap_blocks=2,
                    potential_blocks=9,
                    potential_prefill_tokens=68,
                    cost=1.75,
                    terms={"prefill": 1.25, "active_blocks": 0.5},
                )
            ],
            decided_by="kv",
        ),
        "explain_reply_min": p.ExplainReply(request_id="req-1", chosen_worker_id=1, chosen_dp_rank=0, decided_at_s=0.0),
    }


def _decoder(frame: object) -> msgspec.msgpack.Decoder:
    for union, make in (
        (p.RouterFrame, p.make_router_decoder),
        (p.DaemonFrame, p.make_daemon_decoder),
        (p.AdminRequest, p.make_admin_request_decoder),
        (p.AdminReply, p.make_admin_reply_decoder),
    ):
        if type(frame) in union.__args__:
            return make()
    raise AssertionError(f"{type(frame).__name__} is in no socket's union")


def _golden() -> dict[str, str]:
    return json.loads(GOLDEN.read_text())["frames"]


FRAMES = build(p)


def test_golden_file_and_builder_name_the_same_frames():
    assert set(_golden()) == set(FRAMES)


def test_every_frame_kind_of_every_socket_has_golden_bytes():
    kinds = {type(f) for f in FRAMES.values()}
    for union in (p.RouterFrame, p.DaemonFrame, p.AdminRequest, p.AdminReply):
        missing = [cls.__name__ for cls in union.__args__ if cls not in kinds]
        assert not missing, missing


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_frame_encodes_to_the_recorded_bytes(name):
    assert p.make_encoder().encode(FRAMES[name]).hex() == _golden()[name]


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_recorded_bytes_decode_to_the_same_frame(name):
    frame = FRAMES[name]
    decoded = _decoder(frame).decode(bytes.fromhex(_golden()[name]))
    assert type(decoded) is type(frame)
    assert p.make_encoder().encode(decoded) == p.make_encoder().encode(frame)
    if not isinstance(frame, (p.Batch, p.Replies)):  # their elements decode as msgspec.Raw views
        assert decoded == frame


def _record(module_file: str | None) -> None:
    """Write GOLDEN from `module_file` (a protocol module loaded on its own) or from `kvsched.protocol`."""
    mod = p
    if module_file:
        import importlib.util

        spec = importlib.util.spec_from_file_location("recorded_protocol", module_file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # msgspec resolves the structs' annotations through sys.modules
        spec.loader.exec_module(mod)
    enc = mod.make_encoder()
    frames = {name: enc.encode(frame).hex() for name, frame in sorted(build(mod).items())}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps({"source": module_file or "kvsched.protocol", "frames": frames}, indent=1) + "\n")


if __name__ == "__main__":
    if sys.argv[1:2] != ["--record"]:
        sys.exit(__doc__)
    _record(sys.argv[2] if len(sys.argv) > 2 else None)
