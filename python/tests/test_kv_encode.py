"""fanin.kv.encode_tuples and decode_results (the extension's encoder and
decoder) against the record formats written out with struct, and their
errors."""

import struct

import pytest

from fanin.kv import KvError, decode_results, encode_tuples


def _reference(pairs):
    head = struct.Struct("<Hq").pack
    out = []
    for k, v in pairs:
        kb = k.encode() if isinstance(k, str) else bytes(k)
        out += [head(len(kb), int(v)), kb]
    return b"".join(out)


def test_records_equal_the_format_for_every_key_and_value_kind():
    pairs = [("a", 1), (b"bb", -5), ("\u00e9t\u00e9", 2**62), (bytearray(b"xy"), 3), (memoryview(b"mv"), 4),
             ("", 0), (b"z", True), ["as-a-list", 7], ("x" * 65535, -(2**63))]
    assert encode_tuples(iter(pairs)) == _reference(pairs)
    assert encode_tuples([]) == b""


@pytest.mark.parametrize("bad, message", [
    ([("x" * 65536, 1)], "key of 65536 bytes cannot be encoded (at most 65535)"),
    ([("k", 2**63)], "value 2**63 for key k does not fit in int64".replace("2**63", str(2**63))),
    ([("k", "nope")], "value 'nope' for key k is not an integer"),
    # a float is never cut to its integer part (it used to count 1.5 as 1)
    ([("k", 3.9)], "value 3.9 for key k is not an integer"),
    ([("k",)], "expected (key, value) pairs"),
])
def test_bad_pairs_are_refused_with_what_is_wrong(bad, message):
    with pytest.raises(KvError, match=message.replace("(", r"\(").replace(")", r"\)")):
        encode_tuples(bad)


def _result_records(entries):
    head = struct.Struct("<HqQqq").pack
    return b"".join(head(len(k), total, count, lo, hi) + k for k, total, count, lo, hi in entries)


def test_result_records_decode_to_sums_with_str_or_bytes_keys():
    entries = [(b"ab", 5, 2, 1, 4), (b"", -(2**63), 1, -(2**63), -(2**63)), ("\u00e9t\u00e9".encode(), 2**63 - 1, 2**64 - 1, 0, 9),
               (b"x" * 65535, 0, 3, -1, 1)]
    data = _result_records(entries)
    assert decode_results(data, as_str=False) == {k: total for k, total, *_ in entries}
    assert decode_results(data) == {k.decode(): total for k, total, *_ in entries}
    assert decode_results(b"") == {}


def test_result_records_cut_short_or_not_utf8_are_refused():
    data = _result_records([(b"ab", 5, 2, 1, 4), (b"cd", 1, 1, 1, 1)])
    first = 34 + 2
    for cut in (first + 3, len(data) - 1):
        with pytest.raises(ValueError, match=f"result record at byte {first} is cut short \\({cut} bytes in all\\)"):
            decode_results(data[:cut], as_str=False)
    with pytest.raises(UnicodeDecodeError):
        decode_results(_result_records([(b"\xff", 1, 1, 1, 1)]))
