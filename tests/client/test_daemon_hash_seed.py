"""Routers hash through the client: `SchedulerClient.block_hashes(tokens)` uses the block size and the
`kv_hash_seed` of the daemon it is connected to (both from its `Welcome`), so every router of a pool
hashes with the one seed the daemon checks the engines' KV events against (docs/VLLM.md)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsched.client import DaemonUnavailable, SchedulerClient, SyncSchedulerClient
from kvsched.config import load_config
from kvsched.errors import ConfigError
from kvsched.hashing import BlockHashCache, block_hashes
from tests.conftest import daemon_fixture

SEED = "1234"  # not the default: the vLLM-mode chain starts at sha256(cbor("1234")), not at "vllm-none-hash"
BLOCK = 32  # not the default 16 either
daemon = daemon_fixture(f"""
[daemon]
block_size = {BLOCK}
kv_hash_seed = "{SEED}"

[[workers]]
worker_id = 1
""")

TOKENS = list(range(100, 300))  # 6 complete blocks of 32 and a partial one


async def test_client_block_hashes_equal_the_free_function_with_the_daemons_seed_and_block_size(daemon):
    want = block_hashes(TOKENS, BLOCK, mode="vllm", hash_seed=SEED)
    assert len(want) == len(TOKENS) // BLOCK
    assert not np.array_equal(want, block_hashes(TOKENS, BLOCK, mode="vllm"))  # the seed matters
    async with SchedulerClient(daemon.endpoint) as client:
        assert client.welcome.hash_seed == SEED
        assert np.array_equal(client.block_hashes(TOKENS), want)
        cache = BlockHashCache()
        assert np.array_equal(client.block_hashes(np.array(TOKENS), cache=cache), want)
        assert np.array_equal(client.block_hashes(TOKENS, cache=cache), want) and cache.hits == len(want)
        # the overrides are the free function's: a fleet without KV events may hash with xxhash (same seed)
        assert np.array_equal(
            client.block_hashes(TOKENS, mode="xxhash"), block_hashes(TOKENS, BLOCK, mode="xxhash", hash_seed=SEED)
        )
        extra = [("lora-a",)] * (len(TOKENS) // BLOCK)
        assert np.array_equal(
            client.block_hashes(TOKENS, extra_keys=extra),
            block_hashes(TOKENS, BLOCK, mode="vllm", hash_seed=SEED, extra_keys=extra),
        )


def test_sync_client_block_hashes_use_the_daemons_seed(daemon):
    with SyncSchedulerClient(daemon.endpoint) as client:
        got = client.block_hashes(TOKENS)
    assert np.array_equal(got, block_hashes(TOKENS, BLOCK, mode="vllm", hash_seed=SEED))


async def test_client_block_hashes_before_the_welcome_raise_daemon_unavailable(daemon):
    """Without a Welcome the client knows neither the block size nor the seed: it says so at once
    (no wait, no guess). A bypass-mode client whose daemon never answered is in that state."""
    client = SchedulerClient(daemon.endpoint)
    with pytest.raises(DaemonUnavailable, match="no Welcome"):
        client.block_hashes(TOKENS)
    await client.close()
    missing = daemon.endpoint.replace(".sock", "-nobody.sock")
    bypass = SchedulerClient(missing, on_unavailable="bypass", bypass_workers=[(1, 0)])
    await bypass.connect()
    try:
        with pytest.raises(DaemonUnavailable, match="no Welcome"):
            bypass.block_hashes(TOKENS)
    finally:
        await bypass.close()


def test_a_kv_hash_seed_longer_than_the_welcome_carries_is_a_config_error(tmp_path):
    """`Welcome.hash_seed` holds at most 128 characters: a longer seed would make every client refuse
    the daemon's Welcome, so the config refuses it, naming the key."""
    path = tmp_path / "cfg.toml"
    path.write_text(f'[daemon]\nkv_hash_seed = "{"s" * 128}"\n')
    assert load_config(path, env={}).daemon.kv_hash_seed == "s" * 128
    path.write_text(f'[daemon]\nkv_hash_seed = "{"s" * 129}"\n')
    with pytest.raises(ConfigError, match=r"kv_hash_seed"):
        load_config(path, env={})
