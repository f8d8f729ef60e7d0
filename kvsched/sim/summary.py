"""Per-request replay results and the end-of-run summary (both drivers produce the same records).

`RequestResult` is one line of a router's results file (msgspec JSON Lines) or one record of the
virtual driver; `summarize()` folds them into a `Summary` (written as `summary.json`), and
`summary_table()` renders it with rich.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

import msgspec
import numpy as np
from rich.table import Table

COMPLETED = "completed"
REJECTED = "rejected"
ABORTED = "aborted"  # admitted, then failed (fleet or daemon error); `detail` says why
UNFINISHED = "unfinished"  # still waiting when the run ended (should not happen; counted, not hidden)


class RequestResult(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What happened to one trace request. Times in simulated µs unless the name says wall.

    Attributes:
        index: row of the request in the (limited) trace.
        arrival_us: arrival in simulated time (trace time / load_scale).
        outcome: completed | rejected | aborted | unfinished.
        reason / detail: the rejection reason (docs/DESIGN.md §2.4) or the abort cause.
        worker: "worker_id:dp_rank" it ran on.
        admission_latency_us: wall µs around `schedule()` as the router saw it (virtual driver: the
            in-process `enqueue` + `drain_cleanup` call time for a request admitted at once, else -1).
        queued_us: wait in the scheduler as it reported it (daemon wall µs; virtual: simulated µs).
        queue_wait_us: wait in the scheduler in simulated µs.
        ttft_us: first token − arrival (simulated µs). e2e_us: last token − arrival.
        cached_tokens: prompt tokens the engine served from its prefix cache.
        predicted_cached_tokens: what the scheduler expected on the chosen worker.
        policy_class: the class the request was sent with ("" = the default class).
        overlap_blocks / best_overlap_blocks: overlap on the chosen worker / the deepest overlap on any
            eligible worker (blocks); their gap is overlap given up. Virtual driver: the scheduler's
            credited overlap at the decision; wall clock: the engines' cached prefixes when the fleet
            received the request (the same ground truth whichever router chose).
    """

    index: int
    request_id: str
    arrival_us: int
    isl: int
    osl: int
    outcome: str = UNFINISHED
    reason: str = ""
    detail: str = ""
    worker: str = ""
    admission_latency_us: float = -1.0
    queued_us: int = -1
    queue_wait_us: int = -1
    ttft_us: int = -1
    e2e_us: int = -1
    cached_tokens: int = 0
    predicted_cached_tokens: int = 0
    output_tokens: int = 0
    policy_class: str = ""
    overlap_blocks: int = 0
    best_overlap_blocks: int = 0


class ClassSummary(msgspec.Struct, kw_only=True):
    """The figures of one policy class (`summary.json` → `classes`). Admitted = given a worker.

    Attributes:
        dispatch_share: this class's admissions / all admissions (0 when nothing was admitted).
        uncached_token_share: uncached prompt tokens admitted in this class (ISL − the scheduler's
            cached estimate, i.e. what DRR charges) / the same over all classes.
    """

    requests: int
    completed: int
    rejected: dict[str, int]  # reason -> count
    aborted: int
    unfinished: int
    admitted: int
    queue_wait_ms_p50: float | None  # simulated ms, admitted requests
    queue_wait_ms_p99: float | None
    ttft_ms_p50: float | None  # simulated ms, completed requests
    ttft_ms_p99: float | None
    dispatch_share: float
    uncached_token_share: float


