"""The state word: the second uint64 per slot in the progress segment (layout version 2).

word = generation << 32 | flags, flags: bit 0 `dispatched` (the backend accepted the request), bit 1
`prefill_done` (first output token seen: the prefill load leaves the worker). `prefill_done` implies
`dispatched`, so a router sets both bits for it. Only the router holding the slot's lease writes the
word, with one aligned 8-byte store per change; the daemon folds it together with the progress word
(`kernels.fold_words`) and ignores a word whose generation is not the slot's current one, so a late
store after release never touches a reused slot. Flags only accumulate for one generation: the
daemon never moves a slot backwards (at most one `dispatched`, `prefill_done` after it), the same
rules as the `Update(dispatched)` / `Update(prefill_done)` frames that routers without the mapping
send instead (docs/PROTOCOL.md, "Shared memory").
"""

from __future__ import annotations

import numpy as np

STATE_DISPATCHED = 1
STATE_PREFILL_DONE = 2
STATE_FLAGS = STATE_DISPATCHED | STATE_PREFILL_DONE
_U32 = 0xFFFF_FFFF


def pack_state(generation: int, flags: int) -> int:
    """State word for (generation u32, flags). `STATE_PREFILL_DONE` adds `STATE_DISPATCHED`.

    Raises:
        ValueError: generation outside u32, or flags outside `STATE_FLAGS`.
    """
    if not 0 <= generation <= _U32:
        raise ValueError(f"generation {generation} out of u32 range")
    if flags & ~STATE_FLAGS or flags < 0:
        raise ValueError(f"state flags {flags} not within {STATE_FLAGS}")
    if flags & STATE_PREFILL_DONE:
        flags |= STATE_DISPATCHED
    return (generation << 32) | flags


def unpack_state(word: int) -> tuple[int, int]:
    """(generation, flags) of a state word."""
    word = int(word)
    return word >> 32, word & STATE_FLAGS


def write_state(state: np.ndarray, slot: int, generation: int, flags: int) -> int:
    """Add `flags` to a slot's state word for `generation` with one aligned 8-byte store.

    Flags already stored for the same generation are kept (read, OR, store: the lease holder is the
    only writer of its slot's word, so nothing can change between the read and the store). A word
    left by an earlier generation is replaced. For the store's atomicity see
    `kvsched.shm.progress.write_progress`: the same argument holds for this array.

    Args:
        state: uint64[max_slots], the state words of the mapped progress segment.
        slot: the lease's slot; generation: its generation (u32).
        flags: `STATE_DISPATCHED` and/or `STATE_PREFILL_DONE`.
    Returns:
        int: the word stored.
    """
    old_gen, old_flags = unpack_state(state[slot])
    if old_gen == generation:
        flags |= old_flags
    word = pack_state(generation, flags)
    state[slot] = np.uint64(word)
    return word
