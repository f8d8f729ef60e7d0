"""Container material (Dockerfile, docker-compose.yml, deploy/kubernetes/, deploy/config/): the
checkers pass (hadolint, `docker-compose config`, `kubernetes-validate --strict`), and the files
agree with each other and with the daemon: routers share the daemon's IPC and PID namespaces and its
socket directory, /dev/shm is at least as large as the segments the shipped config creates, the
probes hit the health endpoints on the configured metrics port, and the shipped config really
starts a daemon that answers them. No image is built here (no Docker daemon)."""

from __future__ import annotations

import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvsched.config import WorkerConfig, load_config
from kvsched.daemon.wiring import segment_bytes
from tests.conftest import free_port, purge, start_daemon, unique_instance, wait_until
from tests.ops.test_systemd_units import COLD_COMPILE_BUDGET_S
from tests.ops.tools import tool_or_skip

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "kubernetes"
DAEMON_TOML = ROOT / "deploy" / "config" / "kvsched.toml"


def config_text(text: str) -> str:
    """The shipped TOML, minus `url` keys when this tree's WorkerConfig does not know them yet (the
    key comes with the gateway; the deploy files already carry it)."""
    if "url" in WorkerConfig.__struct_fields__:
        return text
    return "\n".join(line for line in text.splitlines() if not line.startswith("url"))


def load_text(tmp_path: Path, text: str):
    path = tmp_path / "cfg.toml"
    path.write_text(config_text(text))
    return load_config(path)


def mib(size: str) -> float:
    """'192m' / '192Mi' / '1g' / '1Gi' -> MiB."""
    m = re.fullmatch(r"(\d+)\s*([kmg])i?b?", size.strip().lower())
    assert m, size
    return int(m.group(1)) * {"k": 1 / 1024, "m": 1, "g": 1024}[m.group(2)]


