"""fanin.kv.encode_tuples and decode_results (the extension's encoder and
decoder) against the record formats written out with struct, and their
errors."""

import struct

import pytest

from fanin.kv import KvError, decode_results, encode_tuples


def _key_len(n):
    """key_len u16, and after the fixed head the u32 length of keys of
    65 535 bytes or more (key_len 0xFFFF)."""
    return (n, b"") if n < 0xFFFF else (0xFFFF, struct.pack("<I", n))


def _reference(pairs):
    head = struct.Struct("<Hq").pack
    out = []
    for k, v in pairs:
        kb = k.encode() if isinstance(k, str) else bytes(k)
        n, ext = _key_len(len(kb))
        out += [head(n, int(v)), ext, kb]
    return b"".join(out)


def test_records_equal_the_format_for_every_key_and_value_kind():
    pairs = [("a", 1), (b"bb", -5), ("\u00e9t\u00e9", 2**62), (bytearray(b"xy"), 3), (memoryview(b"mv"), 4),
             ("", 0), (b"z", True), ["as-a-list", 7], ("x" * 65534, -(2**63)), ("y" * 65535, 1), (b"w" * 200_000, 2)]
    assert encode_tuples(iter(pairs)) == _reference(pairs)
    assert encode_tuples([]) == b""


@pytest.mark.parametrize("bad, message", [
    ([("k", 2**63)], "value 2**63 for key k does not fit in int64".replace("2**63", str(2**63))),
    ([("k", "nope")], "value 'nope' for key k is not an integer"),
    # a float is never cut to its integer part (it used to count 1.5 as 1)
    ([("k", 3.9)], "value 3.9 for key k is not an integer"),
    ([("k",)], "expected (key, value) pairs"),
    # never converted with bytes(): 5 was five zero bytes, (1, 2) b"\x01\x02"
    ([(5, 1)], "key 5 is int; keys are str or bytes"),
    ([((1, 2), 1)], "key (1, 2) is tuple; keys are str or bytes"),
    ([(None, 1)], "key None is NoneType; keys are str or bytes"),
])
def test_bad_pairs_are_refused_with_what_is_wrong(bad, message):
    with pytest.raises(KvError, match=message.replace("(", r"\(").replace(")", r"\)")):
        encode_tuples(bad)


def _result_records(entries):
    head = struct.Struct("<HqQqq").pack
    return b"".join(head(_key_len(len(k))[0], total, count, lo, hi) + _key_len(len(k))[1] + k
                    for k, total, count, lo, hi in entries)


def test_result_records_decode_to_sums_with_str_or_bytes_keys():
    entries = [(b"ab", 5, 2, 1, 4), (b"", -(2**63), 1, -(2**63), -(2**63)), ("\u00e9t\u00e9".encode(), 2**63 - 1, 2**64 - 1, 0, 9),
               (b"x" * 65534, 0, 3, -1, 1), (b"y" * 65535, 1, 1, 1, 1), (b"z" * 100_000, 2, 1, 2, 2)]
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


def test_str_keys_decode_strictly_or_losslessly_never_lossily():
    """Two keys that are not UTF-8 decode to two str keys with
    surrogateescape (and back to their bytes); "replace" would make both
    U+FFFD and lose a count, so it is refused."""
    data = _result_records([(b"\xff", 1, 1, 1, 1), (b"\xfe", 2, 1, 2, 2), (b"ok", 3, 1, 3, 3)])
    got = decode_results(data, errors="surrogateescape")
    assert {k.encode("utf-8", "surrogateescape"): v for k, v in got.items()} == {b"\xff": 1, b"\xfe": 2, b"ok": 3}
    with pytest.raises(ValueError, match="could map two different keys to one str"):
        decode_results(data, errors="replace")
