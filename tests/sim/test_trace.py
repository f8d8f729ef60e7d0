"""Trace loaders: Mooncake JSONL and Azure CSV on small fixtures."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvsched.sim.trace import load_trace, splitmix64

MOONCAKE = (
    '{"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]}\n'
    '{"timestamp": 0, "input_length": 1500, "output_length": 7, "hash_ids": [0, 1, 2]}\n'
    "\n"
    '{"timestamp": 2500, "input_length": 300, "output_length": 0, "hash_ids": [5]}\n'
)
AZURE = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n"
    "2023-11-16 18:15:50.9951690,396,109\n"
    "2023-11-16 18:15:51.0000000,20,1\n"
)


def test_mooncake_rows_become_arrays_when_loaded(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(MOONCAKE)
    t = load_trace(p)
    assert len(t) == 3 and t.block_size == 512
    assert t.arrival_us.tolist() == [0, 0, 2_500_000]
    assert t.isl.tolist() == [1000, 1500, 300]
    assert t.osl.tolist() == [5, 7, 1]  # 0 output tokens clamps to 1
    assert t.hashes.dtype == np.uint64
    assert t.hashes_of(1)[:2].tolist() == t.hashes_of(0).tolist()  # shared prefix ids -> equal hashes
    assert t.hashes_of(2).tolist() == splitmix64(np.array([5])).tolist()
    assert len(set(t.hashes.tolist())) == 4 and 0 not in t.hashes.tolist()


def test_mooncake_limit_and_head_when_truncated(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(MOONCAKE)
    assert len(load_trace(p, limit=2)) == 2
    h = load_trace(p).head(1)
    assert len(h) == 1 and h.hashes.size == 2 and h.hash_offsets.tolist() == [0, 2]


def test_infinite_cache_bound_counts_prefix_hits(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(MOONCAKE)
    assert load_trace(p).infinite_cache_hit_tokens() == 2 * 512


def test_azure_csv_has_no_hashes_when_loaded(tmp_path):
    p = tmp_path / "t.csv"
    p.write_text(AZURE)
    t = load_trace(p)
    assert len(t) == 3 and t.hashes.size == 0 and t.hashes_of(2).size == 0
    assert t.arrival_us.tolist() == [0, 4_314_579, 4_319_410]
    assert t.isl.tolist() == [374, 396, 20]


def test_unknown_extension_is_refused(tmp_path):
    p = tmp_path / "t.txt"
    p.write_text("x")
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(p)


def test_bundled_slice_loads_with_block_size_512():
    from importlib.resources import files

    path = files("kvsched") / "data" / "mooncake_slice.jsonl"
    t = load_trace(str(path))
    assert len(t) >= 100 and t.block_size == 512
    assert all(len(t.hashes_of(i)) == -(-int(t.isl[i]) // 512) for i in range(len(t)))


def test_mooncake_hash_ids_span_full_u64_when_loaded(tmp_path):
    """Ids are any u64 (SplitMix64 is a bijection on u64): 2^63 and 2^64-1 load, distinct and mixed."""
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 1, '
        '"hash_ids": [9223372036854775808, 18446744073709551615]}\n'
    )
    t = load_trace(p)
    expect = splitmix64(np.array([2**63, 2**64 - 1], dtype=np.uint64)).tolist()
    assert t.hashes.tolist() == expect and len(set(expect)) == 2


@pytest.mark.parametrize("ids", ["[18446744073709551616]", "[-1]"])
def test_mooncake_hash_id_out_of_u64_names_path_line(tmp_path, ids):
    p = tmp_path / "t.jsonl"
    p.write_text(
        MOONCAKE.splitlines()[0]
        + "\n"
        + f'{{"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": {ids}}}\n'
    )
    with pytest.raises(ValueError, match=rf"^{p}:2: ") as err:
        load_trace(p)
    assert "hash_ids" in str(err.value)


def test_mooncake_malformed_json_names_path_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(MOONCAKE.splitlines()[0] + "\n" + MOONCAKE.splitlines()[1] + "\n{1: 2}\n")
    with pytest.raises(ValueError, match=rf"^{p}:3: JSON is malformed"):
        load_trace(p)


@pytest.mark.parametrize(
    "field, value", [("input_length", -5), ("input_length", 100_000_000_000), ("output_length", -1)]
)
def test_mooncake_token_count_out_of_range_names_path_line_and_field(tmp_path, field, value):
    """Found from outside: `input_length` -5 was replayed silently (as 1 token), and 1e11 failed later
    as "replay fleet: Expected int <= 1048576 - at $.daemon.max_blocks_per_request", naming neither
    the line nor the field. Result: ValueError starting `path:line` and naming the field."""
    p = tmp_path / "t.jsonl"
    row = {"timestamp": 1, "input_length": 10, "output_length": 1, "hash_ids": [1]}
    row[field] = value
    p.write_text(MOONCAKE.splitlines()[0] + "\n" + json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=rf"^{p}:2: ") as err:
        load_trace(p)
    assert field in str(err.value)


@pytest.mark.parametrize("cell, why", [("-3", "out of range"), ("x", "not an integer")])
def test_azure_token_count_out_of_range_names_path_line_and_column(tmp_path, cell, why):
    p = tmp_path / "t.csv"
    lines = AZURE.splitlines()
    head, first = lines[0], lines[1].split(",")
    first[1] = cell  # ContextTokens
    p.write_text("\n".join([head, ",".join(first), *lines[2:]]) + "\n")
    with pytest.raises(ValueError, match=rf"^{p}:2: ContextTokens") as err:
        load_trace(p)
    assert why in str(err.value)
