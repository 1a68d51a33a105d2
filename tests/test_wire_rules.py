"""Rules of `services.common.wire` (naming the field of a request that holds invalid UTF-8)
that the mutation audit found unguarded: fixed-width fields (float, double) before the bad
string are stepped over by their width. And those test_wire_differential.py found broken: a
string cut by a truncation, unknown groups, what protobuf refuses first, merged submessages,
nesting past protobuf's limit."""

from __future__ import annotations

from google.protobuf import struct_pb2
from tiercache.v1 import kvpool_pb2, orchestrator_pb2, prefix_pb2, semantic_pb2

from services.common.wire import find_invalid_utf8


def _bad(msg) -> bytes:
    """`msg` serialized, its string "XX" made invalid UTF-8 ("XX" -> ff fe)."""
    return msg.SerializeToString().replace(b"XX", b"\xff\xfe")


def test_a_double_field_before_the_bad_string_is_skipped_whole():
    """A double is 8 bytes on the wire (wire type 1): the field after it is found."""
    raw = (semantic_pb2.SemanticEntry(created_at=1.5).SerializeToString()
           + _bad(semantic_pb2.SemanticEntry(prompt="XX")))
    assert find_invalid_utf8(semantic_pb2.SemanticEntry.DESCRIPTOR, raw) == "prompt"


def test_a_float_field_before_the_bad_string_is_skipped_whole():
    """A float is 4 bytes on the wire (wire type 5): the field after it is found."""
    raw = (semantic_pb2.LookupRequest(threshold=0.75).SerializeToString()
           + _bad(semantic_pb2.LookupRequest(text="XX")))
    assert find_invalid_utf8(semantic_pb2.LookupRequest.DESCRIPTOR, raw) == "text"


def _ld(num: int, payload: bytes) -> bytes:
    assert len(payload) < 128
    return bytes([num << 3 | 2, len(payload)]) + payload


def test_a_string_cut_by_the_end_of_a_truncated_message_is_malformed_not_invalid_utf8():
    """"é" is c3 a9: a message cut after c3 is truncated (docs/reliability.md: "request:
    malformed protobuf message"), not a string holding invalid UTF-8."""
    raw = _ld(2, "é".encode())[:-1]
    assert find_invalid_utf8(semantic_pb2.LookupRequest.DESCRIPTOR, raw) is None


def test_an_unknown_group_before_the_bad_string_is_skipped():
    """protobuf keeps a group of an unknown field (or of a known one sent as a group) and goes
    on: the bad string after it is the field to name."""
    group = bytes([9 << 3 | 3]) + _ld(2, b"\xff") + bytes([9 << 3 | 4])
    as_group = bytes([1 << 3 | 3, 1 << 3 | 4])  # namespace, sent as an (empty) group
    for before in (group, as_group):
        raw = before + _ld(2, b"\xff")
        assert find_invalid_utf8(semantic_pb2.LookupRequest.DESCRIPTOR, raw) == "text"


def test_what_protobuf_refuses_first_decides():
    """A structural error before the bad string (inside a submessage, or field number 0) is
    what protobuf refused: the request is malformed, as protobuf read it."""
    for before in (_ld(1, b"\x0a"), b"\x00\x01"):  # namespace cut short; field number 0
        raw = before + _ld(2, b"\xff")
        assert find_invalid_utf8(semantic_pb2.LookupRequest.DESCRIPTOR, raw) is None


def test_a_repeated_field_of_a_merged_submessage_is_counted_across_its_copies():
    """A singular submessage sent twice is one message (protobuf merges them): its repeated
    strings are indexed on, and a oneof member set anew after another starts afresh."""
    final = _ld(3, _ld(15, b"a")) + _ld(3, _ld(15, b"\xff"))
    assert (find_invalid_utf8(orchestrator_pb2.GenerateFinal.DESCRIPTOR, final)
            == "cache_report.degradations[1]")
    one = _ld(1, _ld(3, b"ok"))  # a ListValue of one string Value
    bad = _ld(1, _ld(3, b"\xff"))
    value = struct_pb2.Value.DESCRIPTOR
    assert find_invalid_utf8(value, _ld(6, one) + _ld(6, bad)) == \
        "list_value.values[1].string_value"
    assert find_invalid_utf8(value, _ld(6, one) + _ld(3, b"x") + _ld(6, bad)) == \
        "list_value.values[0].string_value"


def test_a_recursive_type_nested_past_protobufs_limit_is_not_walked():
    """protobuf refuses nesting past 100; 5,000 levels of a recursive type raised
    RecursionError out of the walk (no project type is recursive)."""
    raw = _ld(3, b"\xff")
    for _ in range(5000):
        sub = bytes([1 << 3 | 2]) + _varint_bytes(len(raw)) + raw
        raw = bytes([6 << 3 | 2]) + _varint_bytes(len(sub)) + sub
    assert find_invalid_utf8(struct_pb2.Value.DESCRIPTOR, raw) is None


def _varint_bytes(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def test_a_packed_field_cut_mid_value_before_the_bad_string_is_malformed():
    """protobuf reads a packed repeated scalar's values and refuses one cut short ("Wire
    format was corrupt") before the bad string after it: token_ids cut mid-varint, a packed
    double of 3 bytes. An empty or whole packed payload is walked past."""
    match = prefix_pb2.MatchRequest.DESCRIPTOR
    for packed in (_ld(3, b"\x80"), _ld(3, b"\x01\xff")):
        assert find_invalid_utf8(match, packed + _ld(1, b"\xff")) is None
    for packed in (_ld(3, b""), _ld(3, b"\x01\xff\x01")):
        assert find_invalid_utf8(match, packed + _ld(1, b"\xff")) == "model_id"
    stats = kvpool_pb2.KvStatsResponse.DESCRIPTOR
    costs = stats.fields_by_name["draft_forward_costs"].number
    name = next(f for f in stats.fields if f.type == f.TYPE_STRING)
    def doubles(n: int) -> bytes:  # field 27: a two-byte tag
        return _varint_bytes(costs << 3 | 2) + bytes([n]) + b"\x00" * n

    assert find_invalid_utf8(stats, doubles(3) + _ld(name.number, b"\xff")) is None
    assert find_invalid_utf8(stats, doubles(8) + _ld(name.number, b"\xff")) == name.name
