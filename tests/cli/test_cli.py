"""Every admin CLI command against a real daemon: tables render, --json parses, exit codes."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from kvsched.cli import EXIT_DAEMON_ERROR, EXIT_OK, EXIT_UNREACHABLE, app

pytestmark = pytest.mark.timeout(60)
runner = CliRunner()


def run(daemon, *args: str):
    return runner.invoke(app, ["--admin-endpoint", daemon.admin_endpoint, *args])


@pytest.mark.parametrize("command", ["status", "queues", "workers", "leases"])
def test_read_command_prints_table_and_json_when_daemon_runs(session_daemon, command):
    table = run(session_daemon, command)
    assert table.exit_code == EXIT_OK, table.output
    assert "─" in table.output or "━" in table.output
    as_json = run(session_daemon, command, "--json")
    assert as_json.exit_code == EXIT_OK
    assert json.loads(as_json.output)["t"].endswith("_reply")


def test_workers_json_lists_configured_workers(session_daemon):
    out = json.loads(run(session_daemon, "workers", "--json").output)
    assert sorted((w["worker_id"], w["dp_rank"]) for w in out["workers"]) == [(1, 0), (2, 0)]


def test_drain_and_undrain_flip_the_worker_flag(session_daemon):
    assert run(session_daemon, "drain", "2").exit_code == EXIT_OK
    rows = {w["worker_id"]: w for w in json.loads(run(session_daemon, "workers", "--json").output)["workers"]}
    assert rows[2].get("drained") is True
    assert run(session_daemon, "undrain", "2:0").exit_code == EXIT_OK
    rows = {w["worker_id"]: w for w in json.loads(run(session_daemon, "workers", "--json").output)["workers"]}
    assert not rows[2].get("drained", False)


def test_add_and_remove_worker_change_the_worker_list(session_daemon):
    assert run(session_daemon, "add-worker", "9", "--total-kv-blocks", "100").exit_code == EXIT_OK
    ids = {w["worker_id"] for w in json.loads(run(session_daemon, "workers", "--json").output)["workers"]}
    assert 9 in ids
    assert run(session_daemon, "remove-worker", "9").exit_code == EXIT_OK
    ids = {w["worker_id"] for w in json.loads(run(session_daemon, "workers", "--json").output)["workers"]}
    assert 9 not in ids


def test_unknown_things_exit_with_daemon_error(session_daemon):
    assert run(session_daemon, "cancel", "no-such-request").exit_code == EXIT_DAEMON_ERROR
    assert run(session_daemon, "explain", "no-such-request").exit_code == EXIT_DAEMON_ERROR
    assert run(session_daemon, "drain", "4242").exit_code == EXIT_DAEMON_ERROR


def test_bad_worker_spec_is_a_usage_error(session_daemon):
    assert run(session_daemon, "drain", "x:y").exit_code == 2


def test_unreachable_daemon_exits_3_naming_the_endpoint(tmp_path):
    endpoint = f"ipc://{tmp_path}/absent-admin.sock"
    result = runner.invoke(app, ["--admin-endpoint", endpoint, "--timeout-s", "0.3", "status"])
    assert result.exit_code == EXIT_UNREACHABLE
    assert "absent-admin.sock" in result.output


def test_top_renders_once(session_daemon):
    result = run(session_daemon, "top", "--iterations", "1")
    assert result.exit_code == EXIT_OK
    assert "queues" in result.output and "workers" in result.output


def test_explain_cancel_and_reload_succeed_against_a_live_daemon(tmp_path):
    import asyncio

    from kvsched import protocol as p
    from kvsched.client import AdminClient, SchedulerClient
    from tests.conftest import purge, start_daemon, wait_until

    cfg_text = (
        "[daemon]\nblock_size = 16\n[[workers]]\nworker_id = 1\nmax_num_batched_tokens = 100\n"
        "[[classes]]\nname = 'default'\nprefill_busy_threshold = 100\n"
    )
    d = start_daemon(tmp_path, cfg_text)
    instance = d.instance
    try:

        async def scenario() -> None:
            async with SchedulerClient(d.endpoint) as client:
                lease = await client.schedule("cli-held", isl_tokens=200, block_hashes=[1, 2])
                waiting = asyncio.create_task(client.schedule("cli-waiting", isl_tokens=10))

                def queued() -> bool:
                    with AdminClient(d.admin_endpoint) as admin:
                        return sum(c.depth for c in admin.call(p.Queues()).classes) == 1

                assert await asyncio.to_thread(wait_until, queued, 30)  # cancel finds it waiting
                explained = await asyncio.to_thread(run, d, "explain", "cli-held", "--json")
                assert explained.exit_code == EXIT_OK
                rows = json.loads(explained.output)["rows"]
                assert rows[0]["worker_id"] == 1 and rows[0]["eligible"] is True
                table = await asyncio.to_thread(run, d, "explain", "cli-held")
                assert "chose 1:0" in table.output
                cancelled = await asyncio.to_thread(run, d, "cancel", "cli-waiting")
                assert cancelled.exit_code == EXIT_OK and "cancelled cli-waiting" in cancelled.output
                from kvsched.errors import RequestCancelled

                try:
                    await asyncio.wait_for(waiting, 30)
                    raise AssertionError("the cancelled request was admitted")
                except RequestCancelled:
                    pass
                lease.release()

        asyncio.run(scenario())
        cfg = tmp_path / f"{instance}.toml"
        cfg.write_text(cfg_text.replace("prefill_busy_threshold = 100", "prefill_busy_threshold = 100\nquantum = 77"))
        reloaded = run(d, "reload")
        assert reloaded.exit_code == EXIT_OK and "reloaded" in reloaded.output
        assert json.loads(run(d, "queues", "--json").output)["classes"][0]["quantum"] == 77
        cfg.write_text("not = [toml")
        assert run(d, "reload").exit_code == EXIT_DAEMON_ERROR
    finally:
        d.stop()
        purge(instance)
