"""A differential review of `services.common.wire.find_invalid_utf8` and the bootstrap's parse
path (`bootstrap._parse_request`): seeded random wire encodings of the project's message types
against a model of the documented behaviour, with protobuf itself as a third party.

The model is a reference decoder written from the protobuf encoding (not from wire.py): it reads
the bytes in wire order with the descriptor and reports, in order, each *problem*: a known
proto3 string field whose whole declared payload is present and is not valid UTF-8 (named by
its path in the parsed message: `messages[0].content`, a repeated field's index counted over
the message as protobuf merges it: a singular message field sent twice is one message, a oneof
member set anew after another is a fresh one), or a structural error (a length, varint or
fixed value cut by the end, a varint over 10 bytes, field number 0 or past 2^29-1, wire type
6/7, an end-group without its start, a packed payload that is not whole values, nesting past
protobuf's limit of 100). Unknown fields (groups included), a known field sent with another
wire type, and strings inside them are not checked (protobuf keeps them as unknown).

Compared, for every input: protobuf accepts it exactly when the model finds no problem (this
checks the model); when the first problem is an invalid string, wire.py names the model's path
and the bootstrap aborts INVALID_ARGUMENT `<path>: invalid UTF-8 in a string field`
(docs/reliability.md, "invalid UTF-8 in a string"); when it is a structural error, the
bootstrap aborts INVALID_ARGUMENT `request: malformed protobuf message` ("truncated / not
protobuf"), a bad string after it or not (the docs are silent on a message with both problems;
wire.py follows protobuf's order: a packed value cut before a bad string, once walked past, is
now generated too). Map fields are named
`<map>.key` / `<map>.value` (the docs are silent; asserted as found). No input may raise out of
wire.py nor recurse without bound (google.protobuf.Struct, a recursive type, nested 5,000 deep).

The inputs: random messages of the request types (and of the response types and Struct, for
maps, oneofs and recursion), fields in random order, singular fields repeated, packed and
unpacked repeated scalars, bytes fields holding non-UTF-8, unknown fields and groups, known
fields under the wrong wire type, then at random one or more strings made invalid UTF-8
(a stray continuation byte, 0xff, a cut multi-byte sequence, a surrogate, an overlong form,
past U+10FFFF), and truncation, garbage appended, structural garbage inside, or random bytes.

Run: 100,000 seeds (12,000 here, about 1 s), 0 divergent after the fix; before it 382 of
30,000. Injected bugs caught (seeds of 12,000): indices from 1 (396), a fixed32 stepped as 8
bytes (144), no check of a length past the end (94), maps indexed (156), an end-group of
another field accepted (14), a oneof member not reset (1; the hand-built cases catch it). Found
(fixed in wire.py, each guarded in tests/test_wire_rules.py): a string cut by the end of a
truncated message was named as invalid UTF-8 (the docs: truncated is malformed); an unknown
group before the bad string made it "malformed"; a structural error inside a submessage did not
stop the walk, and field number 0 was skipped (a later string was named where protobuf had
refused the earlier error -- docs silent, now the same order as protobuf); a repeated field of
a singular submessage sent twice was indexed from 0 in each copy (protobuf merges them); a
recursive type nested thousands deep raised RecursionError (no project type is recursive). More
seeds: TIERCACHE_WIRE_DIFF_SEEDS=100000, or `python tests/test_wire_differential.py START
COUNT`.
"""

from __future__ import annotations

import os
import random
import types

import grpc
import pytest
from google.protobuf import struct_pb2
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import DecodeError
from tiercache.v1 import (
    common_pb2,
    kvpool_pb2,
    orchestrator_pb2,
    prefix_pb2,
    semantic_pb2,
)

from services.common import bootstrap
from services.common.wire import find_invalid_utf8

SEEDS = int(os.environ.get("TIERCACHE_WIRE_DIFF_SEEDS", "12000"))
MAX_DEPTH = 100  # protobuf's recursion limit (messages and groups)

