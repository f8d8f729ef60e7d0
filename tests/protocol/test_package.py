"""`kvsched.protocol` is a package of one module per job; users import every name from the package
itself, as they did from the single module it replaced."""

from __future__ import annotations

import pkgutil

import kvsched.protocol as p

# Every public name of the single-module `kvsched/protocol.py` (commit 727bcee): they stay importable.
SINGLE_MODULE_NAMES = (
    "PROTOCOL_VERSION",
    "PROTOCOL_MIN",
    "PROTOCOL_MAX",
    "BATCH_MIN_VERSION",
    "DEFAULT_MAX_FRAME_BYTES",
    "MAX_REQUEST_ID_BYTES",
    "MAX_BLOCK_HASHES",
    "MAX_NAME_CHARS",
    "MAX_LIST",
    "MAX_KV_BLOCKS",
    "MAX_BATCHED_TOKENS",
    "U16",
    "U32",
    "I32",
    "U63",
    "RequestId",
    "Name",
    "Tokens",
    "HashBytes",
    "Slot",
    "KvBlocks",
    "BatchedTokens",
    "WorkerKey",
    "RejectReason",
    "REJECT_REASONS",
    "UpdateKind",
    "ReleaseOutcome",
    "ErrorCode",
    "Frame",
    "Hello",
    "Enqueue",
    "Update",
    "Release",
    "Heartbeat",
    "LeaseRef",
    "Requeued",
    "Reattach",
    "Batch",
    "RouterFrame",
    "BatchedRouterFrame",
    "Welcome",
    "Admitted",
    "Rejected",
    "Error",
    "HeartbeatAck",
    "Reattached",
    "Replies",
    "DaemonFrame",
    "RepliedDaemonFrame",
    "Admin",
    "Status",
    "Queues",
    "Workers",
    "Leases",
    "Drain",
    "Undrain",
    "AddWorker",
    "RemoveWorker",
    "Cancel",
    "Reload",
    "Explain",
    "AdminRequest",
    "OkReply",
    "AdminError",
    "StatusReply",
    "ClassRow",
    "QueuesReply",
    "WorkerRow",
    "WorkersReply",
    "LeaseRow",
    "LeasesReply",
    "ExplainRow",
    "ExplainReply",
    "AdminReply",
    "DataSocketFrame",
    "make_encoder",
    "make_router_decoder",
    "make_daemon_decoder",
    "make_batched_router_decoder",
    "make_replied_daemon_decoder",
    "encode_batch",
    "encode_replies",
    "BATCH_OVERHEAD_BYTES",
    "make_admin_request_decoder",
    "make_admin_reply_decoder",
    "peek_admin_tag",
    "peek_request_id",
    "hashes_to_bytes",
    # "hashes_from_bytes" (returns a numpy array) moved to `kvsched.hashing`: the protocol needs no numpy
    "error_code_name",
)


def test_every_name_of_the_single_module_is_exported_by_the_package():
    missing = [name for name in SINGLE_MODULE_NAMES if not hasattr(p, name)]
    assert not missing, missing
    assert set(SINGLE_MODULE_NAMES) <= set(p.__all__)  # `__all__`: mypy --strict sees them as re-exports


def test_star_import_gives_every_name():
    namespace: dict[str, object] = {}
    exec("from kvsched.protocol import *", namespace)
    assert set(SINGLE_MODULE_NAMES) <= set(namespace)


def test_package_modules_are_the_ones_the_layering_test_reads():
    """tests/test_layering.py reads every module of the package from the source (its import graph):
    the ones Python finds here, no more, no fewer."""
    from tests.test_layering import MODULES

    found = {"kvsched.protocol"} | {f"kvsched.protocol.{m.name}" for m in pkgutil.iter_modules(p.__path__)}
    assert found == {m for m in MODULES if m == "kvsched.protocol" or m.startswith("kvsched.protocol.")}