class Summary(msgspec.Struct, kw_only=True):
    """The figures of one replay run (`summary.json`)."""

    mode: str  # "virtual" | "wall"
    trace: str
    requests: int
    completed: int
    rejected: dict[str, int]  # reason -> count
    aborted: int
    unfinished: int
    workers: int
    routers: int
    selector: str
    speedup: float
    load_scale: float
    wall_time_s: float
    simulated_time_s: float  # first arrival to last completion
    lifecycles_per_s: float  # finished requests (completed + rejected + aborted) per wall second
    admission_latency_us_p50: float | None
    admission_latency_us_p99: float | None
    admission_latency_unqueued_us_p50: float | None  # only requests the scheduler admitted at once
    admission_latency_unqueued_us_p99: float | None
    queue_wait_ms_p50: float | None  # simulated ms
    queue_wait_ms_p99: float | None
    ttft_ms_p50: float | None  # simulated ms
    ttft_ms_p99: float | None
    prefix_hit_ratio: float  # cached prompt tokens / prompt tokens, completed requests
    predicted_hit_ratio: float  # the scheduler's own estimate of the same
    infinite_cache_hit_ratio: float | None  # upper bound: one infinite cache, same requests
    requests_per_worker: dict[str, int]
    ledger_zero: bool | None = None  # all worker aggregates back to zero at the end (None = not checked)
    # achievable reference: one LRU cache of the fleet's total KV blocks seeing every request
    fleet_lru_hit_ratio: float | None = None
    notes: list[str] = []
    profile: str | None = None  # --profile file, if any
    class_rule: str = "none"  # --class-rule as given
    classes: dict[str, ClassSummary] = {}  # class name -> its figures, in the profile's order


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(
    results: Iterable[RequestResult],
    *,
    mode: str,
    trace: str,
    workers: int,
    routers: int,
    selector: str,
    speedup: float,
    load_scale: float,
    wall_time_s: float,
    infinite_cache_hit_tokens: int | None = None,
    ledger_zero: bool | None = None,
    fleet_lru_hit_tokens: int | None = None,
    notes: list[str] | None = None,
    profile: str | None = None,
    class_rule: str = "none",
    class_order: Sequence[str] = (),
) -> Summary:
    """Fold per-request results into a `Summary`.

    `class_order` lists the classes to report first, in order (the profile's); classes seen in the
    results but not listed follow in order of appearance ("" = requests sent without a class).
    """
    rs = list(results)
    done = [r for r in rs if r.outcome == COMPLETED]
    rejected = Counter(r.reason or "unknown" for r in rs if r.outcome == REJECTED)
    aborted = sum(1 for r in rs if r.outcome == ABORTED)
    unfinished = sum(1 for r in rs if r.outcome == UNFINISHED)
    isl_done = sum(r.isl for r in done)
    ends = [r.arrival_us + r.e2e_us for r in done]
    sim_s = (max(ends) - min(r.arrival_us for r in rs)) / 1e6 if ends else 0.0
    finished = len(rs) - unfinished
    lat = [r.admission_latency_us for r in rs if r.admission_latency_us >= 0]
    lat0 = [r.admission_latency_us for r in rs if r.admission_latency_us >= 0 and r.queued_us == 0]
    qw = [r.queue_wait_us / 1000.0 for r in rs if r.queue_wait_us >= 0]
    ttft = [r.ttft_us / 1000.0 for r in done if r.ttft_us >= 0]
    isl_all = sum(r.isl for r in rs)
    return Summary(
        mode=mode,
        trace=trace,
        requests=len(rs),
        completed=len(done),
        rejected=dict(sorted(rejected.items())),
        aborted=aborted,
        unfinished=unfinished,
        workers=workers,
        routers=routers,
        selector=selector,
        speedup=speedup,
        load_scale=load_scale,
        wall_time_s=round(wall_time_s, 3),
        simulated_time_s=round(sim_s, 3),
        lifecycles_per_s=round(finished / wall_time_s, 1) if wall_time_s > 0 else 0.0,
        admission_latency_us_p50=_round(_pct(lat, 50)),
        admission_latency_us_p99=_round(_pct(lat, 99)),
        admission_latency_unqueued_us_p50=_round(_pct(lat0, 50)),
        admission_latency_unqueued_us_p99=_round(_pct(lat0, 99)),
        queue_wait_ms_p50=_round(_pct(qw, 50)),
        queue_wait_ms_p99=_round(_pct(qw, 99)),
        ttft_ms_p50=_round(_pct(ttft, 50)),
        ttft_ms_p99=_round(_pct(ttft, 99)),
        prefix_hit_ratio=round(sum(r.cached_tokens for r in done) / isl_done, 4) if isl_done else 0.0,
        predicted_hit_ratio=round(sum(r.predicted_cached_tokens for r in done) / isl_done, 4) if isl_done else 0.0,
        infinite_cache_hit_ratio=(
            round(infinite_cache_hit_tokens / isl_all, 4) if infinite_cache_hit_tokens is not None and isl_all else None
        ),
        requests_per_worker=dict(sorted(Counter(r.worker for r in done).items(), key=_worker_order)),
        ledger_zero=ledger_zero,
        fleet_lru_hit_ratio=round(fleet_lru_hit_tokens / isl_all, 4)
        if fleet_lru_hit_tokens is not None and isl_all
        else None,
        notes=list(notes or []),
        profile=profile,
        class_rule=class_rule,
        classes=summarize_classes(rs, class_order),
    )


