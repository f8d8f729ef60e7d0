"""What the gateway does with each chunk of an engine's SSE stream: count output tokens, pass the
chunk on (bytes unchanged where possible), drop what the client did not ask for (docs/GATEWAY.md).

No I/O. The gateway asks the engine for usage on every chunk (`continuous_usage_stats`) so output
tokens can be reported as they stream; a client that did not ask for it must not see it. A chunk
with choices and a usage the client did not ask for loses its `usage` member; a usage-only chunk
(no choices) is dropped unless the client asked for `include_usage`.

Each chunk is decoded into a small typed struct (only `choices`' text, `usage` and `error` are
read; everything else is skipped by the decoder, not built into dicts), and the usage member is cut
out of the engine's bytes rather than re-encoding the whole chunk. Anything the fast path does not
recognise (a non-object chunk, unexpected field types, usage not written compactly) goes through
the general path: decode to Python objects, edit, re-encode.
"""

from __future__ import annotations

from typing import Any

import msgspec

_decode = msgspec.json.decode
_encode = msgspec.json.encode


class EngineStreamError(Exception):
    """The engine sent an error object instead of choices in its stream."""


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None
    text: str | None = None


_ABSENT = msgspec.Raw()  # a member the chunk does not have (a JSON null is Raw(b"null"))


class _Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: msgspec.Raw = _ABSENT
    error: msgspec.Raw = _ABSENT


class _Usage(msgspec.Struct):
    completion_tokens: int = 0


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_usage_decoder = msgspec.json.Decoder(_Usage)


class Relay:
    """Per-request state of one streamed relay.

    Args:
        kind: "chat" (tokens in `choices[i].delta.content`) or "completion" (`choices[i].text`).
        include_usage: the client asked for the final usage chunk (`stream_options.include_usage`).
        continuous_usage: the client asked for usage on every chunk (`continuous_usage_stats`).
    Attributes:
        output_tokens: output tokens seen so far (tokens): the engine's `usage.completion_tokens`
            when the chunk has a usage object, else one more per choice with non-empty text.
        chunks: JSON objects seen (payloads that are not objects are dropped, not counted).
    """

    __slots__ = ("chunks", "continuous_usage", "include_usage", "kind", "output_tokens")

    def __init__(self, kind: str, include_usage: bool, continuous_usage: bool) -> None:
        self.kind = kind
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage
        self.output_tokens = 0
        self.chunks = 0

    def chunk(self, data: bytes) -> bytes | None:
        """One SSE `data:` payload (not `[DONE]`): returns the payload to send the client, or None
        to send nothing for it. Updates `output_tokens` and `chunks`.

        Raises:
            EngineStreamError: an `error` member and no choices.
            msgspec.DecodeError: the payload is not JSON.
        """
        try:
            c = _chunk_decoder.decode(data)
        except msgspec.ValidationError:  # valid JSON of an unexpected shape: the general path
            return self._general(data)
        raw = bytes(c.usage)
        usage = None
        if raw and raw != b"null":
            try:
                usage = _usage_decoder.decode(raw)
            except msgspec.ValidationError:  # usage not an object, or a count that is not an int
                return self._general(data)
        self.chunks += 1
        if len(c.error) and not c.choices:
            raise EngineStreamError(f"engine error in stream: {_decode(c.error)}")
        if usage is None:
            self.output_tokens += self._count(c.choices)
            return data
        self.output_tokens = max(self.output_tokens, usage.completion_tokens)
        if not c.choices:
            return data if self.include_usage else None
        if self.continuous_usage:
            return data
        # Cut `"usage":<raw>` and its comma out of the bytes: the key written compactly exactly
        # once (a key inside a JSON string has escaped quotes, so it cannot match), followed by
        # the member's bytes as decoded.
        if data.count(b'"usage":') == 1:
            start = data.find(b'"usage":')
            end = start + 8 + len(raw)
            if data.startswith(raw, start + 8):
                if data[start - 1 : start] == b",":
                    return data[: start - 1] + data[end:]
                if data[end : end + 1] == b",":
                    return data[:start] + data[end + 1 :]
        return self._general(data, counted=True)  # usage not written compactly: re-encode

    def _count(self, choices: list[_Choice] | None) -> int:
        n = 0
        for ch in choices or ():
            text = (ch.delta.content if ch.delta is not None else None) if self.kind == "chat" else ch.text
            if text:
                n += 1
        return n

    def _general(self, data: bytes, counted: bool = False) -> bytes | None:
        """The same rules on the chunk decoded to Python objects (re-encoded when edited);
        `counted`: the fast path already counted this chunk and its tokens."""
        chunk: Any = _decode(data)
        if not isinstance(chunk, dict):
            return None
        usage = chunk.get("usage")
        if not counted:
            self.chunks += 1
            if "error" in chunk and not chunk.get("choices"):
                raise EngineStreamError(f"engine error in stream: {chunk['error']}")
            if isinstance(usage, dict):
                done = usage.get("completion_tokens", 0)
                if isinstance(done, int) and not isinstance(done, bool):
                    self.output_tokens = max(self.output_tokens, done)
            else:
                self.output_tokens += chunk_tokens(chunk, self.kind)
        if usage is None:
            return data
        if not chunk.get("choices"):
            return data if self.include_usage else None
        if self.continuous_usage:
            return data
        del chunk["usage"]
        return _encode(chunk)


def chunk_tokens(chunk: dict, kind: str) -> int:
    """Output tokens a chunk carries when the engine sends no usage: one per non-empty choice."""
    n = 0
    for ch in chunk.get("choices") or ():
        if not isinstance(ch, dict):
            continue
        text = (ch.get("delta") or {}).get("content") if kind == "chat" else ch.get("text")
        if text:
            n += 1
    return n
