"""`kvsched-sim-engine` names the model the client asked for in every answer, streamed or not (was:
its `--model`, "sim" by default, in streamed chunks, so a gateway's streamed answers named "sim"
while its buffered ones, from another engine, named "tiny")."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")

from aiohttp.test_utils import TestClient, TestServer

from kvsched.gateway.local_fleet import write_tiny_tokenizer
from kvsched.gateway.tokenizer import ModelTokenizer
from kvsched.sim.http_engine import HttpSimEngine

pytestmark = pytest.mark.timeout(60)


async def test_streamed_and_buffered_answers_name_the_requested_model(tmp_path):
    sim = HttpSimEngine(ModelTokenizer(str(write_tiny_tokenizer(tmp_path / "tok"))), "sim", 16, 1000, speedup=1000.0)
    sim.start()
    client = TestClient(TestServer(sim.app()))
    await client.start_server()
    try:
        body = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 3}
        resp = await client.post("/v1/completions", json={**body, "stream": True})
        lines = [ln[6:] for ln in (await resp.text()).splitlines() if ln.startswith("data: ") and ln != "data: [DONE]"]
        assert lines and {json.loads(ln)["model"] for ln in lines} == {"tiny"}
        resp = await client.post("/v1/completions", json=body)
        assert (await resp.json())["model"] == "tiny"
    finally:
        await client.close()
        await sim.stop()


async def test_max_completion_tokens_counts_on_chat_only_as_in_vllm(tmp_path):
    """Was: /v1/completions honoured `max_completion_tokens`, which vLLM's completions API does not
    have (it ignores it; the gateway counts only `max_tokens` there)."""
    sim = HttpSimEngine(ModelTokenizer(str(write_tiny_tokenizer(tmp_path / "tok"))), "sim", 16, 1000, speedup=1000.0)
    sim.start()
    client = TestClient(TestServer(sim.app()))
    await client.start_server()
    try:
        both = {"model": "tiny", "max_completion_tokens": 2, "max_tokens": 5}
        resp = await client.post("/v1/completions", json={**both, "prompt": "w1 w2 w3"})
        assert (await resp.json())["usage"]["completion_tokens"] == 5
        resp = await client.post("/v1/chat/completions", json={**both, "messages": [{"role": "user", "content": "w1"}]})
        assert (await resp.json())["usage"]["completion_tokens"] == 2
        resp = await client.post(
            "/v1/chat/completions",
            json={"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "w1"}]},
        )
        assert (await resp.json())["usage"]["completion_tokens"] == 4
    finally:
        await client.close()
        await sim.stop()
