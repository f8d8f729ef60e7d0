"""Scheduling hints of a gateway request: the documented `X-Kvsched-*` headers, with body fallbacks
(docs/GATEWAY.md, "Scheduling hints"), checked against the daemon's bounds before anything is sent.

aiohttp decodes header bytes as UTF-8 with `surrogateescape`: a value that is not valid UTF-8
arrives as a str holding lone surrogates, which cannot be encoded again (the daemon link would fail
with UnicodeEncodeError). Such a value is refused here with a 400 naming the header.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ..client.checks import checked_utf8
from ..protocol import MAX_NAME_CHARS
from . import openai as oa


def _text_header(request: web.Request, name: str) -> str | None:
    """The header's value, or None when absent. Raises HttpError(400, invalid_header) naming the
    header when its bytes were not valid UTF-8 (`client.checks.checked_utf8`)."""
    v = request.headers.get(name)
    if v is not None:
        try:
            checked_utf8(name, v)
        except ValueError:
            raise oa.HttpError(
                400, f"header {name} is not valid UTF-8 text", code="invalid_header", param=name
            ) from None
    return v


def _int_header(request: web.Request, name: str) -> int | None:
    """The header as an int, or None when absent. Raises HttpError(400, invalid_header) otherwise."""
    v = request.headers.get(name)
    if v is None:
        return None
    try:
        return int(v)
    except ValueError:
        raise oa.HttpError(400, f"header {name} must be an integer, got {v!r}", code="invalid_header") from None


def scheduling_hints(request: web.Request, p: oa.Prompt) -> dict:
    """schedule() options from the documented headers, with body fallbacks (docs/GATEWAY.md).

    Returns: keyword arguments of `SchedulerClient.schedule` (policy_class, priority,
        strict_priority, session_id, expected_osl in tokens, deadline_ms in ms, do_not_queue).
    Raises:
        HttpError(400, invalid_header): a hint header that is not valid UTF-8, not an integer where
            one is expected, or out of its bounds (class name over MAX_NAME_CHARS characters,
            priorities outside 32 bits, a deadline outside [0, 86400000] ms).
    """
    h = request.headers
    header_prio = _int_header(request, oa.H_PRIORITY)
    prio_from_body = header_prio is None
    if header_prio is None:
        bp = p.body.get("priority", 0)
        prio = bp if isinstance(bp, int) and not isinstance(bp, bool) else 0
    else:
        prio = header_prio
    session = _text_header(request, oa.H_SESSION)
    if session is None and isinstance(p.body.get("user"), str):  # JSON text: valid UTF-8 (msgspec checks)
        session = p.body["user"]
    hints: dict[str, Any] = {
        "policy_class": _text_header(request, oa.H_CLASS) or "",
        "priority": prio,
        "strict_priority": _int_header(request, oa.H_STRICT) or 0,
        "session_id": session[:MAX_NAME_CHARS] if session else None,
        "expected_osl": p.max_tokens,
        "deadline_ms": _int_header(request, oa.H_DEADLINE),
        "do_not_queue": h.get(oa.H_DO_NOT_QUEUE, "").lower() in ("1", "true", "yes"),
    }
    if len(hints["policy_class"]) > MAX_NAME_CHARS:
        raise oa.HttpError(400, f"header {oa.H_CLASS} longer than {MAX_NAME_CHARS} characters", code="invalid_header")
    if not -(2**31) <= prio < 2**31:  # named where it came from: the body's field or the header
        raise (
            oa.HttpError(400, "'priority' is out of the 32-bit range", code="invalid_request", param="priority")
            if prio_from_body
            else oa.HttpError(
                400, f"header {oa.H_PRIORITY} is out of the 32-bit range", code="invalid_header", param=oa.H_PRIORITY
            )
        )
    if not -(2**31) <= hints["strict_priority"] < 2**31:
        raise oa.HttpError(
            400, f"header {oa.H_STRICT} is out of the 32-bit range", code="invalid_header", param=oa.H_STRICT
        )
    if hints["deadline_ms"] is not None and not (0 <= hints["deadline_ms"] <= 86_400_000):
        raise oa.HttpError(400, f"header {oa.H_DEADLINE} must be in [0, 86400000]", code="invalid_header")
    return hints