REQUESTS = [
    orchestrator_pb2.GenerateRequest, orchestrator_pb2.WarmRequest,
    orchestrator_pb2.FeedbackRequest, orchestrator_pb2.StatsRequest,
    kvpool_pb2.KvGenerateRequest, kvpool_pb2.PrefillRequest, kvpool_pb2.KvStatsRequest,
    prefix_pb2.RegisterRequest, prefix_pb2.HeartbeatRequest, prefix_pb2.PublishEventsRequest,
    prefix_pb2.MatchRequest, prefix_pb2.TopPrefixesRequest, prefix_pb2.PrefixStatsRequest,
    semantic_pb2.LookupRequest, semantic_pb2.StoreRequest, semantic_pb2.VerifyRequest,
    semantic_pb2.InvalidateRequest, semantic_pb2.SemanticStatsRequest,
]
OTHERS = [
    orchestrator_pb2.GenerateFinal, orchestrator_pb2.StatsResponse,
    semantic_pb2.SemanticStatsResponse, prefix_pb2.TopPrefixesResponse, common_pb2.CacheReport,
    struct_pb2.Value, struct_pb2.Struct, struct_pb2.ListValue,
]

VARINT_TYPES = {FD.TYPE_INT32, FD.TYPE_INT64, FD.TYPE_UINT32, FD.TYPE_UINT64, FD.TYPE_SINT32,
                FD.TYPE_SINT64, FD.TYPE_BOOL, FD.TYPE_ENUM}
FIXED32 = {FD.TYPE_FIXED32, FD.TYPE_SFIXED32, FD.TYPE_FLOAT}
FIXED64 = {FD.TYPE_FIXED64, FD.TYPE_SFIXED64, FD.TYPE_DOUBLE}


# ---------------------------------------------------------------- encoding helpers


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def tag(num: int, wt: int) -> bytes:
    return varint(num << 3 | wt)


def ld(num: int, payload: bytes) -> bytes:
    return tag(num, 2) + varint(len(payload)) + payload


# ---------------------------------------------------------------- the model


class Malformed(Exception):
    pass


def _read_varint(data: bytes, i: int) -> tuple[int, int]:
    """A varint at `i` (at most 10 bytes) and the index after it."""
    for k in range(10):
        if i + k >= len(data):
            raise Malformed("varint cut by the end")
        if data[i + k] < 0x80:
            return sum((data[i + j] & 0x7F) << (7 * j) for j in range(k + 1)), i + k + 1
    raise Malformed("varint over 10 bytes")


def _skip(data: bytes, i: int, num: int, wt: int, depth: int) -> int:
    """The index after an unknown field's value (a group up to its own end)."""
    if wt == 0:
        return _read_varint(data, i)[1]
    if wt in (1, 5):
        width = 8 if wt == 1 else 4
        if i + width > len(data):
            raise Malformed("fixed value cut")
        return i + width
    if wt == 2:
        n, i = _read_varint(data, i)
        if n > len(data) - i:
            raise Malformed("length past the end")
        return i + n
    if wt == 3:
        if depth + 1 > MAX_DEPTH:
            raise Malformed("too deep")
        while True:
            key, i = _read_tag(data, i)
            if key & 7 == 4:
                if key >> 3 != num:
                    raise Malformed("end group of another field")
                return i
            i = _skip(data, i, key >> 3, key & 7, depth + 1)
    raise Malformed(f"wire type {wt}")


def _read_tag(data: bytes, i: int, fieldless: bool = False) -> tuple[int, int]:
    """A tag; field number 0 is refused except in a message without fields (protobuf's own
    quirk: `StatsRequest` accepts b"\\x00\\x01")."""
    key, i = _read_varint(data, i)
    if key > 0xFFFFFFFF or key >> 3 >= 2**29 or key >> 3 == 0 and not fieldless:
        raise Malformed("field number")
    return key, i


def _packed_ok(fd, payload: bytes) -> bool:
    if fd.type in FIXED32:
        return len(payload) % 4 == 0
    if fd.type in FIXED64:
        return len(payload) % 8 == 0
    i = 0
    try:
        while i < len(payload):
            _, i = _read_varint(payload, i)
    except Malformed:
        return False
    return True


