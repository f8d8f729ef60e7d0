"""The gateway's pure parts: request validation, the status-code table, buffering a stream."""

from __future__ import annotations

import pytest

from kvsched import protocol as p
from kvsched.errors import rejection_error
from kvsched.gateway import openai as oa

EXPECTED = {
    "queue_full": (429, True),
    "overloaded": (429, True),
    "all_overloaded": (429, True),
    "do_not_queue": (429, True),
    "timeout": (429, True),
    "no_endpoints": (503, True),
    "shutting_down": (503, True),
    "cancelled": (503, False),
    "invalid": (400, False),
    "pinned_not_allowed": (400, False),
    "duplicate_request": (409, False),
}


def test_every_rejection_reason_has_its_status_and_retry_after_rule():
    assert set(EXPECTED) == set(p.REJECT_REASONS)
    for reason, (status, retry) in EXPECTED.items():
        err = oa.error_for_rejection(rejection_error("r", reason, "why"))
        assert err.status == status, reason
        assert ("Retry-After" in err.headers()) is retry, reason
        assert err.body()["error"]["code"] == reason and "why" in err.body()["error"]["message"]


@pytest.mark.parametrize(
    "kind, body, needle",
    [
        ("chat", [], "JSON object"),
        ("chat", {"messages": [{"role": "user", "content": "x"}]}, "'model'"),
        ("chat", {"model": "m"}, "'messages'"),
        ("chat", {"model": "m", "messages": "hi"}, "'messages'"),
        ("chat", {"model": "m", "messages": [{"content": "x"}]}, "'role'"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": 3}]}, "content"),
        ("chat", {"model": "m", "messages": [{"role": "user"}], "stream": "yes"}, "'stream'"),
        ("completion", {"model": "m"}, "'prompt'"),
        ("completion", {"model": "m", "prompt": ""}, "empty"),
        ("completion", {"model": "m", "prompt": ["a", "b"]}, "one prompt per request"),
        ("completion", {"model": "m", "prompt": "a", "max_tokens": 0}, "'max_tokens'"),
        (
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0, "max_tokens": 5},
            "'max_completion_tokens' must be a positive integer",
        ),
        (
            "chat",
            {
                "model": "m",
                "messages": [{"role": "user", "content": "x"}],
                "max_completion_tokens": 5,
                "max_tokens": "5",
            },
            "'max_tokens' must be a positive integer",
        ),
        # were a 500 (ValueError: expected_osl outside the daemon's wire bound [0, 2**31-1])
        (
            "completion",
            {"model": "m", "prompt": "a", "max_tokens": 2**31},
            "'max_tokens' must be at most 2147483647 tokens",
        ),
        (
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 2**40},
            "'max_completion_tokens' must be at most 2147483647 tokens",
        ),
        ("completion", {"model": "m", "prompt": "a", "n": 3}, "'n' must be 1"),
        ("chat", {"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 2}, "'n' must be 1"),
        ("completion", {"model": "m", "prompt": "a", "best_of": 2}, "'best_of' must be 1"),
        ("completion", {"model": "m", "prompt": [1, 2**31]}, "token ids must be integers in [0, 2147483647]"),
        ("completion", {"model": "m", "prompt": [[5, 2**80]]}, "token ids must be integers in [0, 2147483647]"),
        ("completion", {"model": "m", "prompt": [1, -1]}, "token ids must be integers in [0, 2147483647]"),
        # were answered 200 (the priority silently 0, the role passed to the template)
        ("completion", {"model": "m", "prompt": "a", "priority": "x"}, "'priority' must be an integer"),
        ("completion", {"model": "m", "prompt": "a", "priority": 1.5}, "'priority' must be an integer"),
        ("chat", {"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role 'wizard'"),
        # were a 500 (TypeError joining the parts) or, for a bare string part, silently dropped
        (
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
            "messages[0].content[0].text must be a string, got a number",
        ),
        (
            "chat",
            {
                "model": "m",
                "messages": [
                    {"role": "user", "content": "x"},
                    {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": None}]},
                ],
            },
            "messages[1].content[1].text must be a string, got null",
        ),
        (
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "text"}]}]},
            "messages[0].content[0].text must be a string, got null",
        ),
        (
            "chat",
            {"model": "m", "messages": [{"role": "user", "content": ["w1"]}]},
            "messages[0].content[0] must be a content part object",
        ),
    ],
)
def test_bad_bodies_are_400_with_a_message_naming_the_field(kind, body, needle):
    with pytest.raises(oa.HttpError) as err:
        oa.parse_body(kind, body)
    assert err.value.status == 400 and needle in err.value.message