def summarize_classes(results: Sequence[RequestResult], class_order: Sequence[str] = ()) -> dict[str, ClassSummary]:
    """Per-class figures (see `ClassSummary`); every class in `class_order` is listed, even if empty."""
    by_class: dict[str, list[RequestResult]] = {name: [] for name in class_order}
    for r in results:
        by_class.setdefault(r.policy_class, []).append(r)
    admitted_all = sum(1 for r in results if r.worker)
    uncached_all = sum(_uncached(r) for r in results if r.worker)
    out: dict[str, ClassSummary] = {}
    for name, rs in by_class.items():
        admitted = [r for r in rs if r.worker]
        qw = [r.queue_wait_us / 1000.0 for r in admitted if r.queue_wait_us >= 0]
        ttft = [r.ttft_us / 1000.0 for r in rs if r.outcome == COMPLETED and r.ttft_us >= 0]
        uncached = sum(_uncached(r) for r in admitted)
        out[name] = ClassSummary(
            requests=len(rs),
            completed=sum(1 for r in rs if r.outcome == COMPLETED),
            rejected=dict(sorted(Counter(r.reason or "unknown" for r in rs if r.outcome == REJECTED).items())),
            aborted=sum(1 for r in rs if r.outcome == ABORTED),
            unfinished=sum(1 for r in rs if r.outcome == UNFINISHED),
            admitted=len(admitted),
            queue_wait_ms_p50=_round(_pct(qw, 50)),
            queue_wait_ms_p99=_round(_pct(qw, 99)),
            ttft_ms_p50=_round(_pct(ttft, 50)),
            ttft_ms_p99=_round(_pct(ttft, 99)),
            dispatch_share=round(len(admitted) / admitted_all, 4) if admitted_all else 0.0,
            uncached_token_share=round(uncached / uncached_all, 4) if uncached_all else 0.0,
        )
    return out


def _uncached(r: RequestResult) -> int:
    """Uncached prompt tokens as the scheduler costed them (what DRR charges), at least 1."""
    return max(1, r.isl - r.predicted_cached_tokens)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def _worker_order(item: tuple[str, int]) -> tuple[int, ...]:
    return tuple(int(p) for p in item[0].split(":") if p.isdigit())


