"""The gateway hashes each request with the block size of the daemon it is connected to now: a
daemon restarted with another `block_size` welcomes the gateway's client again, and the next
request's block hashes follow that Welcome (before: the first Welcome's size was kept until the
gateway restarted, and every prompt of two or more blocks was refused 400 `invalid`)."""

from __future__ import annotations

import asyncio
import re

import aiohttp

from .conftest import scripted_daemon_fixture
from .helpers import eventually, words

daemon = scripted_daemon_fixture({1: 1})


def _set_block_size(d, block_size: int) -> None:
    """Rewrite `block_size` in the daemon's config file (the path after `--config` in its argv)."""
    path = d.argv[d.argv.index("--config") + 1]
    with open(path) as fh:
        text = fh.read()
    with open(path, "w") as fh:
        fh.write(re.sub(r"block_size = \d+", f"block_size = {block_size}", text))


async def _chat(session: aiohttp.ClientSession, url: str, content: str) -> tuple[int, dict]:
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        return resp.status, await resp.json()


async def test_a_daemon_restarted_with_another_block_size_is_followed_without_a_gateway_restart(stack):
    gw, url, engines, d = stack
    sent: list[tuple[int, int]] = []  # (prompt tokens, block hashes) of each schedule() call
    schedule = gw.schedule

    async def recording(request_id, isl, hashes, excluded, hints):
        sent.append((isl, len(hashes)))
        return await schedule(request_id, isl, hashes, excluded, hints)

    gw.schedule = recording
    prompt = words(0, 100)  # ~100 tokens: 7 blocks of 16, 4 of 32
    async with aiohttp.ClientSession() as s:
        status, body = await _chat(s, url, prompt)
        assert status == 200, body
        assert gw.block_size == 16
        for new_size in (32, 16):  # larger (was a 400 for every prompt of >= 2 blocks), then back
            epoch = gw.client.welcome.daemon_epoch
            await asyncio.to_thread(d.stop)
            _set_block_size(d, new_size)
            await asyncio.to_thread(d.restart)
            assert await eventually(lambda epoch=epoch: gw.client.connected and gw.client.welcome.daemon_epoch != epoch)
            assert gw.client.welcome.block_size == new_size
            status, body = await _chat(s, url, prompt + f" w{new_size}")
            assert status == 200, (new_size, body)
            assert gw.block_size == new_size
            isl, n_hashes = sent[-1]
            assert n_hashes == isl // new_size  # full blocks of the new size (16 after 32: not 32's count)
    assert len(engines[1].seen) == 3
