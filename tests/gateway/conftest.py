"""Fixtures of the end-to-end gateway tests: a LocalFleet (daemon + HTTP sim engines + gateways)."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """Three simulated engines (speedup 20), KV-aware daemon with KV events, two gateway processes
    (request bodies limited to 64 KiB, prompts to 4,000 tokens)."""
    from kvsched.gateway.local_fleet import LocalFleet

    f = LocalFleet.start(tmp_path_factory.mktemp("fleet"), n_engines=3, n_gateways=2, speedup=20.0,
                         gateway_extra="max_body_bytes = 65536\nmax_prompt_tokens = 4000")
    yield f
    f.stop()