def k8s_docs() -> dict[str, dict]:
    out = {}
    for path in sorted(K8S.glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and "kind" in doc:
                out[doc["kind"]] = doc
    return out


def dockerfile_uid() -> int:
    text = (ROOT / "Dockerfile").read_text()
    return int(re.search(r"^ARG UID=(\d+)$", text, re.M).group(1))


# ---------------------------------------------------------------------------- Dockerfile
def test_dockerfile_is_multi_stage_non_root_and_lints_clean():
    text = (ROOT / "Dockerfile").read_text()
    assert len(re.findall(r"^FROM ", text, re.M)) >= 2
    assert "COPY --from=build /opt/kvsched /opt/kvsched" in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users == ["${UID}:${UID}"] and dockerfile_uid() >= 1000
    assert text.rstrip().splitlines()[-1] == 'CMD ["kvsched-daemon", "--config", "/etc/kvsched/kvsched.toml"]'
    hadolint = tool_or_skip("hadolint")
    res = subprocess.run([hadolint, str(ROOT / "Dockerfile")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_shipped_config_fits_the_shared_memory_it_is_given(tmp_path):
    cfg = load_text(tmp_path, DAEMON_TOML.read_text())
    need = segment_bytes(cfg) / 2**20
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert mib(compose["services"]["daemon"]["shm_size"]) >= need
    pod = k8s_docs()["Deployment"]["spec"]["template"]["spec"]
    dshm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"]["medium"] == "Memory" and mib(dshm["emptyDir"]["sizeLimit"]) >= need
    cm = load_text(tmp_path, k8s_docs()["ConfigMap"]["data"]["kvsched.toml"])
    assert segment_bytes(cm) == segment_bytes(cfg)
    assert (cfg.daemon.metrics_host, cm.daemon.metrics_host) == ("0.0.0.0", "0.0.0.0")


# ---------------------------------------------------------------------------- compose
def test_compose_file_validates_and_wires_routers_to_the_daemon():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    s = compose["services"]
    assert s["daemon"]["ipc"] == "shareable"
    assert s["gateway"]["ipc"] == "service:daemon" and s["gateway"]["pid"] == "service:daemon"
    for name in ("daemon", "gateway"):
        assert "kvsched-run:/run/kvsched" in s[name]["volumes"], name
    assert "/readyz" in " ".join(s["daemon"]["healthcheck"]["test"])
    assert s["gateway"]["depends_on"]["daemon"]["condition"] == "service_healthy"
    assert s["gateway"]["command"] == [
        "kvsched-gateway",
        "--config",
        "/etc/kvsched/gateway.toml",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
    ]
    engines = sorted(n for n in s if n.startswith("engine"))
    assert len(engines) == 2
    for i, name in enumerate(engines):
        cmd = s[name]["command"]
        assert cmd[0] == "kvsched-sim-engine" and cmd[cmd.index("--worker-id") + 1] == str(i)
    compose_bin = tool_or_skip("docker-compose")
    res = subprocess.run(
        [compose_bin, "-f", str(ROOT / "docker-compose.yml"), "config", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stdout + res.stderr


# ---------------------------------------------------------------------------- Kubernetes
def test_kubernetes_manifests_validate_strictly():
    tool = tool_or_skip("kubernetes-validate")
    files = [str(p) for p in sorted(K8S.glob("*.yaml")) if p.name != "kustomization.yaml"]
    res = subprocess.run([tool, "--strict", "-k", "1.30.0", *files], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_kubernetes_validate_rejects_a_broken_manifest(tmp_path):
    """The check above can fail: an unknown field in a container is an error under --strict."""
    tool = tool_or_skip("kubernetes-validate")
    broken = (
        (K8S / "deployment.yaml")
        .read_text()
        .replace("imagePullPolicy: IfNotPresent", "imagePullPolicyy: IfNotPresent", 1)
    )
    path = tmp_path / "broken.yaml"
    path.write_text(broken)
    res = subprocess.run([tool, "--strict", "-k", "1.30.0", str(path)], capture_output=True, text=True, timeout=120)
    assert res.returncode != 0


def test_pod_shares_ipc_shm_sockets_and_probes_the_health_endpoints(tmp_path):
    docs = k8s_docs()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    assert docs["Deployment"]["spec"]["replicas"] == 1
    assert docs["Deployment"]["spec"]["strategy"]["type"] == "Recreate"
    assert pod["shareProcessNamespace"] is True
    assert pod["enableServiceLinks"] is False  # no KVSCHED_POOL_* service-link variables in the pod
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == dockerfile_uid()
    containers = {c["name"]: c for c in pod["containers"]}
    for name in ("daemon", "gateway"):
        mounts = {m["name"]: m["mountPath"] for m in containers[name]["volumeMounts"]}
        assert mounts["dshm"] == "/dev/shm" and mounts["run"] == "/run/kvsched", name
    daemon = containers["daemon"]
    cfg = load_text(tmp_path, docs["ConfigMap"]["data"]["kvsched.toml"])
    port = {p["name"]: p["containerPort"] for p in daemon["ports"]}["metrics"]
    assert port == cfg.daemon.metrics_port
    assert daemon["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert daemon["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert daemon["readinessProbe"]["httpGet"]["path"] == "/readyz?workers=1"
    # the liveness budget outlasts the stall limit: one slow tick does not restart the pod
    live = daemon["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] * 1000 > cfg.daemon.health_stall_ms
    # the start-up budget covers a cold kernel compile into the emptyDir cache (92 s of wall time
    # measured on a busy 2-core machine, docs/DEPLOY.md) with room: was 60 s
    start = daemon["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= COLD_COMPILE_BUDGET_S
    assert "requests" in daemon["resources"] and "memory" in daemon["resources"]["limits"]


@pytest.mark.slow
def test_shipped_config_starts_a_daemon_that_answers_the_probes(tmp_path):
    """deploy/config/kvsched.toml, with only the metrics address moved to a free loopback port,
    starts a real daemon: /healthz and /readyz?workers=1 (its two configured engines count as
    available even while their KV-event streams are unreachable) answer 200."""
    port = free_port()
    text = config_text(DAEMON_TOML.read_text())
    text = text.replace("metrics_port = 9464", f"metrics_port = {port}").replace(
        'metrics_host = "0.0.0.0"', 'metrics_host = "127.0.0.1"'
    )
    instance = unique_instance()
    d = start_daemon(tmp_path, text, instance=instance)
    try:

        def ok(path: str) -> bool:
            try:
                return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=3).status == 200
            except OSError:
                return False

        assert wait_until(lambda: ok("/healthz") and ok("/readyz?workers=1"), 30, 0.1)
    finally:
        d.stop()
        purge(instance)
