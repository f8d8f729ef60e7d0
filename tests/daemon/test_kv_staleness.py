"""A worker's KV-event stream is stale on evidence of loss, never on silence (docs/KV_EVENTS.md, "Staleness").

Real processes throughout: a `kvsched-daemon` subscribed over TCP to two `kvsched-sim-engine`
processes, which publish vLLM-format KV events (PUB + replay ROUTER) for the prompts they serve.
`kv_events_stale_after_s = 2` and `approx_ttl_s = 3`, so after a few idle seconds the routing
history has expired and only the event-fed index can say where a prompt is cached. vLLM publishes
nothing while idle; before this rule the daemon marked such a worker stale after 2 s of silence,
its exact overlap was ignored, and once the approximate entries expired the pool forgot the prefix.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")

from kvsched.client.sync import SyncSchedulerClient
from kvsched.gateway.local_fleet import free_ports, write_tiny_tokenizer
from kvsched.gateway.tokenizer import ModelTokenizer
from kvsched.hashing import block_hashes
from tests.conftest import ROOT, purge, start_daemon, wait_until

pytestmark = pytest.mark.timeout(180)

BLOCK = 16
STALE_AFTER_S = 2.0
APPROX_TTL_S = 3.0
IDLE_S = 8.0  # > stale_after_s and > approx_ttl_s: silence and expired routing history
PROMPTS = {1: " ".join(f"w{i}" for i in range(100, 164)), 2: " ".join(f"w{i}" for i in range(300, 364))}


class Stack:
    """Two sim engines (worker ids 1 and 2) and a daemon subscribed to their KV events."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.tok_dir = write_tiny_tokenizer(workdir / "tok")
        self.tokenizer = ModelTokenizer(str(self.tok_dir))
        self.engines: dict[int, subprocess.Popen] = {}
        self.http: dict[int, int] = {}
        self.daemon = None
        self.metrics_port = 0

    def start(self) -> Stack:
        ports = free_ports(5)
        self.metrics_port = ports[4]
        workers = ""
        for wid in (1, 2):
            kv, replay = ports[2 * (wid - 1)], ports[2 * (wid - 1) + 1]
            ready = self.workdir / f"engine-{wid}.port"
            with open(self.workdir / f"engine-{wid}.log", "ab") as log:  # the child keeps its own descriptor
                self.engines[wid] = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "kvsched.sim.http_engine",
                        "--worker-id",
                        str(wid),
                        "--port",
                        "0",
                        "--tokenizer",
                        str(self.tok_dir),
                        "--block-size",
                        str(BLOCK),
                        "--speedup",
                        "50",
                        "--kv-events-port",
                        str(kv),
                        "--kv-replay-port",
                        str(replay),
                        "--ready-file",
                        str(ready),
                        "--log-level",
                        "WARNING",
                    ],
                    stdout=log,
                    stderr=log,
                    stdin=subprocess.DEVNULL,
                    env={**os.environ, "PYTHONPATH": str(ROOT)},
                )
            workers += (
                f"\n[[workers]]\nworker_id = {wid}\ntotal_kv_blocks = 2000\n"
                f'kv_events_endpoint = "tcp://127.0.0.1:{kv}"\n'
                f'kv_replay_endpoint = "tcp://127.0.0.1:{replay}"\n'
                f"kv_events_stale_after_s = {STALE_AFTER_S}\n"
            )
        for wid, proc in self.engines.items():
            ready = self.workdir / f"engine-{wid}.port"
            assert wait_until(
                lambda proc=proc, ready=ready: (
                    proc.poll() is not None or (ready.exists() and ready.read_text().strip() != "")
                ),
                timeout_s=90,
            ), f"engine {wid} not ready"
            assert proc.poll() is None, (self.workdir / f"engine-{wid}.log").read_text()[-2000:]
            self.http[wid] = int(ready.read_text().strip())
        self.daemon = start_daemon(
            self.workdir,
            f"[daemon]\nblock_size = {BLOCK}\nmetrics_port = {self.metrics_port}\n"
            f"\n[selector]\napprox_ttl_s = {APPROX_TTL_S}\n{workers}",
        )
        return self

    def stop(self) -> None:
        for proc in self.engines.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGKILL's exit otherwise
                proc.kill()
                proc.wait(10)
        if self.daemon is not None:
            self.daemon.stop(timeout_s=10)
            purge(self.daemon.instance)

    # ------------------------------------------------------------------ probes
    def hashes(self, wid: int):
        ids = self.tokenizer.encode(PROMPTS[wid], add_special_tokens=True)  # as the engine tokenizes it
        return len(ids), block_hashes(ids, BLOCK, mode="vllm")

    def serve(self, wid: int) -> None:
        """POST worker `wid`'s prompt to its engine and wait for the answer: the engine caches the
        prompt's blocks and publishes BlockStored."""
        body = json.dumps({"model": "sim", "prompt": PROMPTS[wid], "max_tokens": 1}).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.http[wid]}/v1/completions", body, {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            assert resp.status == 200

    def metric(self, name: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        m = re.search(rf"^{name}(?:_total)? ([0-9.e+]+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def stale(self) -> set[int]:
        """Worker ids `kvsched workers --json` shows stale."""
        out = subprocess.run(
            [sys.executable, "-m", "kvsched.cli", "--admin-endpoint", self.daemon.admin_endpoint, "workers", "--json"],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert out.returncode == 0, out.stderr
        return {w["worker_id"] for w in json.loads(out.stdout)["workers"] if w.get("stale")}

    def cache_on_each_engine(self, client: SyncSchedulerClient) -> None:
        """Each engine serves its own prompt (routed to it through the daemon, as a router would),
        and the daemon applies the engines' KV events."""
        for wid in (1, 2):
            isl, hashes = self.hashes(wid)
            lease = client.schedule(f"warm-{wid}", isl, hashes, pinned=(wid, 0))
            self.serve(wid)
            lease.release("completed")
        assert wait_until(lambda: self.metric("kvsched_kv_events_applied") >= 2, timeout_s=30)


@pytest.fixture
def stack():
    d = Path(tempfile.mkdtemp(prefix="kvst", dir="/tmp"))  # ipc paths are limited to ~107 bytes
    s = Stack(d)
    try:
        yield s.start()
    finally:
        s.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_an_idle_engine_keeps_its_cached_prefix_when_the_fleet_is_silent_past_the_stale_and_ttl_limits(stack):
    """1. worker 1's prompt is routed to it and served: its engine publishes BlockStored, 2. the
    fleet stays idle 8 s (no KV events: > kv_events_stale_after_s and > approx_ttl_s), 3. the same
    prompt is scheduled unpinned. Result: it lands on worker 1 with its whole prefix cached, and no
    worker is stale (was: both stale after 2 s of silence, the prompt placed with 0 cached tokens)."""
    with SyncSchedulerClient(stack.daemon.endpoint) as client:
        stack.cache_on_each_engine(client)
        time.sleep(IDLE_S)  # the idle period under test, not a wait for a condition
        isl, hashes = stack.hashes(1)
        lease = client.schedule("again-1", isl, hashes)
        lease.release("aborted")
    print(
        f"after {IDLE_S} s idle: worker={lease.worker} overlap_blocks={lease.overlap_blocks} "
        f"cached_tokens={lease.cached_tokens}"
    )
    assert lease.worker == (1, 0)
    assert lease.overlap_blocks == len(hashes) and lease.cached_tokens == len(hashes) * BLOCK
    assert stack.metric("kvsched_stale_workers") == 0
    assert stack.stale() == set()


def test_a_killed_publisher_makes_only_its_worker_stale(stack):
    """1. both engines publish once, 2. engine 2 is SIGKILLed, engine 1 stays idle. Result: worker
    2 turns stale (its SUB saw the disconnect, nothing reconnected within 2 s), worker 1 stays
    fresh however long it is silent."""
    with SyncSchedulerClient(stack.daemon.endpoint) as client:
        stack.cache_on_each_engine(client)
    stack.engines[2].kill()
    stack.engines[2].wait(10)
    assert wait_until(lambda: stack.metric("kvsched_stale_workers") >= 1, timeout_s=30)
    time.sleep(2 * STALE_AFTER_S)  # worker 1 silent well past the limit
    assert stack.stale() == {2}
    assert stack.metric("kvsched_stale_workers") == 1


def test_a_stopped_publisher_is_noticed_by_heartbeat_and_is_fresh_again_when_it_resumes(stack):
    """1. both engines publish once, 2. engine 2 is SIGSTOPped: its TCP connection stays open, only
    the ZMTP heartbeats go unanswered, 3. SIGCONT. Result: worker 2 is stale within a few seconds
    (heartbeat timeout, then kv_events_stale_after_s) while idle worker 1 stays fresh; once the
    engine resumes, the SUB reconnects and worker 2 is fresh again without publishing."""
    with SyncSchedulerClient(stack.daemon.endpoint) as client:
        stack.cache_on_each_engine(client)
    t0 = time.monotonic()
    os.kill(stack.engines[2].pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: stack.metric("kvsched_stale_workers") >= 1, timeout_s=30)
        print(f"stopped engine noticed stale after {time.monotonic() - t0:.1f} s")
        assert stack.stale() == {2}
    finally:
        os.kill(stack.engines[2].pid, signal.SIGCONT)
    assert wait_until(lambda: stack.metric("kvsched_stale_workers") == 0, timeout_s=60)
    assert stack.stale() == set()
