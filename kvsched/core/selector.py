"""WorkerSelector: per-row load and overlap -> one worker row; `select` is side-effect free.

`select` never reserves or touches a queue; the only state it changes is its own RNG and, for
round robin, its cursor. State learnt from decisions changes only in the two admission hooks the
dispatcher calls once a reservation succeeded: `admitted` (the `kv` selector's recently admitted work)
and `note_admitted` (e.g. the `cache_aware` baseline's registry) — Dynamo kv-router guardrail: selectors
are side-effect free.

Selectors are plug-ins: `create_selector(cfg)` builds the class registered under `cfg.type` in the
`kvsched.selectors` entry-point group (`kvsched.config.selectors`). kvsched registers `kv`
(`kv_cost.KvSelector`) and the four below; the routing baselines of the benchmarks (`dynamo_cost`,
`cache_aware`, `lmetric`, `llmd`, `llmd_sticky`) live in the `kvsched-bench` distribution (bench/).
docs/ROUTING.md documents each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..config import SelectorConfig
from ..config.selectors import selector_entry_point


@dataclass(slots=True)
class SelectionView:
    """What a decision sees per worker row, beyond the kernel's cost (arrays are read-only views).

    Attributes:
        prefill_tokens: int64[W], projected uncached prefill tokens if the request ran there:
            active prefill + isl - cached (tokens); -1 at ineligible rows.
        blocks: int64[W], projected active KV blocks: active + request blocks not live there; -1 ineligible.
        active_prefill: int64[W], outstanding prefill tokens now (tokens).
        active_blocks: int64[W], active unique KV blocks now (blocks).
        total_kv_blocks: int64[W], KV capacity (blocks).
        max_batched_tokens: int64[W], per-step token budget (tokens).
        isl_tokens: the request's prompt tokens.
        block_size: tokens per block (B).
        now_us: decision time (µs, the scheduler's clock).
    """

    prefill_tokens: np.ndarray
    blocks: np.ndarray
    active_prefill: np.ndarray
    active_blocks: np.ndarray
    total_kv_blocks: np.ndarray
    max_batched_tokens: np.ndarray
    isl_tokens: int
    block_size: int
    now_us: int


class TermTable:
    """Named float64[W] cost terms of one decision, stored as the rows of one float64[k, W] array
    (one allocation per decision, kept by the explain ring). Reads like a dict of arrays:
    `items()`, `values()`, `keys()`, `table[name]`."""

    __slots__ = ("names", "rows")

    def __init__(self, names: tuple[str, ...], rows: np.ndarray) -> None:
        self.names, self.rows = names, rows

    def __getitem__(self, name: str) -> np.ndarray:
        row: np.ndarray = self.rows[self.names.index(name)]
        return row

    def __len__(self) -> int:
        return len(self.names)

    def keys(self) -> Iterator[str]:
        """The term names, in order."""
        return iter(self.names)

    def values(self) -> Iterator[np.ndarray]:
        """The terms' float64[W] rows, in order."""
        return iter(self.rows)

    def items(self) -> Iterator[tuple[str, np.ndarray]]:
        """(name, float64[W] row) pairs, in order."""
        return zip(self.names, self.rows, strict=True)


# A decision's cost terms as a selector hands them over: a dict of float64[W] arrays or a `TermTable`.
Terms = dict[str, np.ndarray] | TermTable


class WorkerSelector(ABC):
    """Choose one eligible worker row.

    Args (of `select`):
        costs: float64[W], Dynamo's cost per row from the projection kernel (docs/ROUTING.md,
            `dynamo_cost`; lower wins); +inf at ineligible rows.
        eligible: uint8[W], nonzero where the request may run.
        active_requests: int64[W], live bookings per row (baselines).
        overlap_blocks: int32[W] or None, prefix blocks of the request already cached (or believed
            cached) on each row, as credited by the dispatcher; only read at eligible rows.
        request_blocks: hashed prefix blocks of the request (the denominator of a match ratio).
        view: the per-row projections (`SelectionView`) or None (then selectors that need it fall
            back to `costs`).
    Returns:
        int: the chosen row, or -1 when no row is eligible.
    """

    name: str = ""
    # attributes holding what the selector learnt from past decisions (not configuration): a profile
    # reload that rebuilds a selector of the same type carries them over (`carry_learnt`)
    learnt: tuple[str, ...] = ()

    def __init__(self, seed: int | None = None) -> None:
        self.rng = np.random.default_rng(seed)

    def carry_learnt(self, old: WorkerSelector) -> None:
        """Take over what `old` learnt (its `learnt` attributes) when it is of this very type: a profile
        reload rebuilt the selector (docs/DESIGN.md §4.16); one of another type leaves this one as built."""
        if type(old) is type(self):
            for name in self.learnt:
                setattr(self, name, getattr(old, name))

    @classmethod
    def from_config(cls, cfg: SelectorConfig) -> WorkerSelector:
        """The selector for the `[selector]` table `cfg` (what `create_selector` calls on the class an
        entry point names). Default: `cls(seed=cfg.seed)`; a selector with keys of its own overrides it."""
        return cls(seed=cfg.seed)

    @abstractmethod
    def select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> int:
        """See the class docstring."""

    def select_explained(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> tuple[int, Terms | None]:
        """`select` plus the decision's cost terms (`terms`), or None when they are not computed on the
        way (the dispatcher then asks `terms` itself). Pure, like `select`."""
        return self.select(
            costs, eligible, active_requests, overlap_blocks=overlap_blocks, request_blocks=request_blocks, view=view
        ), None

    def admitted(self, row: int, uncached_tokens: int, now_us: int, isl_tokens: int | None = None) -> None:
        """Learn from an admission that succeeded on `row` (`uncached_tokens` = isl - cached; `isl_tokens`
        the request's prompt tokens when known). Default: nothing."""
        return None

    def terms(
        self, costs: np.ndarray, eligible: np.ndarray, overlap_blocks: np.ndarray, view: SelectionView
    ) -> dict[str, np.ndarray]:
        """Named float64[W] cost terms of a decision, for `kvsched explain`: a selector that picks the
        lowest cost returns the terms that cost sums; one that decides by other figures returns none,
        and `explain` then shows the projection's cost (Dynamo's, `costs`) as a reference it did not use.

        Default: no terms. Pure.
        """
        return {}

    def note_admitted(self, row: int, overlap_blocks: int, request_blocks: int) -> None:
        """The dispatcher reserved `row` for a request with `request_blocks` hashed prompt blocks, of
        which `overlap_blocks` were credited as cached there. Default: nothing to record."""
        return None

    def _pick(self, rows: np.ndarray) -> int:
        """Uniformly random element of a non-empty row array."""
        if rows.size == 1:
            return int(rows[0])
        return int(rows[self.rng.integers(rows.size)])


class CostSelector(WorkerSelector):
    """Lowest cost wins. temperature 0: argmin with a uniformly random tie-break among equal minima;
    temperature T > 0: softmax of -(cost normalised to [0, 1] over the eligible rows) / T. `select` picks
    by the `costs` it is given (the projection's, or a subclass's own total); the `kv` selector and the
    kvsched-bench `dynamo_cost` baseline decide through it."""

    def __init__(self, temperature: float = 0.0, seed: int | None = None) -> None:
        super().__init__(seed)
        self.temperature = float(temperature)

    @classmethod
    def from_config(cls, cfg: SelectorConfig) -> CostSelector:
        """`cls(cfg.temperature, cfg.seed)`."""
        return cls(cfg.temperature, cfg.seed)

    def terms(
        self, costs: np.ndarray, eligible: np.ndarray, overlap_blocks: np.ndarray, view: SelectionView
    ) -> dict[str, np.ndarray]:
        """The one term "cost" (`costs` as given): what `select` picks the lowest of. Pure."""
        return {"cost": costs.astype(np.float64, copy=True)}

    def select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> int:
        if self.temperature <= 0.0:  # fast path: ineligible rows cost +inf (project_and_cost)
            i = int(costs.argmin())
            lo = costs[i]
            if eligible[i] and np.isfinite(lo):
                ties = np.flatnonzero(costs == lo)
                if ties.size == 1:
                    return i
                ties = ties[eligible[ties] != 0]
                return self._pick(ties)
        rows = np.flatnonzero(eligible)
        if rows.size == 0:
            return -1
        c = costs[rows]
        finite = np.isfinite(c)
        if not finite.all():
            if not finite.any():
                return self._pick(rows)
            rows, c = rows[finite], c[finite]
        lo = c.min()
        if self.temperature <= 0.0:
            return self._pick(rows[c == lo])
        span = c.max() - lo
        if span <= 0.0:
            return self._pick(rows)
        weights = np.exp(-((c - lo) / span) / self.temperature)
        cdf = np.cumsum(weights)
        i = int(np.searchsorted(cdf, self.rng.random() * cdf[-1], side="right"))
        return int(rows[min(i, rows.size - 1)])


class RoundRobinSelector(WorkerSelector):
    """The next eligible row at or after the cursor (cyclic); the cursor moves past the pick."""

    name = "round_robin"
    learnt = ("cursor",)

    def __init__(self, seed: int | None = None) -> None:
        super().__init__(seed)
        self.cursor = 0

    def select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> int:
        rows = np.flatnonzero(eligible)
        if rows.size == 0:
            return -1
        i = int(np.searchsorted(rows, self.cursor))
        row = int(rows[i % rows.size])
        self.cursor = row + 1
        return row


class RandomSelector(WorkerSelector):
    """A uniformly random eligible row."""

    name = "random"

    def select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> int:
        rows = np.flatnonzero(eligible)
        return -1 if rows.size == 0 else self._pick(rows)


class LeastLoadedSelector(WorkerSelector):
    """Fewest active requests; random tie-break."""

    name = "least_loaded"

    def select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> int:
        rows = np.flatnonzero(eligible)
        if rows.size == 0:
            return -1
        load = active_requests[rows]
        return self._pick(rows[load == load.min()])


class PowerOfTwoSelector(WorkerSelector):
    """Two distinct random eligible rows; fewer active requests wins (tie: the first drawn)."""

    name = "power_of_two"

    def select(
        self,
        costs: np.ndarray,
        eligible: np.ndarray,
        active_requests: np.ndarray,
        *,
        overlap_blocks: np.ndarray | None = None,
        request_blocks: int = 0,
        view: SelectionView | None = None,
    ) -> int:
        rows = np.flatnonzero(eligible)
        if rows.size <= 1:
            return int(rows[0]) if rows.size else -1
        i = int(self.rng.integers(rows.size))
        j = int(self.rng.integers(rows.size - 1))
        j += j >= i
        a, b = int(rows[i]), int(rows[j])
        return b if active_requests[b] < active_requests[a] else a


def create_selector(cfg: SelectorConfig) -> WorkerSelector:
    """The selector registered as `cfg.type` in the `kvsched.selectors` entry-point group, built by its
    class's `from_config(cfg)` (seeded from `cfg.seed`).

    Raises:
        ValueError: `cfg.type` is not installed (the message names the distribution of a known
            baseline, `kvsched.config.selectors.selector_problem`).
        TypeError: the entry point does not name a `WorkerSelector` subclass.
    """
    ep = selector_entry_point(cfg.type)
    cls = ep.load()
    if not (isinstance(cls, type) and issubclass(cls, WorkerSelector)):
        raise TypeError(f"selector entry point {ep.name} = {ep.value!r} is not a WorkerSelector subclass")
    return cls.from_config(cfg)
