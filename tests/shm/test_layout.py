"""Segments: create / attach / validate, file modes, and survival of SIGKILLed processes
(docs/DESIGN.md §3.1, §3.3)."""

from __future__ import annotations

import hashlib
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from kvsched.errors import ShmLayoutError
from kvsched.shm import kv_index, layout
from kvsched.shm.layout import (
    H_MAGIC,
    H_VERSION,
    LAYOUT_VERSION,
    MAGIC,
    LedgerArrays,
    default_ref_capacity,
)
from kvsched.shm.segments import attach_segments, create_segments, ledger_name, progress_name, unlink_segments

CAPS = dict(max_workers=4, max_slots=16, max_blocks_per_request=8, ref_capacity=64, block_size=16)


def _create(instance, **over):
    return create_segments(instance, **{**CAPS, **over}, epoch=7)


def _shm_path(name):
    return f"/dev/shm/{name}"


def test_attach_sees_daemon_writes_when_created(instance):
    seg = _create(instance)
    seg.ledger.w_active_blocks[2] = 42
    seg.progress[3] = 99
    other = attach_segments(instance, expect=CAPS)
    assert other.ledger.epoch == 7
    assert other.ledger.w_active_blocks[2] == 42 and other.progress[3] == 99
    assert other.ledger.capacities == CAPS
    other.close()
    seg.close()


def test_client_ledger_is_read_only_when_attached_without_write(instance):
    seg = _create(instance)
    ro = attach_segments(instance)
    assert not ro.ledger.writable
    with pytest.raises(ValueError):
        ro.ledger.w_active_blocks[0] = 1
    ro.progress[0] = 5  # progress words stay writable for routers
    assert seg.progress[0] == 5
    rw = attach_segments(instance, writable_ledger=True)
    rw.ledger.epoch = 8
    assert seg.ledger.epoch == 8
    for s in (ro, rw, seg):
        s.close()


def test_create_raises_file_exists_when_segments_exist(instance):
    seg = _create(instance)
    with pytest.raises(FileExistsError):
        _create(instance)
    seg.close()


def test_file_modes_are_set_explicitly_when_created(instance):
    old = os.umask(0o077)
    try:
        seg = _create(instance)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(_shm_path(ledger_name(instance))).st_mode) == 0o640
    assert stat.S_IMODE(os.stat(_shm_path(progress_name(instance))).st_mode) == 0o660
    seg.close()


@pytest.mark.parametrize(
    "corrupt, match",
    [
        (lambda h: h.__setitem__(H_MAGIC, 123), "bad magic"),
        (lambda h: h.__setitem__(H_VERSION, LAYOUT_VERSION + 1), "layout version"),
    ],
)
def test_attach_raises_layout_error_when_header_is_wrong(instance, corrupt, match):
    seg = _create(instance)
    corrupt(seg.ledger.header)
    with pytest.raises(ShmLayoutError, match=match):
        attach_segments(instance)
    seg.close()


@pytest.mark.parametrize("key", ["max_workers", "max_slots", "max_blocks_per_request", "ref_capacity", "block_size"])
def test_attach_raises_layout_error_naming_capacity_when_it_differs(instance, key):
    seg = _create(instance)
    with pytest.raises(ShmLayoutError, match=key):
        attach_segments(instance, expect={**CAPS, key: CAPS[key] * 2})
    seg.close()


def test_attach_raises_when_missing(instance):
    with pytest.raises(FileNotFoundError):
        attach_segments(instance)


def test_unlink_ignores_missing_segments(instance):
    unlink_segments(instance)
    seg = _create(instance)
    seg.close()
    seg.unlink()
    assert not os.path.exists(_shm_path(ledger_name(instance)))
    unlink_segments(instance)


def test_private_arrays_have_layout_dtypes_and_shapes():
    a = LedgerArrays.private(3, 5, 4, 16, 8)
    assert int(a.header[H_MAGIC]) == MAGIC
    assert a.w_active_blocks.dtype == np.int64 and a.w_active_blocks.shape == (3,)
    assert a.s_request_id.dtype == np.dtype("S128") and a.s_state.shape == (5,)
    assert a.arena.shape == (20,) and a.ref_keys.shape == (3, 16) and a.ref_counts.dtype == np.int32
    for name in ("w_present", "s_generation", "arena", "ref_keys", "ref_counts"):
        assert getattr(a, name).ctypes.data % 64 == 0
    with pytest.raises(ValueError):
        LedgerArrays.private(3, 5, 4, 12, 8)  # not a power of two


def _layout_digest(offsets: dict) -> str:
    fields = sorted((name, off, dt.str, shape) for name, (off, dt, shape) in offsets.items())
    return hashlib.sha256(repr(fields).encode()).hexdigest()[:16]


def test_byte_layouts_are_the_ones_segments_already_hold():
    """The ledger's and the KV-index segment's layouts are read from their classes' annotated arrays
    (`array_fields`): every field's offset, dtype and shape, and the total size, are still the bytes of
    the layout versions existing segments hold (the digests were taken from the field tables these
    declarations replaced). A reordered, retyped, added or dropped field changes them: bump the layout
    version with it."""
    offsets, total = layout._offsets(3, 7, 5, 1024)
    assert (total, _layout_digest(offsets)) == (39872, "a7ec544bb599bbca")
    offsets, total = kv_index._layout(3, 100)
    assert (total, _layout_digest(offsets)) == (19712, "4309d3b63a927e46")
    assert LAYOUT_VERSION == 2 and kv_index.KV_INDEX_VERSION == 2
    names = [name for name, _, _ in layout.array_fields(LedgerArrays)]
    assert names[0] == "w_present" and names[-1] == "ref_counts" and len(names) == 30


