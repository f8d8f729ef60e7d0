"""The stream relay's chunk rules against a reference model: decode every chunk to Python objects,
count output tokens, drop or edit the usage member, re-encode (what the gateway did before the
relay learnt to cut bytes). Outputs are compared as JSON values; byte-level tests check that the
fast path leaves the engine's bytes alone."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.gateway.relay import EngineStreamError, Relay, chunk_tokens


def reference(payloads: list[bytes], kind: str, include_usage: bool, continuous_usage: bool):
    """(payloads sent to the client as JSON values, output tokens, chunks, error) per the rules."""
    sent, tokens, chunks = [], 0, 0
    for data in payloads:
        chunk = json.loads(data)
        if not isinstance(chunk, dict):
            continue
        chunks += 1
        if "error" in chunk and not chunk.get("choices"):
            return sent, tokens, chunks, True
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            tokens = max(tokens, usage.get("completion_tokens", 0))
        else:
            tokens += chunk_tokens(chunk, kind)
        if usage is not None:
            if not chunk.get("choices"):
                if not include_usage:
                    continue
            elif not continuous_usage:
                del chunk["usage"]
        sent.append(chunk)
    return sent, tokens, chunks, False


def run(payloads: list[bytes], kind: str, include_usage: bool, continuous_usage: bool):
    relay = Relay(kind, include_usage, continuous_usage)
    sent = []
    try:
        for data in payloads:
            out = relay.chunk(data)
            if out is not None:
                sent.append(json.loads(out))
    except EngineStreamError:
        return sent, relay.output_tokens, relay.chunks, True
    return sent, relay.output_tokens, relay.chunks, False


text = st.one_of(st.none(), st.just(""), st.text(max_size=6))
choice = st.fixed_dictionaries(
    {"index": st.integers(0, 2)},
    optional={
        "delta": st.one_of(
            st.none(), st.fixed_dictionaries({}, optional={"content": text, "role": st.just("assistant")})
        ),
        "text": text,
        "finish_reason": st.sampled_from([None, "stop", "length"]),
    },
)
usage = st.one_of(
    st.none(),
    st.fixed_dictionaries(
        {"prompt_tokens": st.integers(0, 10**6), "completion_tokens": st.integers(0, 10**4)},
        optional={
            "total_tokens": st.integers(0, 10**6),
            "prompt_tokens_details": st.one_of(st.none(), st.fixed_dictionaries({"cached_tokens": st.integers(0, 99)})),
        },
    ),
)


@st.composite
def chunk_payload(draw) -> bytes:
    if draw(st.integers(0, 30)) == 0:  # the odd payload that is not an object, or carries an error
        return draw(
            st.sampled_from(
                [b"[1, 2]", b'"x"', b"3", b'{"error": {"message": "boom"}}', b'{"error": null, "choices": []}']
            )
        )
    fields = [
        ("id", draw(st.text(max_size=4))),
        ("object", "chat.completion.chunk"),
        ("choices", draw(st.lists(choice, max_size=2))),
    ]
    if draw(st.booleans()):
        fields.insert(draw(st.integers(0, len(fields))), ("usage", draw(usage)))
    obj = dict(fields)
    style = draw(st.sampled_from(["compact", "spaced", "ascii"]))
    if style == "compact":
        return msgspec.json.encode(obj)
    return json.dumps(obj, ensure_ascii=style == "ascii").encode()


@settings(max_examples=300, deadline=None)
@given(st.lists(chunk_payload(), max_size=12), st.sampled_from(["chat", "completion"]), st.booleans(), st.booleans())
def test_relay_matches_the_reference_rules(payloads, kind, include_usage, continuous_usage):
    assert run(payloads, kind, include_usage, continuous_usage) == reference(
        payloads, kind, include_usage, continuous_usage
    )


def test_compact_chunk_loses_only_its_usage_bytes():
    # the engine's escapes and number spelling survive (a re-encode would write "é" and 1.0e0 differently)
    data = (
        b'{"id":"c\\u00e9","choices":[{"index":0,"delta":{"content":"\\u00e9"},"logprobs":1.0e0}],'
        b'"usage":{"prompt_tokens":3,"completion_tokens":7,"prompt_tokens_details":{"cached_tokens":0}}}'
    )
    relay = Relay("chat", include_usage=True, continuous_usage=False)
    assert (
        relay.chunk(data) == b'{"id":"c\\u00e9","choices":[{"index":0,"delta":{"content":"\\u00e9"},"logprobs":1.0e0}]}'
    )
    assert relay.output_tokens == 7
    first = b'{"usage":{"completion_tokens":8},"choices":[{"index":0,"text":"x"}]}'
    assert relay.chunk(first) == b'{"choices":[{"index":0,"text":"x"}]}' and relay.output_tokens == 8


def test_usage_is_passed_on_when_asked_and_final_usage_only_with_include_usage():
    data = b'{"choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"completion_tokens":1}}'
    final = b'{"choices":[],"usage":{"completion_tokens":1}}'
    assert Relay("chat", True, True).chunk(data) is data
    assert Relay("chat", True, False).chunk(final) is final
    assert Relay("chat", False, False).chunk(final) is None


def test_error_chunk_raises_and_bad_json_raises_decode_error():
    with pytest.raises(EngineStreamError, match="boom"):
        Relay("chat", False, False).chunk(b'{"error":{"message":"boom"},"choices":[]}')
    with pytest.raises(msgspec.DecodeError):
        Relay("chat", False, False).chunk(b'{"choices": [')
