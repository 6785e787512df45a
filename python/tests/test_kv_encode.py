"""fanin.kv.encode_tuples (the extension's encoder) against the record format
written out with struct, and its errors."""

import struct

import pytest

from fanin.kv import KvError, encode_tuples


def _reference(pairs):
    head = struct.Struct("<Hq").pack
    out = []
    for k, v in pairs:
        kb = k.encode() if isinstance(k, str) else bytes(k)
        out += [head(len(kb), int(v)), kb]
    return b"".join(out)


def test_records_equal_the_format_for_every_key_and_value_kind():
    pairs = [("a", 1), (b"bb", -5), ("\u00e9t\u00e9", 2**62), (bytearray(b"xy"), 3), (memoryview(b"mv"), 4),
             ("", 0), ("k", 3.9), (b"z", True), ["as-a-list", 7], ("x" * 65535, -(2**63))]
    assert encode_tuples(iter(pairs)) == _reference(pairs)
    assert encode_tuples([]) == b""


@pytest.mark.parametrize("bad, message", [
    ([("x" * 65536, 1)], "key of 65536 bytes cannot be encoded (at most 65535)"),
    ([("k", 2**63)], "too large"),
    ([("k", "nope")], "invalid literal for int()"),
    ([("k",)], "expected (key, value) pairs"),
])
def test_bad_pairs_are_refused_with_what_is_wrong(bad, message):
    with pytest.raises(KvError, match=message.replace("(", r"\(").replace(")", r"\)")):
        encode_tuples(bad)
