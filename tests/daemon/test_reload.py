"""Live reload of the scheduling profile (docs/DESIGN.md §4.16) against a real daemon."""

from __future__ import annotations

import asyncio

import pytest

from kvsched import protocol as p
from kvsched.client import AdminClient, SchedulerClient
from tests.conftest import purge, start_daemon, wait_until

pytestmark = pytest.mark.timeout(90)

BASE = """
default_class = "a"

[daemon]
block_size = 16

[[workers]]
worker_id = 1
max_num_batched_tokens = 1000

[[classes]]
name = "a"
quantum = 100
prefill_busy_threshold = 500
"""


def test_reload_keeps_queued_requests_and_refuses_invalid_files(tmp_path):
    """1. one lease makes the only worker busy and 20 requests queue in class `a`, 2. reload with a
    new quantum and an added class `b`, 3. reload an invalid file, 4. reload a file without `a`.
    Result: 2 applies and every queued request survives; 3 and 4 are refused and the old profile is
    kept; releasing the lease dispatches all 20."""
    d = start_daemon(tmp_path, BASE)
    instance = d.instance
    cfg = tmp_path / f"{instance}.toml"

    async def scenario() -> None:
        async with SchedulerClient(d.endpoint) as client:
            first = await client.schedule("hold", isl_tokens=800)
            waiting = [asyncio.create_task(client.schedule(f"q{i}", isl_tokens=10)) for i in range(20)]
            admin = AdminClient(d.admin_endpoint)
            assert await asyncio.to_thread(wait_until, lambda: admin.call(p.Queues()).classes[0].depth == 20, 30)

            cfg.write_text(BASE.replace("quantum = 100", "quantum = 300") + '\n[[classes]]\nname = "b"\n')
            reply = admin.call(p.Reload())
            assert isinstance(reply, p.OkReply), reply
            rows = {c.name: c for c in admin.call(p.Queues()).classes}
            assert rows["a"].quantum == 300 and rows["a"].depth == 20 and "b" in rows

            cfg.write_text("this is [not toml")
            bad = admin.call(p.Reload())
            assert isinstance(bad, p.AdminError) and "old profile kept" in bad.message
            cfg.write_text(
                BASE.replace('name = "a"', 'name = "z"').replace('default_class = "a"', 'default_class = "z"')
            )
            gone = admin.call(p.Reload())
            assert isinstance(gone, p.AdminError) and "a" in gone.message
            rows = {c.name: c for c in admin.call(p.Queues()).classes}
            assert rows["a"].quantum == 300 and rows["a"].depth == 20  # old profile kept

            first.prefill_done()
            first.release()
            leases = await asyncio.wait_for(asyncio.gather(*waiting), 10)
            assert len(leases) == 20
            for lease in leases:
                lease.release()
            admin.close()

    try:
        asyncio.run(scenario())
    finally:
        d.stop()
        purge(instance)


def test_reload_rebuilds_the_selector_for_every_changed_selector_key(tmp_path):
    """Was: a reload changing `[selector] type` / the `kv` weights replied "reloaded" and kept the old
    selector in silence. Now the selector is rebuilt: the reply names the changed keys, and the next
    decision is the new selector's (`explain` says which); keys read per decision (prefill_load_scale,
    overlap_credit) apply without a rebuild."""
    d = start_daemon(tmp_path, BASE)
    instance = d.instance
    cfg = tmp_path / f"{instance}.toml"

    async def decide(rid: str) -> p.ExplainReply:
        async with SchedulerClient(d.endpoint) as client:
            lease = await client.schedule(rid, isl_tokens=32)
            lease.release()
        return admin.call(p.Explain(request_id=rid))

    try:
        admin = AdminClient(d.admin_endpoint)
        assert asyncio.run(decide("r0")).decided_by == "kv"
        cfg.write_text(BASE + "\n[selector]\nprefill_load_scale = 2.0\noverlap_credit = 0.5\n")
        same = admin.call(p.Reload())
        assert isinstance(same, p.OkReply) and "rebuilt" not in same.message, same
        cfg.write_text(BASE + "\n[selector]\ntype = 'round_robin'\nprefill_weight = 4.0\nprefill_load_scale = 3.0\n")
        reply = admin.call(p.Reload())
        assert isinstance(reply, p.OkReply), reply
        assert "selector rebuilt (round_robin)" in reply.message
        assert "selector.type" in reply.message and "selector.prefill_weight" in reply.message
        assert "prefill_load_scale" not in reply.message
        assert asyncio.run(decide("r1")).decided_by == "round_robin"
        again = admin.call(p.Reload())  # the same file again: nothing left to rebuild
        assert isinstance(again, p.OkReply) and "rebuilt" not in again.message, again
        admin.close()
    finally:
        d.stop()
        purge(instance)


