"""A start killed while creating the segments (between creating the ledger and writing its header)
leaves a ledger with magic 0, with or without its progress segment. The next start replaces it (it
holds no lease) instead of refusing with "bad magic ... run --purge"; a ledger with a valid header
but other capacities is still refused (it may hold leases)."""

from __future__ import annotations

import logging
import os
from multiprocessing.shared_memory import SharedMemory

import pytest

from kvsched import protocol as p
from kvsched.config import load_config
from kvsched.daemon.process import DaemonProcess
from kvsched.daemon.wiring import open_segments, segment_capacities
from kvsched.errors import ShmLayoutError
from kvsched.shm.layout import MAGIC, LedgerArrays, progress_nbytes
from kvsched.shm.segments import _untrack, create_segments, ledger_name, progress_name, unlink_segments
from tests.conftest import admin_call, purge, unique_instance, write_config

SMALL = {"max_workers": 4, "max_slots": 16, "max_blocks_per_request": 8}


def _cfg(instance: str, **daemon):
    return load_config(None, env={}, overrides={"daemon": {"instance": instance, **SMALL, **daemon}})


def _raw_segment(name: str, size: int) -> None:
    """Create segment `name` of `size` zero bytes and leave it (what a killed creator leaves)."""
    shm = SharedMemory(name=name, create=True, size=size) if size else None
    if shm is None:  # size 0: killed before ftruncate; SharedMemory refuses size 0, so open the file
        os.close(os.open(f"/dev/shm/{name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
        return
    _untrack(shm)
    shm.close()


def _half_created(instance: str, *, with_progress: bool, ledger_bytes: int | None = None) -> None:
    caps = segment_capacities(_cfg(instance))
    n = LedgerArrays.nbytes(
        caps["max_workers"], caps["max_slots"], caps["max_blocks_per_request"], caps["ref_capacity"]
    )
    _raw_segment(ledger_name(instance), n if ledger_bytes is None else ledger_bytes)
    if with_progress:
        _raw_segment(progress_name(instance), progress_nbytes(caps["max_slots"]))


@pytest.mark.parametrize("with_progress", [False, True], ids=["ledger-only", "ledger+progress"])
@pytest.mark.parametrize("ledger_bytes", [None, 0], ids=["full-size", "empty"])
def test_start_replaces_a_ledger_whose_header_was_never_written(with_progress, ledger_bytes, caplog):
    instance = unique_instance("half")
    _half_created(instance, with_progress=with_progress, ledger_bytes=ledger_bytes)
    try:
        with caplog.at_level(logging.INFO, logger="kvsched"):
            segs, restarted = open_segments(_cfg(instance))
        try:
            assert restarted is False  # created afresh, not re-attached
            assert int(segs.ledger.header[0]) == MAGIC
            assert segs.ledger.capacities["max_slots"] == SMALL["max_slots"]
        finally:
            segs.close()
        msgs = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert any("header was never written" in m and ledger_name(instance) in m for m in msgs), msgs
    finally:
        unlink_segments(instance)


def test_start_still_refuses_a_valid_ledger_with_other_capacities():
    instance = unique_instance("half")
    create_segments(instance, max_workers=4, max_slots=32, max_blocks_per_request=8, block_size=16, epoch=1).close()
    try:
        with pytest.raises(ShmLayoutError, match=r"(?s)max_slots=32 in the segment.*--purge"):
            open_segments(_cfg(instance))
    finally:
        unlink_segments(instance)


def test_ledger_uninitialised_only_for_a_header_never_written():
    from kvsched.shm.segments import ledger_uninitialised

    instance = unique_instance("half")
    assert not ledger_uninitialised(instance)  # absent
    _half_created(instance, with_progress=False)
    try:
        assert ledger_uninitialised(instance)
    finally:
        unlink_segments(instance)
    create_segments(instance, **SMALL, block_size=16, epoch=1).close()
    try:
        assert not ledger_uninitialised(instance)  # a written header
    finally:
        unlink_segments(instance)


def test_daemon_process_starts_over_a_half_created_ledger(tmp_path):
    """The real daemon (default capacities) starts over the state a SIGKILL mid-creation leaves."""
    instance = unique_instance("half")
    cfg = write_config(tmp_path / "d.toml", "[[workers]]\nworker_id = 1\n")
    caps = segment_capacities(load_config(cfg, env={}, overrides={"daemon": {"instance": instance}}))
    n = LedgerArrays.nbytes(
        caps["max_workers"], caps["max_slots"], caps["max_blocks_per_request"], caps["ref_capacity"]
    )
    _raw_segment(ledger_name(instance), n)  # no progress segment, header unwritten
    try:
        d = DaemonProcess.start(cfg, instance=instance, runtime_dir=tmp_path, ready_timeout_s=60)
        try:
            assert admin_call(d, p.Status()).workers == 1
        finally:
            d.stop()
    finally:
        purge(instance)


@pytest.mark.parametrize("restore", [True, False], ids=["restart", "fresh"])
def test_an_empty_kv_index_segment_is_recreated_not_a_start_failure(restore):
    """Found from outside: a SIGKILL between the KV-index segment's shm_open and its ftruncate left an
    empty segment, and every later start failed with `ValueError: cannot mmap an empty file`."""
    from kvsched.shm.kv_index import kv_index_name, open_kv_index

    instance = unique_instance("half")
    _raw_segment(kv_index_name(instance), 0)
    try:
        seg, restored = open_kv_index(instance, 4, 1024, restore=restore)
        try:
            assert restored is False
            assert os.path.getsize(f"/dev/shm/{kv_index_name(instance)}") > 0
        finally:
            seg.close()
    finally:
        unlink_segments(instance)
        assert not os.path.exists(f"/dev/shm/{kv_index_name(instance)}")
