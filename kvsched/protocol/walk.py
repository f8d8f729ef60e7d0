"""The elements of a MessagePack array as byte ranges, found without recursion.

msgspec decodes (and skips) nested values recursively and gives up with a `RecursionError` past its
depth limit (~1,000 levels). When a whole message fails that way, these functions still find its
parts: the frames of a `Batch` (so one frame nested too deep is answered alone, with its
`batch_index`, and the others are handled) and the request id of a frame (so its `Error` names it).
The walk is a loop over a count of values still to skip; each value costs at least one byte, so it
ends within `len(raw)` steps whatever the headers claim. Format: the MessagePack specification
(github.com/msgpack/msgpack/blob/master/spec.md).
"""

from __future__ import annotations

import msgspec

_STR = msgspec.msgpack.Decoder(str)

# Fixed sizes: first byte -> bytes of the whole value (scalars, fixext).
_FIXED = {
    0xC0: 1,
    0xC2: 1,
    0xC3: 1,
    0xCA: 5,
    0xCB: 9,
    0xCC: 2,
    0xCD: 3,
    0xCE: 5,
    0xCF: 9,
    0xD0: 2,
    0xD1: 3,
    0xD2: 5,
    0xD3: 9,
    0xD4: 3,
    0xD5: 4,
    0xD6: 6,
    0xD7: 10,
    0xD8: 18,
}
# Length-prefixed payloads: first byte -> (length bytes, extra bytes after the length: ext's type).
_SIZED = {
    0xC4: (1, 0),
    0xC5: (2, 0),
    0xC6: (4, 0),
    0xD9: (1, 0),
    0xDA: (2, 0),
    0xDB: (4, 0),
    0xC7: (1, 1),
    0xC8: (2, 1),
    0xC9: (4, 1),
}
# Containers: first byte -> (count bytes, values per count: 1 array, 2 map).
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}


# Most values one walk visits: past it the walk gives up and the message is answered as a whole.
# Without it a 1 MiB Batch of nested arrays (1M values) took far longer to split (two passes);
# figures: docs/BENCHMARKS.md, "Costs behind code comments".
MAX_WALK_VALUES = 100_000


def skip(raw: bytes | memoryview, pos: int, budget: list[int] | None = None) -> int:
    """The offset just past the one MessagePack value that starts at `pos` (nested values included).
    `budget` ([values left], shared by the calls of one walk) is decremented per value visited.

    Raises:
        ValueError: the bytes end inside the value, hold the reserved byte 0xC1, or the budget ran out.
    """
    n = len(raw)
    pending = 1
    left = budget[0] if budget is not None else -1
    while pending:
        if pos >= n:
            raise ValueError("MessagePack value cut short")
        if left == 0:
            raise ValueError(f"more than {MAX_WALK_VALUES:,} values to walk")
        left -= 1
        pending -= 1
        c = raw[pos]
        if c <= 0x7F or c >= 0xE0:  # positive / negative fixint
            pos += 1
        elif c <= 0x8F:  # fixmap
            pending += 2 * (c & 0x0F)
            pos += 1
        elif c <= 0x9F:  # fixarray
            pending += c & 0x0F
            pos += 1
        elif c <= 0xBF:  # fixstr
            pos += 1 + (c & 0x1F)
        elif c in _FIXED:
            pos += _FIXED[c]
        elif c in _SIZED:
            width, extra = _SIZED[c]
            pos += 1 + width + extra + int.from_bytes(raw[pos + 1 : pos + 1 + width], "big")
        elif c in _CONTAINERS:
            width, per = _CONTAINERS[c]
            pending += per * int.from_bytes(raw[pos + 1 : pos + 1 + width], "big")
            pos += 1 + width
        else:
            raise ValueError("reserved MessagePack byte 0xc1")
    if pos > n:
        raise ValueError("MessagePack value cut short")
    if budget is not None:
        budget[0] = left
    return pos


def array_elements(
    raw: bytes | memoryview, first: int | None = None, budget: list[int] | None = None
) -> list[memoryview]:
    """The encoded elements of the MessagePack array `raw` (at most the `first` ones), as views;
    `budget` as for `skip`.

    Raises:
        ValueError: `raw` is not an array, an element is cut short, or the budget ran out.
    """
    view = memoryview(raw)
    c = view[0] if len(view) else 0xC1
    if 0x90 <= c <= 0x9F:
        count, pos = c & 0x0F, 1
    elif c in (0xDC, 0xDD):
        width = 2 if c == 0xDC else 4
        count, pos = int.from_bytes(view[1 : 1 + width], "big"), 1 + width
    else:
        raise ValueError("not a MessagePack array")
    out = []
    for _ in range(count if first is None else min(count, first)):
        end = skip(view, pos, budget)
        out.append(view[pos:end])
        pos = end
    return out


def tag_of(raw: bytes | memoryview) -> str | None:
    """The tag (first element, a string) of an array-encoded frame, or None. Never raises."""
    try:
        head = array_elements(raw, first=1, budget=[1])  # a tag is one value: anything bigger is not one
        return _STR.decode(head[0]) if head else None
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
        return None


def batch_frames(raw: bytes, max_frames: int) -> list[bytes] | None:
    """The encoded frames of a `Batch` message (`["batch", [frame, ...]]`) that msgspec could not
    decode as a whole, or None when it is not a well-formed batch of at most `max_frames`, or walking
    it would visit more than `MAX_WALK_VALUES` values. The tag is read first, the frames walked once.
    Never raises."""
    try:
        view = memoryview(raw)
        if len(view) < 1 or view[0] != 0x92 or tag_of(raw) != "batch":
            return None
        tag_end = skip(view, 1, [1])
        frames = array_elements(view[tag_end:], budget=[MAX_WALK_VALUES])
        return [bytes(f) for f in frames] if len(frames) <= max_frames else None
    except (ValueError, msgspec.DecodeError, msgspec.ValidationError):
        return None
