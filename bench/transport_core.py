"""In-process figures printed by `bench_transport.py`: the core's cost per lifecycle and the long-prompt cell.

* `core_cost()` — CPU µs per lifecycle of the scheduler alone (no sockets, no frames): enqueue with
  immediate admission, dispatched and prefill_done as a local router's state-word stores folded by
  one `fold_words` call (what the actor does per wake), release, `drain_cleanup`. 8 workers, 64 hashes
  per request, the default `kv` selector, 8 leases held. When `bench/bench_core.py` exists (the core's
  own bench) its `measure("approx", 8, n, repeats)` is used instead, so both benches print one figure.
* `long_prompt_cell()` — 100k-token prompts (6,250 blocks of 16) at 64 workers: decisions/s and the
  p50 / p99 of one in-process decision (`Scheduler.enqueue` → Admit), no target.
"""

from __future__ import annotations

import time

import numpy as np

CORE_GOAL_US = 15.0  # in-process core <= 15 µs per lifecycle at 8 workers and 64 hashes (docs/BENCHMARKS.md)
LONG_TOKENS = 100_000
LONG_BLOCKS = 6_250  # 100k tokens / 16
LONG_WORKERS = 64


def _config(workers: int, blocks_per_request: int, max_slots: int):
    from kvsched.config import config_from_dict

    return config_from_dict(
        {
            "daemon": {
                "block_size": 16,
                "max_workers": workers,
                "max_slots": max_slots,
                "max_blocks_per_request": blocks_per_request,
            },
            "selector": {"seed": 0},
            "workers": [
                {"worker_id": w, "total_kv_blocks": 1 << 40, "max_num_batched_tokens": 1 << 30} for w in range(workers)
            ],
        }
    )


def _prompts(n: int, blocks: int, prefix_blocks: int, n_prefixes: int) -> list[np.ndarray]:
    """`n` read-only uint64[blocks] hash arrays (one of `n_prefixes` shared prefixes + a unique suffix),
    decoded from bytes as the actor decodes a frame's."""
    out = []
    for i in range(n):
        g = i % n_prefixes
        prefix = np.arange(g * 10**6 + 1, g * 10**6 + 1 + prefix_blocks, dtype="<u8")
        base = 10**12 + i * blocks
        suffix = np.arange(base, base + blocks - prefix_blocks, dtype="<u8")
        out.append(np.frombuffer(np.concatenate([prefix, suffix]).tobytes(), dtype="<u8"))
    return out


def _state_words(sched):
    """Give an in-process scheduler private progress / state words (the daemon maps them from shared memory)."""
    ledger = sched.ledger
    n = ledger.arrays.max_slots
    ledger.progress, ledger.state = np.zeros(n, np.uint64), np.zeros(n, np.uint64)
    return ledger.state


def _lifecycles(
    sched,
    state,
    prompts,
    isl: int,
    n: int,
    window: int,
    start: int,
    clock: list[int],
    lat_us: list[float] | None = None,
) -> None:
    """`n` lifecycles with `window` leases held; appends each decision's wall µs to `lat_us`."""
    from kvsched.core.types import Admit, RequestSpec
    from kvsched.shm.words import STATE_PREFILL_DONE, pack_state

    held: list[Admit] = []
    t = clock[0]
    for i in range(start, start + n):
        t += 50
        spec = RequestSpec(request_id=f"r{i}", isl_tokens=isl, block_hashes=prompts[i % len(prompts)], owner=1)
        t0 = time.perf_counter_ns()
        a = sched.enqueue(spec, t)[0]
        if lat_us is not None:
            lat_us.append((time.perf_counter_ns() - t0) / 1000)
        if type(a) is not Admit:
            raise RuntimeError(f"expected an immediate admission, got {a!r}")
        state[a.slot] = pack_state(a.generation, STATE_PREFILL_DONE)  # the router's stores
        sched.fold_words()  # the actor's one fold per wake
        held.append(a)
        if len(held) >= window:
            old = held.pop(0)
            sched.release(old.request_id, old.slot, old.generation, "completed", isl + 1, t)
        sched.drain_cleanup(t)
    for old in held:
        sched.release(old.request_id, old.slot, old.generation, "completed", isl + 1, t)
    sched.drain_cleanup(t)
    clock[0] = t


def core_cost(n: int = 10_000, repeats: int = 5) -> dict:
    """CPU µs per in-process lifecycle (best of `repeats` × `n`; module docstring). Keys:
    cpu_us_per_lifecycle, wall_us_per_lifecycle, source ("bench_core" or "inline"), goal_us."""
    try:
        import bench_core  # the core's own bench, when present on this tree
    except ImportError:
        bench_core = None
    if bench_core is not None and hasattr(bench_core, "measure"):
        r = bench_core.measure("approx", 8, n, repeats)
        return {
            "cpu_us_per_lifecycle": r["cpu_us_per_lifecycle"],
            "wall_us_per_lifecycle": r["wall_us_per_lifecycle"],
            "source": "bench_core",
            "goal_us": CORE_GOAL_US,
            "lifecycles": n,
            "repeats": repeats,
        }
    from kvsched.sim.virtual import make_inprocess_scheduler

    sched = make_inprocess_scheduler(_config(8, 64, 16384))
    state = _state_words(sched)
    prompts = _prompts(4096, 64, 16, 32)
    clock = [1_000_000]
    _lifecycles(sched, state, prompts, 1024, 2000, 8, 0, clock)  # warm-up: kernels loaded, index populated
    cpu, wall, start = [], [], 2000
    for _ in range(repeats):
        c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
        _lifecycles(sched, state, prompts, 1024, n, 8, start, clock)
        cpu.append((time.thread_time_ns() - c0) / n / 1000)
        wall.append((time.perf_counter_ns() - w0) / n / 1000)
        start += n
    return {
        "cpu_us_per_lifecycle": round(min(cpu), 2),
        "wall_us_per_lifecycle": round(min(wall), 2),
        "source": "inline",
        "goal_us": CORE_GOAL_US,
        "lifecycles": n,
        "repeats": repeats,
    }


def long_prompt_cell(n: int = 400, window: int = 16) -> dict:
    """100k-token prompts at 64 workers, `window` leases held (module docstring). Keys: decisions_per_s
    (decisions over the wall time of the whole loop, releases included), decision_us_p50 / _p99."""
    from kvsched.sim.virtual import make_inprocess_scheduler

    sched = make_inprocess_scheduler(_config(LONG_WORKERS, LONG_BLOCKS, 1024))
    state = _state_words(sched)
    prompts = _prompts(256, LONG_BLOCKS, 1024, 16)
    clock = [1_000_000]
    _lifecycles(sched, state, prompts, LONG_TOKENS, min(64, n), window, 0, clock)  # warm-up
    lat: list[float] = []
    w0 = time.perf_counter_ns()
    _lifecycles(sched, state, prompts, LONG_TOKENS, n, window, 64, clock, lat)
    wall_s = (time.perf_counter_ns() - w0) / 1e9
    arr = np.asarray(lat)
    return {
        "prompt_tokens": LONG_TOKENS,
        "blocks": LONG_BLOCKS,
        "workers": LONG_WORKERS,
        "window": window,
        "decisions": n,
        "decisions_per_s": round(n / wall_s, 1),
        "decision_us_p50": round(float(np.percentile(arr, 50)), 1),
        "decision_us_p99": round(float(np.percentile(arr, 99)), 1),
    }