def test_segment_names_have_one_home_in_segments():
    """`kvsched.shm.segments` holds the named segments (names, create / attach / unlink); the byte layout
    (`kvsched.shm.layout`, which `segments` imports) no longer answers for them: one import path, and no
    import circle between the two (tests/test_layering.py)."""
    import kvsched.shm.layout as layout
    import kvsched.shm.segments as segments

    for name in (
        "ledger_name",
        "ledger_instance",
        "progress_name",
        "kv_index_name",
        "segment_names",
        "Segments",
        "create_segments",
        "attach_segments",
        "unlink_segments",
    ):
        assert callable(getattr(segments, name)), name
        assert not hasattr(layout, name), name
    assert segments.LedgerArrays is layout.LedgerArrays  # the views segments maps are the layout's


def test_default_ref_capacity_is_clamped_power_of_two():
    assert default_ref_capacity(64, 8192, 1024) == 1 << 18
    assert default_ref_capacity(64, 1, 1) == 1024
    assert default_ref_capacity(1, 1 << 22, 1 << 20) == 1 << 20


_CHILD = textwrap.dedent(
    """
    import sys, time
    from multiprocessing import resource_tracker
    from kvsched.shm.segments import attach_segments, create_segments
    mode, instance = sys.argv[1], sys.argv[2]
    if mode == "create":
        seg = create_segments(instance, max_workers=4, max_slots=16, max_blocks_per_request=8,
                              ref_capacity=64, block_size=16, epoch=1)
    else:
        seg = attach_segments(instance, writable_ledger=(mode == "attach-rw"))
    resource_tracker.ensure_running()
    print(resource_tracker._resource_tracker._pid, flush=True)
    time.sleep(60)
    """
)


def _dead(pid):
    try:
        with open(f"/proc/{pid}/status") as fh:
            return any(line.startswith("State:") and ("Z" in line or "X" in line) for line in fh)
    except FileNotFoundError:
        return True


def _spawn_and_kill(mode, instance):
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, mode, instance], stdout=subprocess.PIPE, env=env, text=True)
    tracker_pid = int(proc.stdout.readline())
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 20
    while not _dead(tracker_pid):  # the orphaned tracker cleans up what it tracks, then exits
        assert time.monotonic() < deadline, "resource tracker did not exit"
        time.sleep(0.05)


@pytest.mark.timeout(60)
@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["attach-ro", "attach-rw"])
def test_segments_survive_when_attaching_process_is_sigkilled(instance, mode):
    """1. daemon creates the segments, 2. a client attaches, 3. SIGKILL the client and wait for its
    resource tracker to exit. Result: both segments still exist and keep their contents."""
    seg = _create(instance)
    seg.ledger.w_active_blocks[1] = 5
    _spawn_and_kill(mode, instance)
    assert os.path.exists(_shm_path(ledger_name(instance))) and os.path.exists(_shm_path(progress_name(instance)))
    again = attach_segments(instance)
    assert again.ledger.w_active_blocks[1] == 5
    again.close()
    seg.close()


@pytest.mark.timeout(60)
@pytest.mark.multiprocess
def test_segments_survive_when_creating_process_is_sigkilled(instance):
    """1. a daemon process creates the segments, 2. SIGKILL it, wait for its resource tracker to exit.
    Result: both segments still exist and validate on attach."""
    _spawn_and_kill("create", instance)
    again = attach_segments(instance, expect=CAPS)
    assert again.ledger.epoch == 1
    again.close()


@pytest.mark.timeout(60)
@pytest.mark.multiprocess
def test_survival_check_fails_when_process_does_not_unregister(instance):
    """Control for the two survival tests: 1. a process creates the segments WITHOUT unregistering
    them, 2. SIGKILL. Result: its resource tracker unlinks them — the harness can see a failure."""
    global _CHILD
    saved = _CHILD
    _CHILD = _CHILD.replace(
        "from kvsched.shm.segments import",
        "import kvsched.shm.segments as S; S._untrack = lambda shm: None; from kvsched.shm.segments import",
    )
    try:
        _spawn_and_kill("create", instance)
    finally:
        _CHILD = saved
    assert not os.path.exists(_shm_path(ledger_name(instance)))


def test_router_attach_never_talks_to_the_resource_tracker(instance, monkeypatch):
    """Routers that share one resource tracker (children of one multiprocessing parent) raced its
    register/unregister pairs and the tracker printed KeyError tracebacks: a router's attach must
    not register anything, and its state-word stores must reach the daemon's mapping."""
    from multiprocessing import resource_tracker

    seg = _create(instance)
    calls = []
    monkeypatch.setattr(resource_tracker, "register", lambda *a: calls.append(("register", a)))
    monkeypatch.setattr(resource_tracker, "unregister", lambda *a: calls.append(("unregister", a)))
    router = attach_segments(instance, writable_ledger=False)
    try:
        router.state[3] = 5
        router.progress[3] = 9
        assert (seg.state[3], seg.progress[3]) == (5, 9)
        assert router.ledger.max_slots == seg.ledger.max_slots
    finally:
        router.close()
        seg.close()
    assert calls == []
