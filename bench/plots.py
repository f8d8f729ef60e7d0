"""PNG plots of the bench JSON: latency CDFs, throughput vs routers, hit ratio per policy, TTFT p99 vs
load, and per-decision kernel time.

Reads `out/bench/{transport,routing,kernels}.json` (whichever exist) and writes `docs/bench/*.png`.
Usage: python bench/plots.py [--bench-dir out/bench] [--out docs/bench]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

ROOT = Path(__file__).resolve().parents[1]
COLORS = {"echo": "tab:gray", "daemon": "tab:blue", "redis": "tab:red", "dynamo": "tab:green", "ray": "tab:purple"}
DPI = 110


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def latency_cdfs(transport: dict, out: Path) -> Path:
    """Select / admission latency CDFs per backend at 1 router (window 1) and at 8 routers."""
    rows = [r for r in transport["rows"] if r.get("cdf_us")]
    routers = sorted({r["routers"] for r in rows})
    panels = [(1, 1)]
    many = 8 if 8 in routers else routers[-1]
    windows = sorted({r["window"] for r in rows})
    panels.append((many, windows[-1]))
    fig, axes = plt.subplots(1, len(panels), figsize=(11, 4), squeeze=False)
    for ax, (n, w) in zip(axes[0], panels, strict=True):
        for r in rows:
            if r["routers"] == n and r["window"] == w:
                xs = r["cdf_us"]
                ys = [i / (len(xs) - 1) for i in range(len(xs))]
                ax.plot(
                    xs, ys, label=f"{r['backend']} (p50 {r['select_us_p50']:,.0f} µs)", color=COLORS.get(r["backend"])
                )
        ax.set_xscale("log")
        ax.set_xlabel("select / admission latency (µs, router side)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{n} router(s) × window {w}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    path = out / "latency_cdf.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def throughput_vs_routers(transport: dict, out: Path) -> Path:
    """Lifecycles/s vs router processes, one line per (backend, window)."""
    rows = transport["rows"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    styles = ["-", "--", ":", "-."]
    windows = sorted({r["window"] for r in rows})
    for backend in ("echo", "daemon", "redis", "dynamo"):
        for i, w in enumerate(windows):
            pts = sorted(
                (r["routers"], r["lifecycles_per_s"]) for r in rows if r["backend"] == backend and r["window"] == w
            )
            if pts:
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    styles[i % len(styles)],
                    marker="o",
                    color=COLORS.get(backend),
                    label=f"{backend}, window {w}",
                )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("router processes")
    ax.set_ylabel("lifecycles/s (select, dispatched, prefill_done, release)")
    ax.set_title("Throughput vs routers (same run, same machine)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path = out / "throughput_vs_routers.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def hit_ratio_per_policy(routing: dict, out: Path) -> Path:
    """Prefix-hit ratio per policy, per fleet size, at the highest load level; infinite-cache bound."""
    rows = [r for r in routing["rows"] if r.get("workload", "conversation") == "conversation"]
    workers = sorted({r["workers"] for r in rows})
    level = max(r["level"] for r in rows)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(1, len(workers), figsize=(12, 4.5), squeeze=False)
    for ax, w in zip(axes[0], workers, strict=True):
        sel = {r["policy"]: r for r in rows if r["workers"] == w and r["level"] == level}
        vals = [sel[p]["prefix_hit_ratio"] for p in policies]
        bars = ax.bar(range(len(policies)), vals, color=["tab:blue" if p == "kv" else "tab:gray" for p in policies])
        bound = next(iter(sel.values()))["infinite_cache_hit_ratio"]
        ax.axhline(bound, color="tab:green", linestyle="--", label=f"infinite cache {bound:.3f}")
        lru = next(iter(sel.values())).get("fleet_lru_hit_ratio")
        if lru is not None:
            ax.axhline(lru, color="tab:orange", linestyle=":", label=f"fleet LRU {lru:.3f}")
        ax.bar_label(bars, fmt="%.3f", fontsize=7)
        ax.set_xticks(range(len(policies)), policies, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel("prefix-hit ratio (cached / prompt tokens)")
        ax.set_title(f"{w} workers, load level {level}")
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "hit_ratio_per_policy.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def ttft_p99_vs_load(routing: dict, out: Path) -> Path:
    """TTFT p99 (simulated s) vs load level, one line per policy, one panel per fleet size."""
    rows = [r for r in routing["rows"] if r.get("workload", "conversation") == "conversation"]
    workers = sorted({r["workers"] for r in rows})
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    fig, axes = plt.subplots(1, len(workers), figsize=(12, 4.5), squeeze=False)
    for ax, w in zip(axes[0], workers, strict=True):
        for p in policies:
            pts = sorted(
                (r["level"], r["ttft_ms_p99"] / 1000.0) for r in rows if r["workers"] == w and r["policy"] == p
            )
            ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                marker="o",
                label=p,
                linewidth=2.5 if p == "kv" else 1.2,
                color="tab:blue" if p == "kv" else None,
            )
        ax.set_yscale("log")
        ax.set_xlabel("load level (arrival-rate multiplier per 4 workers)")
        ax.set_ylabel("TTFT p99 (simulated s)")
        ax.set_title(f"{w} workers")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "ttft_p99_vs_load.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def kernel_times(kernels: dict, out: Path) -> Path:
    """Projection + overlap + cost per decision (µs) vs workers, numba / numpy / Python."""
    cases = kernels["cases"]
    actives = sorted({c["active"] for c in cases})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for impl, color in (("numba", "tab:blue"), ("numpy", "tab:orange"), ("python", "tab:red")):
        for i, n in enumerate(actives):
            pts = sorted(
                (c["workers"], c[f"project_{impl}_us"] + c[f"depth_{impl}_us"]) for c in cases if c["active"] == n
            )
            ax.plot(
                [x for x, _ in pts],
                [y for _, y in pts],
                ["-", "--", ":"][i % 3],
                marker="o",
                color=color,
                label=f"{impl}, {n:,} active",
            )
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("workers")
    ax.set_ylabel("µs per decision (projection + overlap + cost)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    path = out / "kernels.png"
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def make_plots(bench_dir: Path, out: Path) -> list[Path]:
    """Every plot whose input JSON exists; returns the written paths."""
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    transport = _load(bench_dir / "transport.json")
    routing = _load(bench_dir / "routing.json")
    kernels = _load(bench_dir / "kernels.json")
    if transport:
        paths += [latency_cdfs(transport, out), throughput_vs_routers(transport, out)]
    if routing:
        paths += [hit_ratio_per_policy(routing, out), ttft_p99_vs_load(routing, out)]
    if kernels:
        paths.append(kernel_times(kernels, out))
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench-dir", default=str(ROOT / "out" / "bench"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    args = ap.parse_args()
    for p in make_plots(Path(args.bench_dir), Path(args.out)):
        print(f"wrote {p}")


if __name__ == "__main__":
    main()
