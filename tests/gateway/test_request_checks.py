"""Requests the gateway must answer with an OpenAI-style 400 (not a 500 with a traceback), seen
over HTTP against a real daemon and a scripted engine."""

from __future__ import annotations

import json

import aiohttp

from .conftest import scripted_daemon_fixture

daemon = scripted_daemon_fixture({1: 1}, scope="module")


async def _post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, dict | str]:
    """(status, the JSON answer, or its text when it is not JSON: aiohttp's plain-text 500)."""
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, headers=headers or {}) as resp:
            text = await resp.text()
    try:
        return resp.status, json.loads(text)
    except ValueError:
        return resp.status, text


async def test_a_content_part_whose_text_is_not_a_string_is_a_400_naming_it(stack):
    gw, url, engines, _ = stack
    for text in (5, None):
        body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}
        status, answer = await _post(url, "/v1/chat/completions", body)
        assert status == 400, answer
        assert answer["error"]["type"] == "invalid_request_error" and answer["error"]["code"] == "invalid_request"
        assert "messages[0].content[0].text must be a string" in answer["error"]["message"]
    status, answer = await _post(url, "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": ["w1"]}]})
    assert status == 400 and "messages[0].content[0] must be a content part object" in answer["error"]["message"]
    assert engines[1].seen == []  # none of them was scheduled or forwarded


async def test_max_tokens_beside_a_null_max_completion_tokens_is_the_one_forwarded_and_booked(stack):
    """Before: the null hid max_tokens, the gateway put its 256-token default in the engine's body."""
    gw, url, engines, _ = stack
    body = {"model": "tiny", "max_tokens": 2, "max_completion_tokens": None,
            "messages": [{"role": "user", "content": "w1 w2"}]}
    status, answer = await _post(url, "/v1/chat/completions", body)
    assert status == 200, answer
    assert engines[1].seen[-1]["body"]["max_tokens"] == 2
