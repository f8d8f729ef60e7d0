"""Policy-class assignment for replays: the `--class-rule` syntax and a pure per-row assignment.

Rules (the text of `kvsched replay --class-rule`):

* `none` — every request in the profile's `default_class` (the default).
* `isl:latency<4096,agents<16384,batch` — ISL bands: a request goes to the first band whose bound
  (tokens, exclusive) its ISL is below; a last name without a bound catches the rest (when every band
  has a bound, the rest go to the default class). Bounds must increase. `isl` alone = the profile's
  classes in their listed order with bounds 4096, 16384, 65536, ... (x4 each), the last unbounded.
* `hash:latency=60,agents=30,batch=10` — deterministic weighted assignment by the hash of the
  request's row index (SplitMix64): row i always lands in the same class, whatever `--limit` is.
  Weights are non-negative numbers (not necessarily summing to 100).
* `column:NAME` — a trace column holding the class name (a key of each Mooncake JSON line, or a CSV
  column); an empty value means the default class.

`parse_class_rule()` checks the syntax, `check_class_names()` the names against the profile, and
`assign_classes()` maps every trace row to a class. Pure: no I/O except `read_class_column()`.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import numpy as np

from .trace import splitmix64

RuleKind = Literal["none", "isl", "hash", "column"]
ISL_DEFAULT_FIRST_BOUND = 4096  # tokens: `isl` alone starts its bands here
ISL_DEFAULT_BOUND_FACTOR = 4  # each further band's bound is this times the previous one
_U53 = float(1 << 53)


class ClassRuleError(ValueError):
    """A `--class-rule` that does not parse, or names classes the profile does not have."""


@dataclass(frozen=True, slots=True)
class ClassRule:
    """A parsed `--class-rule` (module docstring).

    Attributes:
        kind: none | isl | hash | column.
        names: class names in rule order (isl bands / hash entries); empty for none / column.
        bounds: isl: exclusive ISL upper bound per band (tokens), None for the last catch-all band.
        weights: hash: weight per name (>= 0, sum > 0).
        column: column: the trace column holding the class name.
        text: the rule as given.
    """

    kind: RuleKind
    names: tuple[str, ...] = ()
    bounds: tuple[int | None, ...] = ()
    weights: tuple[float, ...] = ()
    column: str = ""
    text: str = "none"


@dataclass(frozen=True, slots=True)
class ClassAssignment:
    """Every trace row's class: `names[codes[i]]` is row i's class name.

    Attributes:
        names: distinct class names (codes index into it).
        codes: uint8[n] (or wider) per trace row.
    """

    names: tuple[str, ...]
    codes: np.ndarray

    def __len__(self) -> int:
        return int(self.codes.shape[0])

    def name_of(self, i: int) -> str:
        return self.names[int(self.codes[i])]

    def counts(self) -> dict[str, int]:
        """class name -> rows assigned to it (every name listed, zero included)."""
        c = np.bincount(self.codes, minlength=len(self.names))
        return {n: int(c[k]) for k, n in enumerate(self.names)}


def parse_class_rule(text: str, profile_classes: Sequence[str] = ()) -> ClassRule:
    """Parse a `--class-rule` string.

    Args:
        text: the rule (module docstring).
        profile_classes: the profile's class names in order (only `isl` alone needs them).
    Raises:
        ClassRuleError: the rule does not parse; the message quotes the offending part.
    """
    s = text.strip()
    kind, _, body = s.partition(":")
    kind = kind.strip().lower()
    body = body.strip()
    if kind == "none" and not body:
        return ClassRule("none", text=s)
    if kind == "isl":
        return _parse_isl(body, profile_classes, s)
    if kind == "hash":
        return _parse_hash(body, s)
    if kind == "column":
        if not body:
            raise ClassRuleError("class rule 'column:NAME' needs a column name")
        return ClassRule("column", column=body, text=s)
    raise ClassRuleError(f"unknown class rule {text!r}; expected none, isl:..., hash:... or column:NAME")


def _parse_isl(body: str, profile_classes: Sequence[str], text: str) -> ClassRule:
    if not body:
        if not profile_classes:
            raise ClassRuleError("class rule 'isl' without bands needs a profile with classes")
        n = len(profile_classes)
        default_bounds = [ISL_DEFAULT_FIRST_BOUND * ISL_DEFAULT_BOUND_FACTOR**k for k in range(n - 1)]
        return ClassRule("isl", tuple(profile_classes), (*default_bounds, None), text=text)
    names: list[str] = []
    bounds: list[int | None] = []
    last_bound = 0  # the previous band's bound (bounds increase)
    parts = [p.strip() for p in body.split(",")]
    for k, part in enumerate(parts):
        name, sep, bound = part.partition("<")
        name = name.strip()
        if not name:
            raise ClassRuleError(f"class rule {text!r}: band {part!r} has no class name")
        if not sep:
            if k != len(parts) - 1:
                raise ClassRuleError(f"class rule {text!r}: only the last band may omit its bound ({part!r})")
            names.append(name)
            bounds.append(None)
            continue
        try:
            value = int(bound.strip())
        except ValueError:
            raise ClassRuleError(
                f"class rule {text!r}: bound {bound.strip()!r} is not a whole number of tokens"
            ) from None
        if value < 1 or value <= last_bound:
            raise ClassRuleError(f"class rule {text!r}: bounds must be >= 1 and increase ({part!r})")
        names.append(name)
        bounds.append(value)
        last_bound = value
    _check_unique(names, text)
    return ClassRule("isl", tuple(names), tuple(bounds), text=text)


def _parse_hash(body: str, text: str) -> ClassRule:
    if not body:
        raise ClassRuleError("class rule 'hash:' needs name=weight entries, e.g. hash:latency=60,batch=40")
    names: list[str] = []
    weights: list[float] = []
    for part in (p.strip() for p in body.split(",")):
        name, sep, weight = part.partition("=")
        name = name.strip()
        try:
            value = float(weight) if sep else -1.0
        except ValueError:
            value = -1.0
        if not name or not np.isfinite(value) or value < 0:
            raise ClassRuleError(f"class rule {text!r}: {part!r} is not name=weight with a weight >= 0")
        names.append(name)
        weights.append(value)
    _check_unique(names, text)
    if sum(weights) <= 0:
        raise ClassRuleError(f"class rule {text!r}: the weights sum to 0")
    return ClassRule("hash", tuple(names), weights=tuple(weights), text=text)


def _check_unique(names: list[str], text: str) -> None:
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ClassRuleError(f"class rule {text!r}: class {', '.join(dup)} listed twice")


def check_class_names(names: Sequence[str], profile_classes: Sequence[str]) -> None:
    """Raise `ClassRuleError` naming every name the profile does not define (and the ones it does)."""
    known = set(profile_classes)
    unknown = [n for n in dict.fromkeys(names) if n not in known]
    if unknown:
        raise ClassRuleError(
            f"class rule names unknown class{'es' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
            f"the profile defines {', '.join(map(repr, profile_classes))}"
        )


def assign_classes(
    rule: ClassRule, isl: np.ndarray, default_class: str, column_values: Sequence[str] | None = None
) -> ClassAssignment:
    """Each trace row's class under `rule` (deterministic; no randomness beyond the index hash).

    Args:
        rule: a parsed rule.
        isl: int64[n], prompt tokens per row.
        default_class: the profile's default class (rule `none`, empty column values, ISL past
            every bound).
        column_values: rule `column`: the column's value per row (n of them).
    Raises:
        ClassRuleError: `column` without values, or a different number of values than rows.
    """
    n = int(isl.shape[0])
    if rule.kind == "none":
        return ClassAssignment((default_class,), np.zeros(n, dtype=np.uint8))
    if rule.kind == "isl":
        return _assign_isl(rule, isl, default_class)
    if rule.kind == "hash":
        return _assign_hash(rule, n)
    if column_values is None or len(column_values) != n:
        got = "none" if column_values is None else len(column_values)
        raise ClassRuleError(f"class rule {rule.text!r}: {got} column values for {n} requests")
    values = [v or default_class for v in column_values]
    names = tuple(dict.fromkeys(values))
    index = {name: k for k, name in enumerate(names)}
    return ClassAssignment(names, _codes([index[v] for v in values], len(names)))


def _assign_isl(rule: ClassRule, isl: np.ndarray, default_class: str) -> ClassAssignment:
    bounded = [b for b in rule.bounds if b is not None]
    band = np.searchsorted(np.asarray(bounded, dtype=np.int64), isl, side="right")  # first bound > isl
    names = rule.names
    if len(bounded) == len(rule.bounds):  # every band bounded: the rest go to the default class
        if default_class in names:
            band = np.where(band == len(names), names.index(default_class), band)
        else:
            names = (*names, default_class)
    return ClassAssignment(names, _codes(band, len(names)))


def _assign_hash(rule: ClassRule, n: int) -> ClassAssignment:
    u = (splitmix64(np.arange(n, dtype=np.uint64)) >> np.uint64(11)).astype(np.float64) / _U53  # [0, 1)
    w = np.asarray(rule.weights, dtype=np.float64)
    edges = np.cumsum(w) / w.sum()
    band = np.minimum(np.searchsorted(edges, u, side="right"), len(w) - 1)
    return ClassAssignment(rule.names, _codes(band, len(rule.names)))


def _codes(values, n_names: int) -> np.ndarray:
    dtype = np.uint8 if n_names <= 256 else np.uint32
    return np.asarray(values, dtype=dtype)


def read_class_column(path: str | Path, column: str, limit: int | None = None) -> list[str]:
    """The `column` of each trace row as a string, in `load_trace`'s row order ("" where absent).

    Mooncake `.jsonl`: the key `column` of each non-blank line. Azure `.csv`: the CSV column, rows
    sorted by `TIMESTAMP` (stable) after taking the first `limit`, as `trace.load_azure` does.
    Raises:
        ClassRuleError: the column appears in no row (or is not in the CSV header).
    """
    p = Path(path)
    if p.suffix == ".csv":
        return _csv_column(p, column, limit)
    values: list[str] = []
    seen = False
    with open(p, "rb") as fh:
        for line in fh:
            if limit is not None and len(values) >= limit:
                break
            line = line.strip()
            if not line:
                continue
            row = msgspec.json.decode(line)
            v = row.get(column) if isinstance(row, dict) else None
            seen = seen or v is not None
            values.append("" if v is None else str(v))
    if values and not seen:
        raise ClassRuleError(f"class rule 'column:{column}': {p} has no {column!r} field")
    return values


def _csv_column(p: Path, column: str, limit: int | None) -> list[str]:
    stamps: list[str] = []
    values: list[str] = []
    with open(p, newline="") as fh:
        reader = csv.DictReader(fh)
        if column not in (reader.fieldnames or ()):
            raise ClassRuleError(f"class rule 'column:{column}': {p} has columns {reader.fieldnames}, not {column!r}")
        for row in reader:
            if limit is not None and len(values) >= limit:
                break
            stamps.append(row["TIMESTAMP"].strip())
            values.append((row[column] or "").strip())
    t = np.array(stamps, dtype="datetime64[us]").astype(np.int64)
    return [values[k] for k in np.argsort(t, kind="stable")]
