"""The one splitmix64 definition (`kvsched.shm.mix`) against the generator's published outputs, and
every user of it (kernel, KV-event group keys, trace hashes) against it."""

from __future__ import annotations

import numpy as np

from kvsched.kvevents.format import block_key
from kvsched.shm import kernels
from kvsched.shm.mix import GOLDEN, U64_MASK, mix64, mix64_array, splitmix64_array
from kvsched.shm.segments import ledger_instance, ledger_name
from kvsched.sim.trace import splitmix64

# Vigna's splitmix64.c seeded with 1234567: its first five outputs (a widely reproduced test vector).
SEED = 1234567
FIRST_OUTPUTS = [
    6457827717110365317,
    3203168211198807973,
    9817491932198370423,
    4593380528125082431,
    16408922859458223821,
]
EDGE = [0, 1, 2, 0xFFFF, 2**32 - 1, 2**32, 2**63, U64_MASK]


def test_splitmix64_reproduces_the_published_sequence():
    states = np.array([(SEED + k * GOLDEN) & U64_MASK for k in range(5)], dtype=np.uint64)
    assert splitmix64_array(states).tolist() == FIRST_OUTPUTS
    assert [mix64((SEED + (k + 1) * GOLDEN) & U64_MASK) for k in range(5)] == FIRST_OUTPUTS


def test_every_user_computes_the_same_mixer():
    keys = np.array(EDGE, dtype=np.uint64)
    want = [mix64(k) for k in EDGE]
    assert mix64_array(keys).tolist() == want
    assert [int(kernels.mix64(np.uint64(k))) for k in EDGE] == want
    assert splitmix64(keys).tolist() == [mix64(k + GOLDEN) for k in EDGE]
    assert [block_key(k, 2) for k in EDGE] == [mix64(k + 2 * GOLDEN) for k in EDGE]
    assert [block_key(k, 0) for k in EDGE] == EDGE  # group 0 keeps the hash itself


def test_ledger_instance_inverts_ledger_name():
    for instance in ("default", "pool-a", "a.b_c"):
        assert ledger_instance(ledger_name(instance)) == instance
    for name in ("kvsched--ledger", "kvsched-x-progress", "other-x-ledger", ""):
        assert ledger_instance(name) is None
