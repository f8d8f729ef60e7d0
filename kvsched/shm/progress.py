"""The progress word: one uint64 per slot in the progress segment (docs/DESIGN.md §3.2).

word = generation << 32 | output_tokens (both u32). Only the router holding the slot's lease writes
it; the daemon folds it (`kernels.fold_progress`) and ignores a word whose generation differs from
the slot's current generation, so a late write after release never touches a reused slot.
"""

from __future__ import annotations

import numpy as np

_U32 = 0xFFFF_FFFF


def pack_progress(generation: int, output_tokens: int) -> int:
    """Progress word for (generation u32, output_tokens u32; larger counts saturate at 2**32-1)."""
    if not 0 <= generation <= _U32:
        raise ValueError(f"generation {generation} out of u32 range")
    if output_tokens < 0:
        raise ValueError(f"output_tokens must be >= 0, got {output_tokens}")
    return (generation << 32) | min(output_tokens, _U32)


def write_progress(progress: np.ndarray, slot: int, generation: int, output_tokens: int) -> None:
    """Publish a slot's output tokens with one aligned 8-byte store.

    Assigning a numpy scalar into a uint64 array element compiles to a single 8-byte store
    (numpy copies one itemsize-sized element). The segment is page-aligned and each word is at
    offset 8*slot, so the store is naturally aligned; aligned 8-byte stores are single-copy atomic
    on x86-64 and on AArch64 (ARMv8 guarantees it for naturally aligned doublewords), so the daemon
    never reads a torn word — it sees either the old or the new (generation, tokens) pair.

    Args:
        progress: uint64[max_slots], the mapped progress segment.
        slot: slot index of the lease; generation: the lease's generation (u32).
        output_tokens: output tokens so far (>= 0).
    """
    progress[slot] = np.uint64(pack_progress(generation, output_tokens))