class Walk:
    """The model's problems in wire order: ("bad", path) and ("error", why). Lenient: after an
    error inside a length-delimited submessage it goes on after that submessage (for the
    "both problems" invariant); the verdict is the first problem."""

    def __init__(self) -> None:
        self.problems: list[tuple[str, str]] = []

    def message(self, desc, data: bytes, prefix: str, state: dict, depth: int) -> None:
        if depth > MAX_DEPTH:
            self.problems.append(("error", "too deep"))
            return
        i = 0
        while i < len(data):
            try:
                key, j = _read_tag(data, i, fieldless=not desc.fields)
                num, wt = key >> 3, key & 7
                fd = desc.fields_by_number.get(num)
                checked = fd is not None and wt == 2 and (
                    fd.type in (FD.TYPE_STRING, FD.TYPE_MESSAGE)  # or a packed scalar:
                    or fd.is_repeated and fd.type != FD.TYPE_BYTES)
                if not checked:  # unknown to the message: skipped, not looked into
                    if wt == 4:
                        raise Malformed("end group without its start")
                    i = _skip(data, j, num, wt, depth)
                    continue
                n, j = _read_varint(data, j)
                if n > len(data) - j:
                    raise Malformed("length past the end")
                payload, i = data[j:j + n], j + n
            except Malformed as e:
                self.problems.append(("error", str(e)))
                return
            self.field(desc, fd, payload, prefix, state, depth)

    def field(self, desc, fd, payload: bytes, prefix: str, state: dict, depth: int) -> None:
        if fd.containing_oneof is not None:  # a member set anew starts from nothing
            for other in fd.containing_oneof.fields:
                if other is not fd:
                    state.pop(other.name, None)
        if fd.type == FD.TYPE_MESSAGE:
            entry = fd.message_type.GetOptions().map_entry
            if fd.is_repeated and not entry:
                index = state.setdefault(fd.name, [0])
                path, child = f"{prefix}{fd.name}[{index[0]}]", {}
                index[0] += 1
            elif entry:
                path, child = prefix + fd.name, {}
            else:  # singular: every copy merges into one message
                path, child = prefix + fd.name, state.setdefault(fd.name, {})
            self.message(fd.message_type, payload, path + ".", child, depth + 1)
        elif fd.type == FD.TYPE_STRING:
            path = prefix + fd.name
            if fd.is_repeated:
                index = state.setdefault(fd.name, [0])
                path += f"[{index[0]}]"
                index[0] += 1
            try:
                payload.decode("utf-8")
            except UnicodeDecodeError:
                self.problems.append(("bad", path))
        elif not _packed_ok(fd, payload):  # a packed repeated scalar
            self.problems.append(("error", "packed payload"))


def model(cls, raw: bytes) -> list[tuple[str, str]]:
    w = Walk()
    w.message(cls.DESCRIPTOR, raw, "", {}, 0)
    return w.problems


# ---------------------------------------------------------------- the generator

TEXT = ["", "a", "hi", "é", "日本", "🙂", "x" * 20, "ümlaut ok", "\u0000", "tab\t"]
INVALID = [b"\x80", b"\xff", b"\xc3", b"\xe6\x97", b"\xed\xa0\x80", b"\xc0\x80",
           b"\xf4\x90\x80\x80", b"\xfe\xfe", b"\xf0\x9f\x99"]
GARBAGE = [tag(1, 6), tag(1, 7), tag(3, 4), b"\x00\x01", varint(2**29 << 3) + b"\x00",
           tag(9, 0) + b"\xff" * 10 + b"\x01", tag(9, 2) + b"\x7f", b"\x0a",
           tag(9, 3), tag(9, 3) + tag(8, 4)]


