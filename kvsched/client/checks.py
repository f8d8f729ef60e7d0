"""Local checks of `schedule()` arguments: a bad argument raises before anything is sent.

The daemon decodes every frame against typed bounds (`kvsched.protocol`); a frame that fails there is
answered with an `Error`, which can name the caller only when the request id itself was readable.
Checking the same bounds here gives the caller a precise `TypeError` / `ValueError` at the call site
instead. The bounds are the ones of `protocol.Enqueue` (docs/PROTOCOL.md, "Enqueue").
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Union

import numpy as np

from .. import protocol as p

# What `schedule(block_hashes=...)` accepts: little-endian u64 bytes, ints, or a numpy integer array.
BlockHashes = Union[bytes, bytearray, memoryview, Sequence[int], "np.ndarray[Any, np.dtype[np.integer[Any]]]"]

_I32 = (-(2**31), 2**31 - 1)
_U32 = (0, 0xFFFF_FFFF)
_U16 = (0, 0xFFFF)
_TOKENS = (0, p.MAX_TOKENS)
MAX_TOKENS = p.MAX_TOKENS  # a token count's wire bound (`protocol.limits.Tokens`)
_MAX_ALLOWED = 4096
_MAX_DEADLINE_MS = 86_400_000


def checked_int(name: str, value: Any, lo: int, hi: int) -> int:
    """An int (not a bool; numpy integers accepted) in [lo, hi]. Raises TypeError / ValueError
    naming the argument. A plain `int` takes one exact type check (`schedule()` checks several per
    call)."""
    checked: int = value if type(value) is int else _as_int(name, value)  # exact: bool is refused there
    if not lo <= checked <= hi:
        raise ValueError(f"{name}={checked} is outside [{lo}, {hi}]")
    return checked


def _as_int(name: str, value: Any) -> int:
    """`value` as a plain int when it is an int subclass other than bool or a numpy integer (a plain
    int: the frame encoder refuses other int subclasses)."""
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    return int(value)


def checked_utf8(name: str, value: str) -> str:
    """`value` when UTF-8 can encode it (one `isascii` scan when it is ASCII). Raises ValueError naming
    the argument when it holds a lone surrogate (e.g. bytes that were not UTF-8, decoded with
    `surrogateescape`): a frame carrying it could not be encoded, the link would fail on it later."""
    if not value.isascii():
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise ValueError(
                f"{name} is not valid Unicode text: a lone surrogate at index {exc.start} cannot be encoded as UTF-8"
            ) from None
    return value


def _str(name: str, value: Any, max_len: int, *, min_len: int = 0, utf8_bytes: bool = False) -> str:
    """A str of min_len..max_len characters (UTF-8 bytes with `utf8_bytes`) that UTF-8 can encode.

    Raises:
        TypeError: not a str.
        ValueError: out of bounds, or holding a lone surrogate (`checked_utf8`).
    """
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str, not {type(value).__name__}")
    checked_utf8(name, value)
    n = len(value)
    if utf8_bytes and not (min_len <= n and 4 * n <= max_len):  # else n..4n UTF-8 bytes: surely in bounds
        n = len(value.encode())
    if n < min_len or n > max_len:
        unit = "UTF-8 bytes" if utf8_bytes else "characters"
        raise ValueError(f"{name} has {n} {unit}; allowed {min_len}..{max_len}")
    return value


def checked_enqueue(
    request_id: Any,
    isl_tokens: Any,
    block_hashes: BlockHashes | None,
    policy_class: Any,
    priority: Any,
    strict_priority: Any,
    session_id: Any,
    expected_osl: Any,
    pinned: Any,
    allowed_workers: Iterable[int] | None,
    do_not_queue: Any,
    deadline_ms: Any,
    lora_name: Any,
    excluded_workers: Iterable[int] | None = None,
) -> p.Enqueue:
    """Build an `Enqueue` after checking every argument against the wire bounds.

    Args: as `SchedulerClient.schedule` (request_id: str of 1..128 UTF-8 bytes; isl_tokens: int in
        [1, 2**31-1] tokens; priority / strict_priority: i32; expected_osl: tokens or None; pinned:
        (worker_id u32, dp_rank u16) or None; allowed_workers: at most 4096 u32 ids or None;
        deadline_ms: [0, 86_400_000] ms or None; excluded_workers: at most 4096 u32 ids or None;
        names at most 128 characters).
    Returns:
        The frame to send.
    Raises:
        TypeError: an argument of the wrong type (e.g. `request_id=42`, `isl_tokens="10"`).
        ValueError: a value out of bounds (e.g. `isl_tokens=0`, a 200-byte id, `priority=2**40`),
            a str argument UTF-8 cannot encode (a lone surrogate, e.g. "\\udcff"), or malformed
            `block_hashes` (see `protocol.hashes_to_bytes`).
    """
    _str("request_id", request_id, p.MAX_REQUEST_ID_BYTES, min_len=1, utf8_bytes=True)
    isl_tokens = checked_int("isl_tokens", isl_tokens, 1, MAX_TOKENS)
    raw = p.hashes_to_bytes(block_hashes if block_hashes is not None else b"")
    if len(raw) > 8 * p.MAX_BLOCK_HASHES:
        raise ValueError(f"{len(raw) // 8} block hashes; at most {p.MAX_BLOCK_HASHES} per request")
    _str("policy_class", policy_class, p.MAX_NAME_CHARS)
    priority = checked_int("priority", priority, *_I32)
    strict_priority = checked_int("strict_priority", strict_priority, *_I32)
    if session_id is not None:
        _str("session_id", session_id, p.MAX_NAME_CHARS)
    if expected_osl is not None:
        expected_osl = checked_int("expected_osl", expected_osl, *_TOKENS)
    if pinned is not None:
        try:
            worker_id, dp_rank = pinned
        except (TypeError, ValueError):
            raise TypeError("pinned must be a (worker_id, dp_rank) pair") from None
        pinned = (checked_int("pinned worker_id", worker_id, *_U32), checked_int("pinned dp_rank", dp_rank, *_U16))
    if allowed_workers is not None:
        if isinstance(allowed_workers, (str, bytes)):
            raise TypeError("allowed_workers must be an iterable of worker ids")
        allowed_workers = [checked_int("allowed_workers item", w, *_U32) for w in allowed_workers]
        if len(allowed_workers) > _MAX_ALLOWED:
            raise ValueError(f"allowed_workers has {len(allowed_workers)} ids; at most {_MAX_ALLOWED}")
    if not isinstance(do_not_queue, bool):
        raise TypeError(f"do_not_queue must be a bool, not {type(do_not_queue).__name__}")
    if deadline_ms is not None:
        deadline_ms = checked_int("deadline_ms", deadline_ms, 0, _MAX_DEADLINE_MS)
    if lora_name is not None:
        _str("lora_name", lora_name, p.MAX_NAME_CHARS)
    excluded = None
    if excluded_workers is not None:  # not a truth test: a numpy array [0] is falsy, [0, 1] ambiguous
        if isinstance(excluded_workers, (str, bytes)):
            raise TypeError("excluded_workers must be an iterable of worker ids")
        excluded = sorted(checked_int("excluded_workers item", w, *_U32) for w in excluded_workers)
        if len(excluded) > _MAX_ALLOWED:
            raise ValueError(f"excluded_workers has {len(excluded)} ids; at most {_MAX_ALLOWED}")
        excluded = excluded or None  # none excluded: the field stays off the wire
    return p.Enqueue(
        request_id,
        isl_tokens,
        raw,
        policy_class,
        priority,
        strict_priority,
        session_id,
        expected_osl,
        pinned,
        allowed_workers,
        do_not_queue,
        deadline_ms,
        lora_name,
        excluded,
    )
