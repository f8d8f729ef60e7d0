"""`ModelTokenizer.encode` gives the ids `Tokenizer.encode` gives, on the fast path and without it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsched.gateway.local_fleet import write_tiny_tokenizer
from kvsched.gateway.tokenizer import ModelTokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from tokenizers import processors

    t = ModelTokenizer(write_tiny_tokenizer(tmp_path_factory.mktemp("tok")))
    # a post-processor that adds a special token, so add_special_tokens=True changes the ids
    t.tokenizer.post_processor = processors.TemplateProcessing(
        single="<|system|> $A", special_tokens=[("<|system|>", 1)]
    )
    return t


words = st.lists(
    st.one_of(st.integers(0, 2100).map(lambda i: f"w{i}"), st.sampled_from(["<|user|>", "<|end|>", "zz", "é"])),
    max_size=60,
)


@settings(max_examples=100, deadline=None)
@given(words, st.booleans(), st.sampled_from([" ", "  ", "\n"]))
def test_encode_matches_the_tokenizers_ids_with_and_without_the_fast_path(tok, ws, special, sep):
    text = sep.join(ws)
    want = tok.tokenizer.encode(text, add_special_tokens=special).ids
    assert tok.encode(text, add_special_tokens=special) == want
    fast, tok._encode_fast = tok._encode_fast, None
    try:
        assert tok.encode(text, add_special_tokens=special) == want
    finally:
        tok._encode_fast = fast


def test_fast_path_is_used_when_the_library_has_it(tok):
    assert (tok._encode_fast is not None) == hasattr(tok.tokenizer, "encode_batch_fast")
