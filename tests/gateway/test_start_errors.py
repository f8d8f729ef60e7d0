"""Bad start-up input of `kvsched-gateway` and `kvsched-sim-engine`: one clear message naming the flag or
key, exit 2, no traceback (docs/GATEWAY.md: exit 2 for a bad config).

Found by a new user: a missing `chat_template` file (FileNotFoundError), `--log-level bogus`
(ValueError) and `--ready-file` in a missing directory ended in tracebacks (with `--workers 2` a
misleading "cannot bind 127.0.0.1:P: [Errno 2] No such file or directory"); `kvsched-sim-engine`
with its HTTP or KV-event port taken, a missing tokenizer directory or `--block-size 0` too.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from kvsched.gateway.local_fleet import write_tiny_tokenizer

pytestmark = pytest.mark.timeout(180)


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120)


def _assert_exit_2(proc: subprocess.CompletedProcess, *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, (needle, proc.stderr)


def _gateway_config(tmp_path, model_extra: str = "") -> str:
    tok = write_tiny_tokenizer(tmp_path / "tok")
    cfg = tmp_path / "gateway.toml"
    cfg.write_text(
        f'[gateway]\nport = 0\ndaemon_endpoint = "ipc://{tmp_path}/absent.sock"\n'
        "connect_timeout_s = 30\n\n"
        f'[[models]]\nname = "tiny"\ntokenizer_dir = "{tok}"\n{model_extra}\n'
    )
    return str(cfg)


@pytest.mark.parametrize("workers", ["1", "2"])
def test_gateway_with_a_missing_chat_template_file_exits_2_naming_the_key(tmp_path, workers):
    cfg = _gateway_config(tmp_path, 'chat_template = "/nonexist.jinja"')
    proc = _run(["kvsched.gateway", "--config", cfg, "--workers", workers])
    _assert_exit_2(proc, "[[models]] name = 'tiny'", "chat_template = '/nonexist.jinja'", "No such file")
    # one line, from the supervisor (was: the same line from each worker, and the group's ERROR line)
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvsched-gateway:"), proc.stderr


def test_gateway_with_a_chat_template_that_does_not_compile_exits_2_naming_that_file(tmp_path):
    """Was: the message named the tokenizer directory ("...: /tmp/x/tok: chat template does not
    compile"), not the `chat_template` file that held the error."""
    bad = tmp_path / "bin.jinja"
    bad.write_text("{% for %}")
    cfg = _gateway_config(tmp_path, f'chat_template = "{bad}"')
    proc = _run(["kvsched.gateway", "--config", cfg])
    _assert_exit_2(proc, "[[models]] name = 'tiny'", f"chat_template = '{bad}': chat template does not compile")
    assert f"{tmp_path / 'tok'}:" not in proc.stderr, proc.stderr


def test_gateway_with_a_missing_tokenizer_directory_exits_2_naming_the_model(tmp_path):
    cfg = _gateway_config(tmp_path)
    with open(cfg, "a") as fh:
        fh.write(f'\n[[models]]\nname = "other"\ntokenizer_dir = "{tmp_path}/nosuchdir"\n')
    _assert_exit_2(
        _run(["kvsched.gateway", "--config", cfg]), "[[models]] name = 'other'", "nosuchdir", "no such directory"
    )


@pytest.mark.parametrize(
    "extra, needles",
    [
        (["--log-level", "bogus"], ["argument --log-level: unknown log level 'bogus'"]),
        (["--ready-file", "/nonexistent/dir/port"], ["argument --ready-file:", "'/nonexistent/dir' does not exist"]),
        (["--ready-file", "/nonexistent/dir/port", "--workers", "2"], ["argument --ready-file:", "does not exist"]),
    ],
)
def test_gateway_bad_flag_exits_2_naming_it(tmp_path, extra, needles):
    proc = _run(["kvsched.gateway", "--config", _gateway_config(tmp_path), *extra])
    _assert_exit_2(proc, *needles)
    assert "cannot bind" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("value", ["300", "-1"])
def test_gateway_workers_flag_outside_the_configs_bound_exits_2_before_reading_the_config(value):
    """Found by a new user: `--workers 300` forked 300 processes (the config caps `workers` at 256).
    The flag is checked by argparse, so the (missing) config is never read and nothing is forked."""
    proc = _run(["kvsched.gateway", "--config", "/nonexistent/gateway.toml", "--workers", value])
    _assert_exit_2(proc, f"argument --workers: must be in [0, 256], got {value}")


@pytest.mark.parametrize(
    "host, needle",
    [
        ("", "argument --host: empty; give an address"),  # was silently ignored (the config's host used)
        ("[127.0.0.1]", "argument --host: '[127.0.0.1]': brackets hold an IPv6 address"),
    ],
)
def test_gateway_empty_or_wrongly_bracketed_host_exits_2_naming_the_flag(tmp_path, host, needle):
    _assert_exit_2(_run(["kvsched.gateway", "--config", _gateway_config(tmp_path), "--host", host]), needle)


def test_gateway_host_in_brackets_is_the_ipv6_address_inside(tmp_path):
    """Was: `--host "[::1]"` -> "cannot listen on [[::1]]:P" (the brackets kept as part of the name).
    With the port taken on ::1 the message now names [::1]:P and the port conflict, so ::1 was bound."""
    try:
        held = socket.create_server(("::1", 0), family=socket.AF_INET6)
    except OSError as exc:
        pytest.skip(f"no IPv6 loopback here: {exc}")
    with held:
        port = held.getsockname()[1]
        proc = _run(["kvsched.gateway", "--config", _gateway_config(tmp_path), "--host", "[::1]", "--port", str(port)])
    _assert_exit_2(proc, f"cannot listen on [::1]:{port}: the port is already in use")
    assert "[[" not in proc.stderr, proc.stderr


def _sim_argv(tmp_path, *extra: str, port: int = 0, tokenizer: str | None = None) -> list[str]:
    tok = tokenizer or str(write_tiny_tokenizer(tmp_path / "tok"))
    return [
        "kvsched.sim.http_engine",
        "--worker-id",
        "1",
        "--port",
        str(port),
        "--tokenizer",
        tok,
        "--log-level",
        "WARNING",
        *extra,
    ]


def test_sim_engine_with_its_http_port_taken_exits_2_naming_port(tmp_path, taken_port):
    _assert_exit_2(
        _run(_sim_argv(tmp_path, port=taken_port)), f"--port {taken_port}: cannot listen on", "already in use"
    )


def test_sim_engine_with_its_kv_events_port_taken_exits_2_naming_it(tmp_path, taken_port):
    _assert_exit_2(
        _run(_sim_argv(tmp_path, "--kv-events-port", str(taken_port))),
        f"--kv-events-port {taken_port}",
        "--kv-replay-port",
        "Address already in use",
    )


def test_sim_engine_with_its_kv_replay_port_taken_exits_2_naming_it(tmp_path, taken_port):
    with socket.create_server(("127.0.0.1", 0)) as pub:
        free = pub.getsockname()[1]
    proc = _run(_sim_argv(tmp_path, "--kv-events-port", str(free), "--kv-replay-port", str(taken_port)))
    _assert_exit_2(proc, f"--kv-replay-port {taken_port}", "Address already in use")


def test_sim_engine_with_a_missing_tokenizer_directory_exits_2_naming_the_flag(tmp_path):
    proc = _run(_sim_argv(tmp_path, tokenizer=str(tmp_path / "nosuchdir")))
    _assert_exit_2(proc, "--tokenizer:", "nosuchdir", "no such directory")


@pytest.mark.parametrize("flag", ["--block-size", "--total-kv-blocks", "--max-num-batched-tokens"])
def test_sim_engine_with_a_zero_size_exits_2_naming_the_flag(tmp_path, flag):
    _assert_exit_2(_run(_sim_argv(tmp_path, flag, "0")), f"argument {flag}: must be >= 1, got 0")


def test_sim_engine_bad_log_level_exits_2_naming_the_flag(tmp_path):
    proc = _run([*_sim_argv(tmp_path), "--log-level", "bogus"])
    _assert_exit_2(proc, "argument --log-level: unknown log level 'bogus'")
