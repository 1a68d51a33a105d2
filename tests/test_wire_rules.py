"""Rules of `services.common.wire` (naming the field of a request that holds invalid UTF-8)
that the mutation audit found unguarded: fixed-width fields (float, double) before the bad
string are stepped over by their width."""

from __future__ import annotations

from tiercache.v1 import semantic_pb2

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
