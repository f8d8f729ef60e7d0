"""`checked_enqueue` refuses a str argument UTF-8 cannot encode (a lone surrogate, as aiohttp or
os.fsdecode produce from bytes that are not UTF-8) with a ValueError naming the argument, before
anything is sent (before: the frame failed to encode in the link, a UnicodeEncodeError from deep
inside the send path that named nothing)."""

from __future__ import annotations

import pytest

from kvsched.client.checks import checked_enqueue

OK = dict(
    request_id="r",
    isl_tokens=10,
    block_hashes=None,
    policy_class="",
    priority=0,
    strict_priority=0,
    session_id=None,
    expected_osl=None,
    pinned=None,
    allowed_workers=None,
    do_not_queue=False,
    deadline_ms=None,
    lora_name=None,
)


@pytest.mark.parametrize("name", ["request_id", "policy_class", "session_id", "lora_name"])
@pytest.mark.parametrize("bad", ["\udcff\udcfe", "ok-\ud800", "é\udcc3"])
def test_a_str_with_a_lone_surrogate_is_a_value_error_naming_the_argument(name, bad):
    with pytest.raises(ValueError, match=rf"^{name} is not valid Unicode text: a lone surrogate at index \d+"):
        checked_enqueue(**{**OK, name: bad})


def test_non_ascii_text_is_still_accepted_and_counted_in_utf8_bytes():
    frame = checked_enqueue(**{**OK, "request_id": "é" * 64, "policy_class": "clé", "session_id": "😀"})
    assert frame.request_id == "é" * 64 and frame.policy_class == "clé" and frame.session_id == "😀"
    with pytest.raises(ValueError, match="request_id has 130 UTF-8 bytes"):
        checked_enqueue(**{**OK, "request_id": "é" * 65})


def test_a_client_name_with_a_lone_surrogate_is_refused_when_the_client_is_made():
    """It is sent in Hello, whose encoding would fail (UnicodeEncodeError, naming no argument)."""
    from kvsched.client import SchedulerClient

    with pytest.raises(ValueError, match=r"^client_name is not valid Unicode text"):
        SchedulerClient("ipc:///tmp/kvsched-f3-unused.sock", client_name="gw-\udcff")


@pytest.mark.parametrize("given, sent", [([0], [0]), ("np0", [0]), ("np01", [0, 1]), ([], None), (None, None)])
def test_excluded_workers_as_a_numpy_array_is_read_not_truth_tested(given, sent):
    """Found from outside: `if excluded_workers:` dropped np.array([0]) (falsy) and raised on
    np.array([0, 1]) (ambiguous truth value)."""
    import numpy as np

    given = {"np0": np.array([0]), "np01": np.array([1, 0])}.get(given, given) if isinstance(given, str) else given
    assert checked_enqueue(**{**OK, "excluded_workers": given}).excluded_workers == sent


def test_int_subclasses_are_sent_as_plain_ints():
    """Found from outside: an int subclass passed the checks unchanged and the frame encoder refused it
    (a TypeError naming no argument; for a Release, after the lease was marked completed)."""
    import msgspec

    class MyInt(int):
        pass

    frame = checked_enqueue(**{**OK, "isl_tokens": MyInt(10), "priority": MyInt(3), "allowed_workers": [MyInt(1)]})
    assert type(frame.isl_tokens) is int and type(frame.priority) is int
    msgspec.msgpack.encode(frame)  # encodes
