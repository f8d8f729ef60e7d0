"""Synthetic token ids per trace block: deterministic, shared by every request holding the block, and
carried by the simulated engines' BlockStored events when enabled."""

from __future__ import annotations

import numpy as np

from kvsched.shm.mix import GOLDEN, U64_MASK, mix64_array
from kvsched.sim.tokens import VOCAB, TokenIdPublisher, token_ids_for


def block_token_ids(block_hash: int, block_size: int) -> np.ndarray:
    """The ids of one block, block by block (the statement `token_ids_for` computes for all blocks at
    once): int64[block_size], SplitMix64 of hash + k·golden, modulo VOCAB."""
    with np.errstate(over="ignore"):
        z = mix64_array(
            np.uint64(int(block_hash) & U64_MASK) + np.arange(1, block_size + 1, dtype=np.uint64) * np.uint64(GOLDEN)
        )
    return (z % np.uint64(VOCAB)).astype(np.int64)


def test_block_ids_depend_only_on_the_block_hash():
    a = block_token_ids(12345, 16)
    assert a.shape == (16,) and a.dtype == np.int64
    assert (a == block_token_ids(12345, 16)).all()
    assert not (a == block_token_ids(12346, 16)).all()
    assert a.min() >= 0 and a.max() < VOCAB
    assert len(set(a.tolist())) > 12  # not a constant run
    assert token_ids_for([1, 2, 3], 8) == token_ids_for([1, 2], 8) + block_token_ids(3, 8).tolist()


class _Recorder:
    def __init__(self):
        self.stored, self.removed, self.flushed = [], [], 0

    def block_stored(self, hashes, parent=None, block_size=16, *, token_ids=None):
        self.stored.append((list(hashes), parent, block_size, token_ids))

    def block_removed(self, hashes):
        self.removed.append(list(hashes))

    def flush(self):
        self.flushed += 1


def test_engine_events_carry_the_token_ids_of_their_blocks():
    from kvsched.sim.engine import SimEngine, SimRequest

    rec = _Recorder()
    eng = SimEngine(64, 4)
    eng.cache_listener = TokenIdPublisher(rec)
    eng.submit(SimRequest("r", 12, 2, (7, 8, 9)), 0)
    for _ in range(100):
        t = eng.next_step_end()
        if t is None:
            break
        eng.step()
    stored = [h for hs, *_ in rec.stored for h in hs]
    assert stored == [7, 8, 9]
    for hashes, _parent, bs, ids in rec.stored:
        assert ids == token_ids_for(hashes, bs)
    eng.cache_listener.flush()
    assert rec.flushed == 1


def test_token_ids_for_equals_the_blocks_ids_concatenated():
    hashes = [0, 1, 2**63 + 5, 2**64 - 1, 10**9 + 17, -1]  # -1: a signed view of 2**64 - 1
    want = np.concatenate([block_token_ids(h & (2**64 - 1), 16) for h in hashes]).tolist()
    assert token_ids_for(hashes, 16) == want
    assert token_ids_for(np.asarray(hashes[:5], dtype=np.uint64), 16) == want[:80]
    assert token_ids_for([], 16) == []
