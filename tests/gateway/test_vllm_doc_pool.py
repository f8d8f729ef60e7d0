"""docs/VLLM.md's pool, run as written: its two TOML blocks (daemon and gateway), parsed out of the
page, with simulated engines started as its engine command says (`PYTHONHASHSEED=<S>` there is
`kvsched-sim-engine --hash-seed <S>` here), a real daemon and a real gateway process. Only addresses
change: the page's hosts and ports become free loopback ports, its tokenizer directory a tiny local
one. The daemon's hash check must find no mismatch and an identical second prompt must be credited
from the engine's KV events.

Regression: the page's daemon block had no `kv_hash_seed` while its gateway block had
`hash_seed = "0"`: overlap worked, but `kvsched workers` showed `hashes = MISMATCH` for every engine
(the daemon checked the events with vLLM's default seed). The daemon's `kv_hash_seed` is now the one
setting; routers take it from the daemon's `Welcome`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
import urllib.request
from pathlib import Path

import pytest

from kvsched.config import SelectorConfig
from kvsched.core.overlap_view import SPECULATIVE_TTL_FRACTION
from kvsched.daemon.process import DaemonProcess
from kvsched.gateway.local_fleet import write_tiny_tokenizer
from tests.conftest import free_port, purge, unique_instance, wait_until

from .helpers import words

pytestmark = pytest.mark.timeout(240)
DOC = Path(__file__).resolve().parents[2] / "docs" / "VLLM.md"
ADDRESS = re.compile(r"\b\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}:\d+\b")


def doc_blocks() -> tuple[str, str, str]:
    """(engine command, daemon TOML, gateway TOML) of docs/VLLM.md: the bash block that runs
    `vllm serve`, the TOML block with `[[workers]]` and the one with `[gateway]` (exactly one each)."""
    text = DOC.read_text()
    bash = [b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "vllm serve" in b]
    tomls = re.findall(r"```toml\n(.*?)```", text, re.S)
    daemon = [b for b in tomls if "[[workers]]" in b]
    gateway = [b for b in tomls if "[gateway]" in b]
    assert len(bash) == 1 and len(daemon) == 1 and len(gateway) == 1, "docs/VLLM.md: expected one of each block"
    return bash[0], daemon[0], gateway[0]


def free_port_run(n: int) -> int:
    """The first of `n` consecutive TCP ports on 127.0.0.1 that were all free a moment ago (a
    data-parallel engine binds port + rank)."""
    for _ in range(200):
        socks: list[socket.socket] = []
        try:
            first = socket.create_server(("127.0.0.1", 0))
            socks.append(first)
            base = first.getsockname()[1]
            for r in range(1, n):
                socks.append(socket.create_server(("127.0.0.1", base + r)))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def localize(daemon_toml: str) -> tuple[str, list[dict]]:
    """The daemon block with every HOST:PORT of its workers moved to a free 127.0.0.1 port (a run of
    `dp_size` ports for the KV-event endpoints, which ranks use as port + rank), and the workers as
    parsed from the result."""
    moved: dict[str, str] = {}
    for w in tomllib.loads(daemon_toml)["workers"]:
        dp = w.get("dp_size", 1)
        for key, n in (("url", 1), ("kv_events_endpoint", dp), ("kv_replay_endpoint", dp)):
            old = ADDRESS.search(w[key]).group(0)
            assert old not in moved, f"docs/VLLM.md: {old} used twice"
            moved[old] = f"127.0.0.1:{free_port_run(n)}"
    text = ADDRESS.sub(lambda m: moved[m.group(0)], daemon_toml)
    return text, tomllib.loads(text)["workers"]


def port_of(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def cli_json(admin_endpoint: str, *args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "kvsched.cli", "--admin-endpoint", admin_endpoint, *args, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def chat(url: str, model: str, content: str) -> dict:
    body = json.dumps({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": content}]})
    req = urllib.request.Request(url + "/v1/chat/completions", body.encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def test_the_vllm_doc_pool_hashes_as_its_engines_do(tmp_path):
    bash, daemon_toml, gateway_toml = doc_blocks()
    seed = re.search(r"PYTHONHASHSEED=(\S+) vllm serve", bash).group(1)
    daemon_toml, workers = localize(daemon_toml)
    block_size = tomllib.loads(daemon_toml)["daemon"]["block_size"]
    tok_dir = write_tiny_tokenizer(tmp_path / "tokenizer")
    gateway_toml = re.sub(r'(?m)^tokenizer_dir = "[^"]*"', f'tokenizer_dir = "{tok_dir}"', gateway_toml)
    model = tomllib.loads(gateway_toml)["models"][0]["name"]
    (tmp_path / "daemon.toml").write_text(daemon_toml)
    (tmp_path / "gateway.toml").write_text(gateway_toml)

    procs: list[subprocess.Popen] = []
    daemon = None
    instance = unique_instance("vllmdoc")

    def spawn(argv: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        with open(tmp_path / f"{name}.log", "ab") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen(
                [sys.executable, "-m", *argv], stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env
            )
        procs.append(proc)
        return proc

    def ready(name: str) -> int:
        path = tmp_path / f"{name}.port"
        assert wait_until(lambda: path.exists() and path.read_text().strip() != "", timeout_s=90, interval_s=0.1), (
            tmp_path / f"{name}.log"
        ).read_text()[-3000:]
        return int(path.read_text())

    try:
        # One engine process per rank, as vLLM's: rank r publishes on the configured ports + r. A
        # request the gateway sends to a multi-rank engine's URL reaches its rank 0 process here.
        for w in workers:
            for rank in range(w.get("dp_size", 1)):
                name = f"engine-{w['worker_id']}-{rank}"
                spawn(
                    [
                        "kvsched.sim.http_engine",
                        "--worker-id",
                        str(w["worker_id"]),
                        "--dp-rank",
                        str(rank),
                        "--port",
                        str(port_of(w["url"]) if rank == 0 else 0),
                        "--tokenizer",
                        str(tok_dir),
                        "--model",
                        model,
                        "--block-size",
                        str(block_size),
                        "--hash-seed",
                        seed,
                        "--total-kv-blocks",
                        str(w["total_kv_blocks"]),
                        "--max-num-batched-tokens",
                        str(w["max_num_batched_tokens"]),
                        "--kv-events-port",
                        str(port_of(w["kv_events_endpoint"]) + rank),
                        "--kv-replay-port",
                        str(port_of(w["kv_replay_endpoint"]) + rank),
                        "--kv-events-topic",
                        w["kv_events_topic"],
                        "--speedup",
                        "20",
                        "--ready-file",
                        str(tmp_path / f"{name}.port"),
                        "--log-level",
                        "WARNING",
                    ],
                    name,
                )
        for w in workers:
            for rank in range(w.get("dp_size", 1)):
                ready(f"engine-{w['worker_id']}-{rank}")
        metrics_port = free_port()  # the page's daemon block serves no metrics: ask through the environment
        daemon = DaemonProcess.start(
            tmp_path / "daemon.toml",
            instance=instance,
            runtime_dir=tmp_path / "run",
            env={**os.environ, "KVSCHED_DAEMON_METRICS_PORT": str(metrics_port)},
            ready_timeout_s=120,
        )
        # The page's gateway finds its daemon by discovery (`instance = "default"`): point discovery
        # at this daemon, as KVSCHED_ENDPOINT does for every router.
        spawn(
            [
                "kvsched.gateway",
                "--config",
                str(tmp_path / "gateway.toml"),
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--ready-file",
                str(tmp_path / "gateway.port"),
                "--log-level",
                "WARNING",
            ],
            "gateway",
            env={**os.environ, "KVSCHED_ENDPOINT": daemon.endpoint},
        )
        url = f"http://127.0.0.1:{ready('gateway')}"

        prompt = words(0, 120)
        first = chat(url, model, prompt)
        # The engine's events of the first request reach the daemon; each live batch is hash-checked
        # before it is applied, so once one is applied the first-of-chain BlockStored was checked.
        assert wait_until(lambda: metric(metrics_port, "kvsched_kv_events_applied") >= 1, timeout_s=30, interval_s=0.2)
        rows = cli_json(daemon.admin_endpoint, "workers")["workers"]
        assert [r for r in rows if r["hash_mismatch"]] == [], rows  # `kvsched workers`: hashes = ok everywhere
        assert metric(metrics_port, "kvsched_kv_hash_mismatches") == 0

        # Let the first decision's speculative overlap entries lapse (approx_ttl_s / 24, 5 s with the
        # page's defaults), so the second request can be credited only from the engines' KV events.
        time.sleep(SelectorConfig().approx_ttl_s * SPECULATIVE_TTL_FRACTION + 1.0)
        second = chat(url, model, prompt)
        prompt_tokens = second["usage"]["prompt_tokens"]
        full_blocks = prompt_tokens // block_size
        assert full_blocks >= 5 and first["usage"]["prompt_tokens"] == prompt_tokens
        explain = cli_json(daemon.admin_endpoint, "explain", second["id"])
        chosen = next(
            r
            for r in explain["rows"]
            if (r["worker_id"], r["dp_rank"]) == (explain["chosen_worker_id"], explain["chosen_dp_rank"])
        )
        assert chosen["overlap_blocks"] == full_blocks, explain  # the daemon credited the whole prompt...
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= full_blocks * block_size, (
            second
        )  # ...rightly
        rows = cli_json(daemon.admin_endpoint, "workers")["workers"]
        assert [r for r in rows if r["hash_mismatch"]] == [], rows
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        if daemon is not None:
            daemon.stop()
            purge(instance)