def test_reload_names_the_keys_it_cannot_apply_without_a_restart(tmp_path):
    """Found from outside: a reload changing `[daemon] block_size` or adding a `[[workers]]` entry
    replied "reloaded" and applied neither, in silence (an operator editing a worker's url and
    running `systemctl reload` thought it worked). Result: the reply and the log name what needs a
    restart (or `add-worker` / `remove-worker`); the profile part still applies; the same file again
    names them again (they are still not applied)."""
    d = start_daemon(tmp_path, BASE)
    instance = d.instance
    cfg = tmp_path / f"{instance}.toml"
    try:
        admin = AdminClient(d.admin_endpoint)
        changed = BASE.replace("block_size = 16", "block_size = 32").replace("quantum = 100", "quantum = 300")
        cfg.write_text(changed + "\n[[workers]]\nworker_id = 9\nmax_num_batched_tokens = 1000\n")
        reply = admin.call(p.Reload())
        assert isinstance(reply, p.OkReply), reply
        assert "not applied" in reply.message and "daemon.block_size" in reply.message, reply.message
        assert "workers (added 9)" in reply.message, reply.message
        assert admin.call(p.Status()).block_size == 16
        again = admin.call(p.Reload())
        assert "daemon.block_size" in again.message, again.message
        cfg.write_text(BASE)
        back = admin.call(p.Reload())
        assert isinstance(back, p.OkReply) and "not applied" not in back.message, back.message
        assert "restart" in d.log_path.read_text()
        admin.close()
    finally:
        d.stop()
        purge(instance)


def test_reload_of_an_unchanged_file_names_nothing_when_workers_came_from_the_command_line(tmp_path):
    """Found from outside: a daemon started with `--workers 2` (the README's form, no [[workers]] in
    the file) answered every reload of the unchanged file `not applied ...: workers (removed 0, 1)`
    and logged a WARNING. Result: a key the reloaded file does not set is not compared."""
    d = start_daemon(
        tmp_path, BASE.split("[[workers]]")[0] + '[[classes]]\nname = "a"\n', extra_args=["--workers", "2"]
    )
    try:
        with AdminClient(d.admin_endpoint) as admin:
            assert admin.call(p.Status()).workers == 2
            reply = admin.call(p.Reload())
        assert isinstance(reply, p.OkReply) and "not applied" not in reply.message, reply.message
        assert "need a restart" not in d.log_path.read_text()
    finally:
        d.stop()
        purge(d.instance)


def test_reload_of_a_profile_file_names_only_the_restart_keys_it_sets(tmp_path):
    """Found from outside: reloading a profile-only file (`default_class` / [[classes]], what
    `kvsched reload --help` calls a profile file) on a daemon started from a full config named
    `daemon.instance, daemon.endpoint, ..., workers (removed 1)` (every key the profile leaves at
    its default). Result: nothing is named for a
    profile file; a file that does set a restart-only key to another value names that key only."""
    d = start_daemon(tmp_path, BASE.replace("block_size = 16", "block_size = 16\nmax_slots = 4096"))
    profile = tmp_path / "profile.toml"
    profile.write_text('default_class = "a"\n[[classes]]\nname = "a"\nquantum = 300\n')
    try:
        with AdminClient(d.admin_endpoint) as admin:
            reply = admin.call(p.Reload(path=str(profile)))
            assert isinstance(reply, p.OkReply) and "not applied" not in reply.message, reply.message
            profile.write_text('default_class = "a"\n[daemon]\nblock_size = 32\n[[classes]]\nname = "a"\n')
            reply = admin.call(p.Reload(path=str(profile)))
        assert isinstance(reply, p.OkReply), reply
        assert reply.message.endswith(
            "not applied (need a restart; workers also via add-worker / remove-worker): daemon.block_size"
        ), reply.message
    finally:
        d.stop()
        purge(d.instance)


def test_reload_of_a_profile_file_keeps_the_running_selector(tmp_path):
    """Found in review: a profile-only file (no [selector] key) reset the selector to the defaults,
    e.g. a daemon started with `type = 'round_robin'` went back to `kv` on `kvsched reload
    profile.toml`. The selector is taken from the file only when it sets a [selector] key."""
    d = start_daemon(tmp_path, BASE + "\n[selector]\ntype = 'round_robin'\n")
    profile = tmp_path / "profile.toml"
    profile.write_text('default_class = "a"\n[[classes]]\nname = "a"\nquantum = 300\n')

    async def decide(rid: str) -> str:
        async with SchedulerClient(d.endpoint) as client:
            lease = await client.schedule(rid, isl_tokens=32)
            lease.release()
        with AdminClient(d.admin_endpoint) as admin:
            return admin.call(p.Explain(request_id=rid)).decided_by

    try:
        assert asyncio.run(decide("p0")) == "round_robin"
        with AdminClient(d.admin_endpoint) as admin:
            reply = admin.call(p.Reload(path=str(profile)))
        assert isinstance(reply, p.OkReply) and "rebuilt" not in reply.message, reply
        assert asyncio.run(decide("p1")) == "round_robin"
    finally:
        d.stop()
        purge(d.instance)


def test_a_selector_environment_variable_does_not_make_a_profile_reload_reset_the_selector(tmp_path, monkeypatch):
    """Found from outside: with KVSCHED_SELECTOR_SEED set (e.g. a systemd Environment= line), the
    environment counted as "the reload sets [selector]", so a profile-only reload rebuilt the selector
    from the defaults (prefill_weight 3.0 -> 16). Only the file's own keys decide."""
    monkeypatch.setenv("KVSCHED_SELECTOR_SEED", "7")
    d = start_daemon(tmp_path, BASE + "\n[selector]\ntype = 'kv'\nprefill_weight = 3.0\n")
    profile = tmp_path / "profile.toml"
    profile.write_text('default_class = "a"\n[[classes]]\nname = "a"\nquantum = 300\n')
    try:
        with AdminClient(d.admin_endpoint) as admin:
            reply = admin.call(p.Reload(path=str(profile)))
        assert isinstance(reply, p.OkReply) and "rebuilt" not in reply.message, reply
    finally:
        d.stop()
        purge(d.instance)
