"""A `/v1/completions` prompt given as token ids reaches the engine as token ids (docs/GATEWAY.md).

The OpenAI completions API takes `prompt` as a string, a list of token ids, or a one-element list of
either (https://platform.openai.com/docs/api-reference/completions/create). A one-token prompt `[3]`
is a list of token ids, not a one-element list wrapping the int 3: the gateway and the simulated
engine must both serve it, and the lease must be released.
"""

from __future__ import annotations

import aiohttp
import pytest

from .helpers import eventually, ledger

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]


@pytest.mark.parametrize("prompt", [[3], [3, 4], [[3]]])
async def test_token_id_prompt_of_any_length_is_served_with_its_token_count(fleet, prompt):
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            fleet.gateway_urls[0] + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 2}
        ) as resp,
    ):
        body = await resp.json()
    assert resp.status == 200, body
    n = len(prompt[0]) if isinstance(prompt[0], list) else len(prompt)
    assert body["usage"]["prompt_tokens"] == n
    assert body["usage"]["completion_tokens"] == 2
    assert await eventually(lambda: ledger(fleet.daemon.admin_endpoint) == (0, 0), 10)
