"""The gateway hashes with its daemon's `kv_hash_seed` (the daemon's `Welcome.hash_seed`); its own
`hash_seed` is only an optional override, checked against the daemon's: equal, requests are served;
different, every request answers 503 naming both values (docs/GATEWAY.md "Status codes"). Before,
the gateway hashed with its own `hash_seed` (unset: vLLM's default) whatever the daemon checked the
engines' events against, and a pool configured as docs/VLLM.md showed `hashes = MISMATCH`."""

from __future__ import annotations

from contextlib import asynccontextmanager

import aiohttp
import numpy as np

from kvsched.gateway.openai import chat_messages
from kvsched.hashing import block_hashes

from .conftest import scripted_daemon_fixture
from .helpers import scripted_stack, words

DAEMON_SEED = "7"
daemon = scripted_daemon_fixture({1: 1}, scope="module", daemon_extra=f'kv_hash_seed = "{DAEMON_SEED}"\n')
stack_with = asynccontextmanager(scripted_stack)


async def _chat(url: str, content: str) -> tuple[int, dict]:
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    async with aiohttp.ClientSession() as s, s.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


def _recording(gw) -> list[np.ndarray]:
    """Record the block hashes of every `schedule()` call of the in-process gateway `gw`."""
    sent: list[np.ndarray] = []
    schedule = gw.schedule

    async def recording(request_id, isl, hashes, excluded, hints):
        sent.append(np.asarray(hashes, dtype=np.uint64))
        return await schedule(request_id, isl, hashes, excluded, hints)

    gw.schedule = recording
    return sent


def _expected(gw, content: str, seed: str | None) -> np.ndarray:
    tok = gw.tokenizers["tiny"]
    ids = tok.encode(tok.render_chat(chat_messages({"messages": [{"role": "user", "content": content}]})))
    return block_hashes(ids, 16, mode="vllm", hash_seed=seed)


async def test_gateway_without_an_override_hashes_with_the_daemons_seed(daemon, tmp_path):
    async with stack_with(daemon, tmp_path) as (gw, url, _engines, _):
        sent = _recording(gw)
        prompt = words(0, 80)
        status, body = await _chat(url, prompt)
        assert status == 200, body
        want = _expected(gw, prompt, DAEMON_SEED)
        assert len(want) >= 4 and np.array_equal(sent[-1], want)
        assert not np.array_equal(want, _expected(gw, prompt, None))  # vLLM's default seed hashes otherwise


async def test_gateway_override_equal_to_the_daemons_seed_is_served(daemon, tmp_path):
    async with stack_with(daemon, tmp_path, hash_seed=DAEMON_SEED) as (gw, url, engines, _):
        sent = _recording(gw)
        status, body = await _chat(url, words(100, 80))
        assert status == 200, body
        assert np.array_equal(sent[-1], _expected(gw, words(100, 80), DAEMON_SEED))
        assert len(engines[1].seen) == 1


async def test_gateway_override_other_than_the_daemons_seed_answers_503_naming_both(daemon, tmp_path):
    async with stack_with(daemon, tmp_path, hash_seed="8") as (gw, url, engines, _):
        sent = _recording(gw)
        for _ in range(2):  # every request, not only the first after the Welcome
            status, body = await _chat(url, words(200, 80))
            assert status == 503, body
            err = body["error"]
            assert err["code"] == "hash_seed_mismatch" and err["type"] == "service_unavailable", err
            assert "hash_seed = '8'" in err["message"] and "kv_hash_seed = '7'" in err["message"], err
            assert daemon.endpoint in err["message"], err  # which pool's daemon
        assert sent == [] and engines[1].seen == []  # nothing scheduled, nothing forwarded
