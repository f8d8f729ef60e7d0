"""A whole serving stack on one machine: daemon + simulated HTTP engines + gateway processes.

Used by `make gateway-demo`, the end-to-end tests and `bench/bench_gateway.py`. Everything is a real
process on real sockets (ipc for the daemon, TCP loopback for HTTP and KV events). The tokenizer is a
tiny word-level one written by `write_tiny_tokenizer` (nothing is downloaded).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..daemon.process import DaemonProcess

from tokenizers import Tokenizer, models, pre_tokenizers

from ..client import AdminClient
from ..daemon.instance_lock import purge_instance
from ..daemon.process import DaemonProcess
from ..errors import ConfigError
from ..protocol import AddWorker, OkReply

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|> {{ m.content }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL = ["[UNK]", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
VOCAB_WORDS = 2000  # words w0 .. w1999


def write_tiny_tokenizer(directory: str | Path, words: int = VOCAB_WORDS) -> Path:
    """Write tokenizer.json (word level, whitespace split: "w17" is one token) and the chat template.

    Returns the directory. Prompts made of `w<i>` words and the template's markers tokenize to one
    token per word.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL + [f"w{i}" for i in range(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(d / "tokenizer.json"))
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>", "bos_token": ""}))
    return d


def free_ports(n: int) -> list[int]:
    """`n` distinct TCP ports on 127.0.0.1 that were free a moment ago (held together while chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_file(path: Path, proc: subprocess.Popen, log: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    head = list(proc.args)[:3] if isinstance(proc.args, (list, tuple)) else proc.args  # names it in an error
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{head!s} exited with {proc.returncode}: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    raise RuntimeError(f"{head!s} not ready within {timeout_s}s: {log.read_text()[-2000:]}")


@dataclass
class Engine:
    """One simulated engine process: worker id, HTTP port, KV-event PUB/replay ports."""

    worker_id: int
    port: int
    kv_port: int
    replay_port: int
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class LocalFleet:
    """Start with `LocalFleet.start(...)`; `stop()` ends every process it started.

    Attributes:
        workdir: logs, configs, the tokenizer. engines: the engine processes. daemon: its
        `DaemonProcess`. gateways: gateway processes; gateway_urls: their base URLs.
    """

    workdir: Path
    model: str = "tiny"
    engines: list[Engine] = field(default_factory=list)
    daemon: DaemonProcess | None = None
    gateways: list[subprocess.Popen] = field(default_factory=list)
    gateway_urls: list[str] = field(default_factory=list)
    instance: str = ""

    @classmethod
    def start(
        cls,
        workdir: str | Path,
        n_engines: int = 2,
        n_gateways: int = 1,
        *,
        block_size: int = 16,
        total_kv_blocks: int = 2000,
        speedup: float = 20.0,
        selector: str = "kv",
        kv_events: bool = True,
        daemon_extra: str = "",
        gateway_extra: str = "",
        gateway_port: int = 0,
        engine_args: tuple[str, ...] = (),
    ) -> LocalFleet:
        """Start engines, daemon and gateways at once; register each engine (URL, KV-event endpoints)
        with `add_worker` once it listens. Engines bind HTTP port 0 (no race for it); an engine that
        loses its KV-event ports to another process is restarted on new ones."""
        fleet = cls(Path(workdir))
        fleet.workdir.mkdir(parents=True, exist_ok=True)
        tok_dir = write_tiny_tokenizer(fleet.workdir / "tokenizer")
        fleet.instance = f"gw-{uuid.uuid4().hex[:8]}"
        run_dir = fleet.workdir / "run"
        endpoint = f"ipc://{run_dir}/{fleet.instance}.sock"  # as DaemonProcess.start binds it
        spawn = (tok_dir, block_size, total_kv_blocks, speedup, kv_events, engine_args)
        try:
            # Everything starts at once (imports dominate start-up on a small machine): engines and
            # gateways wait for their peers (ZeroMQ connects retry; gateways wait for the Welcome).
            ports = free_ports(2 * n_engines)
            for i in range(n_engines):
                e = Engine(i + 1, 0, ports[2 * i], ports[2 * i + 1])
                fleet.engines.append(e)
                fleet._spawn_engine(e, *spawn)
            for g in range(n_gateways):
                fleet._spawn_gateway(g, tok_dir, endpoint, gateway_extra, gateway_port if g == 0 else 0)
            cfg = fleet.workdir / "daemon.toml"
            cfg.write_text(
                f"[daemon]\nblock_size = {block_size}\nliveness_timeout_ms = 3000\n"
                f'heartbeat_ms = 500\n\n[selector]\ntype = "{selector}"\n{daemon_extra}\n'
            )
            fleet.daemon = DaemonProcess.start(cfg, instance=fleet.instance, runtime_dir=run_dir)
            for e in fleet.engines:
                fleet._engine_ready(e, spawn)
                fleet._register(e, total_kv_blocks, kv_events)
            for g, proc in enumerate(fleet.gateways):
                port = _wait_file(fleet.workdir / f"gateway-{g}.port", proc, fleet.workdir / f"gateway-{g}.log", 90)
                fleet.gateway_urls.append(f"http://127.0.0.1:{port}")
        except BaseException:
            fleet.stop()
            raise
        return fleet

    def _engine_ready(self, e: Engine, spawn: tuple, attempts: int = 3) -> None:
        ready, log = self.workdir / f"engine-{e.worker_id}.port", self.workdir / f"engine-{e.worker_id}.log"
        for attempt in range(attempts):
            try:
                assert e.proc is not None, "spawned before it is waited for"
                e.port = int(_wait_file(ready, e.proc, log, 90))
                return
            except RuntimeError:
                if attempt == attempts - 1 or "address already in use" not in log.read_text()[-3000:]:
                    raise
                e.kv_port, e.replay_port = free_ports(2)
                self._spawn_engine(e, *spawn)

    def _register(self, e: Engine, total_kv_blocks: int, kv_events: bool) -> None:
        req = AddWorker(
            worker_id=e.worker_id,
            total_kv_blocks=total_kv_blocks,
            max_num_batched_tokens=8192,
            url=e.url,
            kv_events_endpoint=f"tcp://127.0.0.1:{e.kv_port}" if kv_events else None,
            kv_replay_endpoint=f"tcp://127.0.0.1:{e.replay_port}" if kv_events else None,
        )
        assert self.daemon is not None, "start() first"
        with AdminClient(self.daemon.admin_endpoint) as admin:
            reply = admin.call(req)
        if not isinstance(reply, OkReply):
            raise RuntimeError(f"add_worker {e.worker_id} failed: {reply}")

    def _spawn_engine(
        self,
        e: Engine,
        tok_dir: Path,
        block_size: int,
        total_kv_blocks: int,
        speedup: float,
        kv_events: bool,
        engine_args: tuple[str, ...],
    ) -> None:
        argv = [
            sys.executable,
            "-m",
            "kvsched.sim.http_engine",
            "--worker-id",
            str(e.worker_id),
            "--port",
            str(e.port),
            "--tokenizer",
            str(tok_dir),
            "--model",
            self.model,
            "--block-size",
            str(block_size),
            "--total-kv-blocks",
            str(total_kv_blocks),
            "--speedup",
            str(speedup),
            "--ready-file",
            str(self.workdir / f"engine-{e.worker_id}.port"),
            "--log-level",
            "WARNING",
            *engine_args,
        ]
        if kv_events:
            argv += ["--kv-events-port", str(e.kv_port), "--kv-replay-port", str(e.replay_port)]
        (self.workdir / f"engine-{e.worker_id}.port").unlink(missing_ok=True)
        with open(self.workdir / f"engine-{e.worker_id}.log", "ab") as log:  # the child keeps its own descriptor
            e.proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)

    def add_gateway(self, source_dir: str | Path | None = None, extra: str = "") -> str:
        """Start one more gateway process and return its base URL once it listens.

        Args:
            source_dir: a directory holding another `kvsched` package tree to run the gateway from
                (e.g. `git archive` of an older commit, to compare two versions in one run; it must
                speak this daemon's protocol); None = this package.
            extra: more `[gateway]` TOML lines.
        Raises:
            RuntimeError: the process exited or did not listen within 90 s.
        """
        g = len(self.gateways)
        endpoint = f"ipc://{self.workdir / 'run'}/{self.instance}.sock"
        self._spawn_gateway(g, self.workdir / "tokenizer", endpoint, extra, 0, source_dir)
        port = _wait_file(self.workdir / f"gateway-{g}.port", self.gateways[g], self.workdir / f"gateway-{g}.log", 90)
        self.gateway_urls.append(f"http://127.0.0.1:{port}")
        return self.gateway_urls[-1]

    def _spawn_gateway(
        self, g: int, tok_dir: Path, endpoint: str, extra: str, port: int, source_dir: str | Path | None = None
    ) -> None:
        cfg = self.workdir / f"gateway-{g}.toml"
        cfg.write_text(
            f'[gateway]\nport = {port}\ndaemon_endpoint = "{endpoint}"\nconnect_timeout_s = 90\n'
            f'health_interval_s = 0.5\n{extra}\n\n[[models]]\nname = "{self.model}"\n'
            f'tokenizer_dir = "{tok_dir}"\n'
        )
        ready = self.workdir / f"gateway-{g}.port"
        ready.unlink(missing_ok=True)
        with open(self.workdir / f"gateway-{g}.log", "ab") as log:  # the child keeps its own descriptor
            # `python -m` puts the working directory first on sys.path: run from `source_dir` so its
            # kvsched shadows the installed one.
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvsched.gateway",
                    "--config",
                    str(cfg),
                    "--ready-file",
                    str(ready),
                    "--log-level",
                    "WARNING",
                ],
                stdout=log,
                stderr=log,
                stdin=subprocess.DEVNULL,
                cwd=source_dir,
            )
        self.gateways.append(proc)

    def stop(self) -> None:
        """Stop gateways, engines and the daemon (SIGTERM, then SIGKILL after 5 s)."""
        procs = list(self.gateways) + [e.proc for e in self.engines if e.proc is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        if self.daemon is not None:
            self.daemon.stop()

            try:  # segments and lock file: nothing of a demo's random instance piles up in /dev/shm
                purge_instance(self.instance)
            except ConfigError as exc:  # the daemon outlived its stop (not ours to remove then)
                print(f"kvsched: {exc}; its shared memory is left in /dev/shm", file=sys.stderr)
            self.daemon = None

    def __enter__(self) -> LocalFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