def write_summary(summary: Summary, out_dir: Path) -> Path:
    """Write `summary.json` (pretty-printed) into `out_dir`; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "summary.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(summary), indent=2) + b"\n")
    return path


def write_results(results: Iterable[RequestResult], path: Path) -> None:
    """Per-request results as msgspec JSON Lines."""
    enc = msgspec.json.Encoder()
    with open(path, "wb") as fh:
        for r in results:
            fh.write(enc.encode(r) + b"\n")


def read_results(path: Path) -> list[RequestResult]:
    """Read a JSON Lines results file (tolerates a torn last line from a killed router)."""
    dec = msgspec.json.Decoder(RequestResult)
    out: list[RequestResult] = []
    with open(path, "rb") as fh:
        for line in fh:
            try:
                out.append(dec.decode(line))
            except msgspec.DecodeError:
                continue
    return out


def _fmt(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 10 else f"{v:,.1f}"
    return str(v)


def summary_table(summary: Summary):
    """A rich Table of the summary's figures."""
    t = Table(title=f"kvsched replay ({summary.mode})", show_header=True)
    t.add_column("figure")
    t.add_column("value", justify="right")

    rows = [
        ("requests", summary.requests),
        ("completed", summary.completed),
        ("rejected", ", ".join(f"{k}={v}" for k, v in summary.rejected.items()) or "0"),
        ("aborted / unfinished", f"{summary.aborted} / {summary.unfinished}"),
        ("workers / routers / selector", f"{summary.workers} / {summary.routers} / {summary.selector}"),
        ("speedup / load scale", f"{summary.speedup:g} / {summary.load_scale:g}"),
        ("wall time (s)", summary.wall_time_s),
        ("simulated time (s)", summary.simulated_time_s),
        ("lifecycles/s (wall)", summary.lifecycles_per_s),
        (
            "admission latency p50 / p99 (µs)",
            f"{_fmt(summary.admission_latency_us_p50)} / {_fmt(summary.admission_latency_us_p99)}",
        ),
        (
            "  of requests not queued",
            f"{_fmt(summary.admission_latency_unqueued_us_p50)} / {_fmt(summary.admission_latency_unqueued_us_p99)}",
        ),
        ("queue wait p50 / p99 (sim ms)", f"{_fmt(summary.queue_wait_ms_p50)} / {_fmt(summary.queue_wait_ms_p99)}"),
        ("TTFT p50 / p99 (sim ms)", f"{_fmt(summary.ttft_ms_p50)} / {_fmt(summary.ttft_ms_p99)}"),
        ("prefix hit ratio (cached / ISL)", summary.prefix_hit_ratio),
        ("  scheduler's estimate", summary.predicted_hit_ratio),
        ("  fleet-LRU reference (achievable)", summary.fleet_lru_hit_ratio),
        ("  infinite-cache bound", summary.infinite_cache_hit_ratio),
        ("requests per worker", ", ".join(f"{k}={v}" for k, v in summary.requests_per_worker.items())),
        ("ledger back to zero", summary.ledger_zero),
    ]
    for name, value in rows:
        t.add_row(name, _fmt(value))
    return t


def class_table(summary: Summary):
    """A rich Table with one row per policy class (wait and TTFT in simulated ms, shares in %)."""
    title = f"per class: rule {summary.class_rule}" + (f", profile {summary.profile}" if summary.profile else "")
    reasons = "; ".join(
        f"{name or '(none)'} " + ", ".join(f"{k}={v}" for k, v in c.rejected.items())
        for name, c in summary.classes.items()
        if c.rejected
    )
    caption = (
        "wait / TTFT in simulated ms; disp = share of admissions; uncached = share of admitted "
        "uncached prompt tokens" + (f"; rejected: {reasons}" if reasons else "")
    )
    t = Table(title=title, caption=caption, show_header=True)
    for name in (
        "class",
        "req",
        "done",
        "rejected",
        "wait p50",
        "wait p99",
        "TTFT p50",
        "TTFT p99",
        "disp",
        "uncached",
    ):
        t.add_column(name, justify="left" if name == "class" else "right")

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:,.0f}"

    for name, c in summary.classes.items():
        t.add_row(
            name or "(none)",
            str(c.requests),
            str(c.completed),
            str(sum(c.rejected.values())),
            ms(c.queue_wait_ms_p50),
            ms(c.queue_wait_ms_p99),
            ms(c.ttft_ms_p50),
            ms(c.ttft_ms_p99),
            f"{100 * c.dispatch_share:.1f}%",
            f"{100 * c.uncached_token_share:.1f}%",
        )
    return t