def test_n_of_one_is_accepted():
    assert oa.parse_body("completion", {"model": "m", "prompt": "a", "n": 1}).model == "m"


def test_prompt_as_token_ids_and_stream_options_are_read():
    got = oa.parse_body(
        "completion",
        {
            "model": "m",
            "prompt": [[5, 6, 7]],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": 9,
        },
    )
    assert got.token_ids == [5, 6, 7] and got.stream and got.include_usage and got.max_tokens == 9
    fwd = oa.engine_body(got)
    assert fwd["stream"] is True and fwd["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert got.body["stream_options"] == {"include_usage": True}  # the client's body is not changed


def test_collector_rebuilds_a_chat_completion_from_chunks():
    c = oa.Collector("chat")
    c.add(
        {
            "id": "x",
            "created": 1,
            "model": "m",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        }
    )
    c.add({"id": "x", "choices": [{"index": 0, "delta": {"content": "Hel"}}], "usage": {"completion_tokens": 1}})
    c.add({"id": "x", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]})
    c.add({"id": "x", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}})
    r = c.response()
    assert r["object"] == "chat.completion" and r["id"] == "x"
    assert r["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello"}, "finish_reason": "stop", "logprobs": None}
    ]
    assert r["usage"]["completion_tokens"] == 2


def test_text_parts_are_joined_with_a_newline_as_vllm_does_and_other_part_types_left_to_the_engine():
    """vLLM renders a message's text parts joined by "\n" (its chat_utils, "string" content format); a
    gateway joining them with "" tokenized another prompt than the engine's (other hashes, counts)."""
    body = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "w1"},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": "w2"},
                ],
            }
        ],
    }
    oa.parse_body("chat", body)
    assert oa.chat_messages(body)[0]["content"] == "w1\nw2"


@pytest.mark.parametrize(
    "kind, fields, expected",
    [
        # a null max_completion_tokens is an absent one (was: None, so the 256-token default)
        ("chat", {"max_completion_tokens": None, "max_tokens": 5}, 5),
        ("completion", {"max_completion_tokens": None, "max_tokens": 5}, 5),
        ("chat", {"max_completion_tokens": 7, "max_tokens": 5}, 7),
        ("chat", {"max_completion_tokens": 7}, 7),
        ("chat", {"max_tokens": None}, None),
        # /v1/completions: the engine (vLLM's CompletionRequest) has no max_completion_tokens; only max_tokens counts
        ("completion", {"max_completion_tokens": 7, "max_tokens": 5}, 5),
        ("completion", {"max_completion_tokens": 7}, None),
    ],
)
def test_max_tokens_is_what_the_engine_will_use(kind, fields, expected):
    base = (
        {"model": "m", "prompt": "a"}
        if kind == "completion"
        else {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    assert oa.parse_body(kind, {**base, **fields}).max_tokens == expected


def test_the_part_types_vllm_renders_as_text_are_rendered_alike():
    """Found from outside: vLLM renders input_text, output_text, refusal and thinking parts as text too;
    the gateway rendered only `text` parts (fewer tokens, other hashes than the engine's)."""
    body = {
        "model": "m",
        "messages": [
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "input_text", "text": "b"},
                    {"type": "output_text", "text": "c"},
                    {"type": "refusal", "refusal": "d"},
                    {"type": "thinking", "thinking": "e"},
                    {"type": "image_url"},
                ],
            }
        ],
    }
    oa.parse_body("chat", body)
    assert oa.chat_messages(body)[0]["content"] == "a\nb\nc\nd\ne"


@pytest.mark.parametrize("part", [{"type": "refusal", "refusal": 5}, {"type": "input_text"}])
def test_a_text_like_part_without_a_string_is_a_400_naming_its_key(part):
    body = {"model": "m", "messages": [{"role": "user", "content": [part]}]}
    with pytest.raises(oa.HttpError, match="content\\[0\\]"):
        oa.parse_body("chat", body)
