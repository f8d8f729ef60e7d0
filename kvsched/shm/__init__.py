"""Shared-memory layout, numba kernels, progress words and the overlap index (docs/DESIGN.md §3).

Modules: `layout` (the bytes: header, dtypes, slot states, struct-of-arrays views), `segments` (the named
segments: create / attach / unlink), `kernels` (@njit decision kernels),
`admit_kernels` / `admit_packed` (one admission in one call; `argtable`: many arrays as one argument),
`progress` (the progress word),
`overlap` (block hash -> worker bitmask prefix index), `warm` (`warm_kernels`: every kernel compiled
before READY).
"""