class Gen:
    def __init__(self, rng: random.Random, p_bad: float, p_odd: float, max_depth: int) -> None:
        self.rng, self.p_bad, self.p_odd, self.max_depth = rng, p_bad, p_odd, max_depth

    def text(self) -> bytes:
        rng = self.rng
        s = "".join(rng.choice(TEXT) for _ in range(rng.randint(0, 3))).encode()
        if rng.random() < self.p_bad:
            at = rng.randint(0, len(s))
            s = s[:at] + rng.choice(INVALID) + s[at:]
        return s

    def scalar(self, fd) -> tuple[int, bytes]:
        rng = self.rng
        if fd.type in FIXED32:
            return 5, rng.randbytes(4)
        if fd.type in FIXED64:
            return 1, rng.randbytes(8)
        return 0, varint(rng.choice([0, 1, 127, 128, 2**32 - 1, 2**64 - 1,
                                     rng.getrandbits(rng.randint(1, 64))]))

    def message(self, desc, depth: int) -> bytes:
        rng = self.rng
        out = []
        fields = list(desc.fields)
        for _ in range(rng.randint(0, 6 if depth < 2 else 3)):
            r = rng.random()
            if r < self.p_odd * 0.3:
                out.append(self.unknown(depth))
                continue
            if r < self.p_odd * 0.4:
                out.append(rng.choice(GARBAGE))
                continue
            if not fields:
                continue
            fd = rng.choice(fields)
            for _ in range(rng.choice([1, 1, 1, 2, 3])):  # singular fields sent twice too
                out.append(self.field(fd, depth))
        return b"".join(out)

    def field(self, fd, depth: int) -> bytes:
        rng = self.rng
        if rng.random() < self.p_odd * 0.1:  # a known field under another wire type
            wt = rng.choice([0, 1, 5, 3])
            if wt == 3:
                return tag(fd.number, 3) + self.unknown(depth + 1) + tag(fd.number, 4)
            return tag(fd.number, wt) + (varint(rng.getrandbits(20)) if wt == 0
                                         else rng.randbytes(8 if wt == 1 else 4))
        if fd.type == FD.TYPE_STRING:
            return ld(fd.number, self.text())
        if fd.type == FD.TYPE_BYTES:
            return ld(fd.number, rng.randbytes(rng.randint(0, 6)))
        if fd.type == FD.TYPE_MESSAGE:
            if depth >= self.max_depth:
                return ld(fd.number, b"")
            return ld(fd.number, self.message(fd.message_type, depth + 1))
        if fd.is_repeated and rng.random() < 0.6:  # packed
            payload = b"".join(self.scalar(fd)[1] for _ in range(rng.randint(0, 4)))
            if rng.random() < self.p_odd * 0.2:  # a value cut: a varint's or a fixed one's
                payload += b"\x80"
            return ld(fd.number, payload)
        wt, value = self.scalar(fd)
        return tag(fd.number, wt) + value

    def unknown(self, depth: int) -> bytes:
        rng = self.rng
        num = rng.choice([99, 1000, 2**29 - 1, 16, 200])
        wt = rng.choice([0, 1, 2, 5, 3])
        if wt == 3 and depth < self.max_depth:
            inner = b"".join(self.unknown(depth + 1) for _ in range(rng.randint(0, 2)))
            return tag(num, 3) + inner + tag(num, 4)
        if wt == 2:  # strings in unknown fields are not checked
            return ld(num, rng.choice([self.text(), b"\xff\xfe"]))
        if wt in (1, 5):
            return tag(num, wt) + rng.randbytes(8 if wt == 1 else 4)
        return tag(num, 0) + varint(rng.getrandbits(40))


def case(seed: int):
    """(message class, raw bytes) for one seed."""
    rng = random.Random(seed)
    cls = rng.choice(REQUESTS * 3 + OTHERS)
    p_bad = rng.choice([0.0, 0.05, 0.2, 0.5])
    p_odd = rng.choice([0.0, 0.0, 0.1, 0.3])
    raw = Gen(rng, p_bad, p_odd, rng.choice([1, 3, 6])).message(cls.DESCRIPTOR, 0)
    r = rng.random()
    if r < 0.1 and raw:
        raw = raw[:rng.randrange(len(raw))]  # truncated
    elif r < 0.15:
        raw += rng.randbytes(rng.randint(1, 4))  # garbage appended
    elif r < 0.18:
        raw = rng.randbytes(rng.randint(1, 12))  # not protobuf at all
    return cls, raw


# ---------------------------------------------------------------- the comparison


class Aborted(Exception):
    pass


def _context():
    def abort(code, details):
        raise Aborted(code, details)
    # The refusal also sets the request id trailer (not what this test compares).
    return types.SimpleNamespace(abort=abort, set_trailing_metadata=lambda metadata: None)


def bootstrap_answer(cls, raw: bytes):
    """("ok", None) or (status code, details) from the bootstrap's own parse."""
    try:
        bootstrap._parse_request(cls.FromString, raw, _context(), "diff", "Parse")
    except Aborted as e:
        return e.args
    return "ok", None


