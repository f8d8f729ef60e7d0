"""OpenAI request parsing, error bodies and the status-code table of the gateway (docs/GATEWAY.md).

No I/O: turns request bodies into `Prompt`s (text + tokens + scheduling hints) or `HttpError`s, and
builds the OpenAI-shaped bodies the gateway sends back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import DaemonUnavailable, RequestRejected
from ..protocol import MAX_TOKENS

RETRY_AFTER_S = 1  # Retry-After (s) on 429 and retryable 503
MAX_TOKEN_ID = 2**31 - 1  # engines hold token ids as int32 (vLLM: torch.int32 input ids); larger is no vocabulary index
MAX_OUTPUT_TOKENS = MAX_TOKENS  # the daemon's wire bound on expected_osl (protocol.limits.Tokens)

# Rejection reason -> HTTP status (OpenAI clients retry 429 and 503 with backoff).
REJECT_STATUS: dict[str, int] = {
    "queue_full": 429,
    "overloaded": 429,
    "all_overloaded": 429,
    "do_not_queue": 429,
    "timeout": 429,
    "no_endpoints": 503,
    "shutting_down": 503,
    "cancelled": 503,
    "invalid": 400,
    "pinned_not_allowed": 400,
    "duplicate_request": 409,
}
_NO_RETRY_AFTER = frozenset({"cancelled", "invalid", "pinned_not_allowed", "duplicate_request"})

# Headers that carry scheduling hints (body fields `priority` / `user` are the fallbacks).
H_CLASS = "X-Kvsched-Class"
H_PRIORITY = "X-Kvsched-Priority"
H_STRICT = "X-Kvsched-Strict-Priority"
H_SESSION = "X-Kvsched-Session-Id"
H_DEADLINE = "X-Kvsched-Deadline-Ms"
H_DO_NOT_QUEUE = "X-Kvsched-Do-Not-Queue"


class HttpError(Exception):
    """An answer other than 200: status, OpenAI error type, message, optional Retry-After (s)."""

    def __init__(
        self,
        status: int,
        message: str,
        err_type: str = "invalid_request_error",
        code: str | None = None,
        retry_after_s: int | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.code = code
        self.retry_after_s = retry_after_s
        self.param = param

    def body(self) -> dict:
        """`{"error": {"message", "type", "param", "code"}}` as OpenAI sends it."""
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


def error_for_rejection(exc: RequestRejected) -> HttpError:
    """The daemon refused the request: map its reason through `REJECT_STATUS`."""
    status = REJECT_STATUS.get(exc.reason, 503)
    retry = None if exc.reason in _NO_RETRY_AFTER or status not in (429, 503) else RETRY_AFTER_S
    err_type = {429: "rate_limit_error", 400: "invalid_request_error", 409: "conflict_error"}.get(
        status, "service_unavailable"
    )
    return HttpError(
        status,
        f"scheduler rejected the request: {exc.reason}" + (f" ({exc.detail})" if getattr(exc, "detail", "") else ""),
        err_type,
        exc.reason,
        retry,
    )


def error_for_unavailable(exc: DaemonUnavailable) -> HttpError:
    return HttpError(503, f"scheduler unavailable: {exc}", "service_unavailable", "daemon_unavailable", RETRY_AFTER_S)


@dataclass(slots=True)
class Prompt:
    """A parsed request: what to tokenize and how to schedule it.

    Attributes:
        kind: "chat" or "completion".
        model: the requested model name.
        body: the request body as decoded (forwarded to the engine after `engine_body`).
        text: prompt text (chat: the rendered template), or None when the prompt came as token ids.
        token_ids: prompt token ids, filled by the gateway after tokenizing.
        stream: the client wants SSE.
        include_usage: the client asked for the usage chunk (`stream_options.include_usage`).
        max_tokens: output tokens asked for (None = the engine's default).
    """

    kind: str
    model: str
    body: dict
    text: str | None = None
    token_ids: list[int] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False
    max_tokens: int | None = None


# Chat roles: OpenAI's (system, developer, user, assistant, tool, function) plus Llama 3's `ipython`
# (tool output), which chat templates of vLLM models render.
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function", "ipython"})


def _bad(message: str, param: str | None = None) -> HttpError:
    return HttpError(400, message, "invalid_request_error", "invalid_request", param=param)


def _max_tokens(kind: str, body: dict) -> int | None:
    """Output tokens asked for (None: not given). Chat: `max_completion_tokens`, else `max_tokens`,
    a null the same as an absent key (vLLM: `max_completion_tokens or max_tokens`). Completions:
    `max_tokens` only, as vLLM's CompletionRequest has no `max_completion_tokens` (the engine ignores
    it, so counting it would book an output the engine does not limit itself to).
    Raises HttpError(400) naming the field when a given value is not an integer in
    [1, MAX_OUTPUT_TOKENS]."""
    found = None
    for key in ("max_completion_tokens", "max_tokens") if kind == "chat" else ("max_tokens",):
        v = body.get(key)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise _bad(f"'{key}' must be a positive integer", key)
        if v > MAX_OUTPUT_TOKENS:
            raise _bad(f"'{key}' must be at most {MAX_OUTPUT_TOKENS} tokens, got {v}", key)
        found = v if found is None else found
    return found


def parse_body(kind: str, body: Any) -> Prompt:
    """Validate the fields the gateway relies on (the engine validates the rest).

    Raises:
        HttpError(400): not an object, no model, missing or empty messages / prompt, bad types
            (a `priority` that is not an integer included), a chat role outside `CHAT_ROLES`, a
            content part that is not an object or a `text` part whose `text` is not a string,
            `n` or `best_of` other than 1.
    """
    if not isinstance(body, dict):
        raise _bad("request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("missing required field 'model'", "model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be a boolean", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    max_tokens = _max_tokens(kind, body)
    prio = body.get("priority")
    if prio is not None and (not isinstance(prio, int) or isinstance(prio, bool)):
        raise _bad("'priority' must be an integer", "priority")
    for key in ("n", "best_of"):  # one lease books one sequence's KV blocks
        if body.get(key, 1) not in (1, None) or isinstance(body.get(key), bool):
            raise _bad(
                f"'{key}' must be 1: the gateway schedules one sequence per request (send n requests instead)", key
            )
    p = Prompt(
        kind,
        model,
        body,
        stream=stream,
        include_usage=bool(opts.get("include_usage")),
        continuous_usage=bool(opts.get("continuous_usage_stats")),
        max_tokens=max_tokens,
    )
    if kind == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise _bad("missing required field 'messages' (a non-empty list)", "messages")
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise _bad(f"messages[{i}] must be an object with a string 'role'", "messages")
            if m["role"] not in CHAT_ROLES:
                raise _bad(
                    f"messages[{i}].role {m['role'][:64]!r} is not one of {', '.join(sorted(CHAT_ROLES))}", "messages"
                )
            c = m.get("content")
            if c is not None and not isinstance(c, (str, list)):
                raise _bad(f"messages[{i}].content must be a string or a list of parts", "messages")
            if isinstance(c, list):
                _check_parts(i, c)
        return p
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("'prompt' is empty", "prompt")
        p.text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
            raise _bad(f"token ids must be integers in [0, {MAX_TOKEN_ID}] (a vocabulary index)", "prompt")
        p.token_ids = list(prompt)
    elif prompt is None:
        raise _bad("missing required field 'prompt'", "prompt")
    else:
        raise _bad("'prompt' must be a string or a list of token ids (one prompt per request)", "prompt")
    return p


_JSON_TYPES = {
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    list: "an array",
    dict: "an object",
    type(None): "null",
}


def _check_parts(i: int, parts: list) -> None:
    """Content parts of messages[i]: objects (OpenAI's schema); a text part's text (`TEXT_PARTS`) a string.

    A bare string part is refused, not read as text: OpenAI's schema has none, and the gateway must
    tokenize what the engine renders (vLLM reads one as text; its own joining of parts may differ).
    Raises HttpError(400) naming the part, e.g. `messages[0].content[0].text must be a string, got a number`.
    """
    for j, part in enumerate(parts):
        if not isinstance(part, dict):
            raise _bad(
                f"messages[{i}].content[{j}] must be a content part object such as "
                f'{{"type": "text", "text": "..."}}, got {_JSON_TYPES.get(type(part), "a value")}',
                "messages",
            )
        key = TEXT_PARTS.get(part["type"]) if "type" in part else None
        if key is not None and not isinstance(part.get(key), str):
            raise _bad(
                f"messages[{i}].content[{j}].{key} must be a string, got "
                f"{_JSON_TYPES.get(type(part.get(key)), 'a value')}",
                "messages",
            )


TEXT_PART_SEPARATOR = "\n"  # vLLM joins a message's text parts with a newline (chat_utils, "string" content format)
# The part types vLLM renders as text (its chat_utils), each with the key that holds the text.
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal", "thinking": "thinking"}


def chat_messages(body: dict) -> list[dict]:
    """Messages with list-of-parts content flattened to text (what text-only templates expect): the text
    parts joined with a newline, as vLLM renders them, so the gateway's token ids and block hashes are
    the engine's. The simulated engine renders with this function too."""
    out = []
    for m in body["messages"]:
        c = m.get("content")
        if isinstance(c, list):
            c = TEXT_PART_SEPARATOR.join(
                _part_text(part) for part in c if isinstance(part, dict) and part.get("type") in TEXT_PARTS
            )
        out.append({**m, "content": c if c is not None else ""})
    return out


def _part_text(part: dict) -> str:
    """The text of a text-like part (`TEXT_PARTS`); "" when it is not a string (the gateway refuses such a
    part before rendering, `_check_parts`; the simulated engine renders what it is sent)."""
    text = part.get(TEXT_PARTS[part["type"]])
    return text if isinstance(text, str) else ""


def engine_body(p: Prompt) -> dict:
    """The body sent to the engine: always streamed, with usage on every chunk (vLLM's
    `continuous_usage_stats`) so output tokens can be reported as they come."""
    body = dict(p.body)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return body


class Collector:
    """Buffers an engine's streamed chunks into one non-streaming OpenAI response."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.first: dict | None = None
        self.parts: dict[int, list[str]] = {}
        self.finish: dict[int, Any] = {}
        self.roles: dict[int, str] = {}
        self.usage: dict | None = None

    def add(self, chunk: dict) -> None:
        if self.first is None:
            self.first = chunk
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        for ch in chunk.get("choices") or ():
            i = ch.get("index", 0)
            if self.kind == "chat":
                delta = ch.get("delta") or {}
                if delta.get("role"):
                    self.roles[i] = delta["role"]
                text = delta.get("content")
            else:
                text = ch.get("text")
            if text:
                self.parts.setdefault(i, []).append(text)
            if ch.get("finish_reason") is not None:
                self.finish[i] = ch["finish_reason"]

    def response(self) -> dict:
        first = self.first or {}
        idx = sorted(set(self.parts) | set(self.finish) | set(self.roles)) or [0]
        if self.kind == "chat":
            choices = [
                {
                    "index": i,
                    "message": {"role": self.roles.get(i, "assistant"), "content": "".join(self.parts.get(i, []))},
                    "finish_reason": self.finish.get(i),
                    "logprobs": None,
                }
                for i in idx
            ]
            obj = "chat.completion"
        else:
            choices = [
                {
                    "index": i,
                    "text": "".join(self.parts.get(i, [])),
                    "finish_reason": self.finish.get(i),
                    "logprobs": None,
                }
                for i in idx
            ]
            obj = "text_completion"
        return {
            "id": first.get("id", ""),
            "object": obj,
            "created": first.get("created", 0),
            "model": first.get("model", ""),
            "choices": choices,
            "usage": self.usage,
        }