def check(cls, raw: bytes) -> None:
    problems = model(cls, raw)
    try:
        cls.FromString(raw)
        accepted = True
    except DecodeError:
        accepted = False
    where = find_invalid_utf8(cls.DESCRIPTOR, raw)
    assert accepted == (not problems), ("model vs protobuf", problems)
    code, details = bootstrap_answer(cls, raw)
    if not problems:
        assert where is None and code == "ok"
        return
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    kind, first = problems[0]
    if kind == "bad":
        assert where == first, (where, problems)
        assert details == f"{first}: invalid UTF-8 in a string field"
        return
    # A structural error first: malformed, even with a bad string after it (the docs are
    # silent on both problems; wire.py follows protobuf's order, as 8c0d4b7 set out to).
    assert where is None, (where, problems)
    assert details == "request: malformed protobuf message"


@pytest.mark.parametrize("chunk", range(3))
def test_random_encodings_against_the_model(chunk):
    for seed in range(chunk, SEEDS, 3):
        cls, raw = case(seed)
        try:
            check(cls, raw)
        except AssertionError as e:
            raise AssertionError(f"seed {seed} {cls.__name__} {raw!r}: {e}") from None


def test_named_paths_through_merges_oneofs_and_maps():
    """Hand-built inputs the generator reaches rarely, each against the model."""
    v, lv = struct_pb2.Value, struct_pb2.ListValue
    s = ld(3, b"ok")
    cases = [
        # a singular submessage sent twice is one message: its repeated strings count on
        (orchestrator_pb2.GenerateFinal, ld(3, ld(15, b"a")) + ld(3, ld(15, b"\xff"))),
        # list_value twice merges; a string_value between starts a new list
        (v, ld(6, ld(1, s)) + ld(6, ld(1, ld(3, b"\xff")))),
        (v, ld(6, ld(1, s)) + ld(3, b"x") + ld(6, ld(1, ld(3, b"\xff")))),
        (lv, ld(1, s) + ld(1, ld(6, ld(1, s) + ld(1, ld(3, b"\xc3"))))),
        (struct_pb2.Struct, ld(1, ld(1, b"k") + ld(2, ld(3, b"\xff")))),
        (struct_pb2.Struct, ld(1, ld(1, b"\xff"))),
        (orchestrator_pb2.StatsResponse, ld(12, ld(1, b"\xe6\x97"))),
        # an unknown group (with a bad string inside) before the bad string
        (semantic_pb2.LookupRequest, tag(9, 3) + ld(2, b"\xff") + tag(9, 4) + ld(2, b"\xff")),
        (semantic_pb2.LookupRequest, tag(1, 3) + tag(1, 4) + ld(3, b"\x80")),
        # cut by the end of the message: malformed, not invalid UTF-8
        (semantic_pb2.LookupRequest, tag(2, 2) + b"\x02\xc3"),
        (semantic_pb2.InvalidateRequest, ld(2, ld(1, b"ok")) + ld(1, b"\xff")),
    ]
    for cls, raw in cases:
        check(cls, raw)
    assert model(*cases[0]) == [("bad", "cache_report.degradations[1]")]
    assert model(*cases[1]) == [("bad", "list_value.values[1].string_value")]
    assert model(*cases[2]) == [("bad", "list_value.values[0].string_value")]


def test_deep_nesting_is_refused_without_unbounded_recursion():
    """Struct is recursive: 5,000 levels are refused as protobuf refuses them (its limit is
    100), wire.py neither raising nor naming a field protobuf never reached."""
    for depth, inner in ((49, ld(3, b"\xff")), (50, ld(3, b"\xff")), (51, ld(3, b"\xff")),
                         (5000, ld(3, b"\xff")), (5000, ld(3, b"ok"))):
        raw = inner
        for _ in range(depth):
            raw = ld(6, ld(1, raw))
        check(struct_pb2.Value, raw)
    raw = b""
    for _ in range(5000):  # unknown groups nested as deep
        raw = tag(9, 3) + raw + tag(9, 4)
    check(semantic_pb2.LookupRequest, raw + ld(2, b"\xff"))


if __name__ == "__main__":
    import sys

    start, n = int(sys.argv[1]), int(sys.argv[2])
    fails = 0
    for seed in range(start, start + n):
        cls, raw = case(seed)
        try:
            check(cls, raw)
        except AssertionError as e:
            fails += 1
            if fails <= 8:
                print(f"seed {seed} {cls.__name__} {raw!r}: {e}"[:400])
    print(f"{fails} of {n} seeds failed")
