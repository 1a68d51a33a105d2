"""Finding *which* field of a protobuf message carries invalid UTF-8.

protobuf rejects a proto3 string with invalid UTF-8 at parse time with a message that does not
name the field, and gRPC would answer INTERNAL. The bootstrap parses requests itself and, on
failure, walks the wire format with the message descriptor to name the field
(`messages[0].content`) in an INVALID_ARGUMENT status.
"""

from __future__ import annotations

from google.protobuf.descriptor import Descriptor, FieldDescriptor


def _varint(data: bytes, i: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if i >= len(data):
            raise ValueError("truncated varint")
        b = data[i]
        i += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


# protobuf's own limit on nesting (messages and groups): it refuses a deeper message as
# malformed, so the walk need not (and, on a recursive type, must not) go further.
_MAX_DEPTH = 100


def find_invalid_utf8(desc: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """Path of the first string field holding invalid UTF-8, or None if there is none.

    "First" in the order protobuf reads the bytes: None when something else it refuses comes
    first (a length, varint or value cut by the end, a packed field's payload that is not
    whole values, field number 0, wire type 6 or 7, a group without its end, nesting past its
    limit): that request is malformed, not one with a bad string. Unknown fields (groups too)
    are skipped as protobuf skips them, and a repeated field is indexed as in the parsed
    message (a singular submessage sent twice is one message)."""
    try:
        return _walk(desc, data, prefix, {}, 0)
    except ValueError:
        return None


def _walk(desc: Descriptor, data: bytes, prefix: str, seen: dict, depth: int) -> str | None:
    """`seen`: per field number, the elements of a repeated field counted so far, or the
    `seen` of a singular submessage (shared by its copies, which protobuf merges)."""
    if depth > _MAX_DEPTH:
        raise ValueError("nested too deep")
    i = 0
    while i < len(data):
        key, i = _tag(data, i, bool(desc.fields))
        num, wt = key >> 3, key & 7
        if wt != 2:
            i = _skip(data, i, num, wt, depth)
            continue
        n, i = _varint(data, i)
        if n > len(data) - i:
            raise ValueError("length past the end")  # cut short: malformed, not a bad string
        chunk, i = data[i : i + n], i + n
        fd = desc.fields_by_number.get(num)
        if fd is None:
            continue
        if fd.type not in (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE):
            if fd.is_repeated and fd.type not in (FieldDescriptor.TYPE_BYTES,
                                                  FieldDescriptor.TYPE_GROUP):
                _check_packed(fd, chunk)  # protobuf reads the values: refuses a cut one
            continue
        if fd.containing_oneof is not None:  # setting a member clears the others
            for other in fd.containing_oneof.fields:
                if other.number != num:
                    seen.pop(other.number, None)
        name = prefix + fd.name
        is_map = fd.type == FieldDescriptor.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry
        if fd.is_repeated and not is_map:
            idx = seen.get(num, 0)
            seen[num] = idx + 1
            name += f"[{idx}]"
        if fd.type == FieldDescriptor.TYPE_STRING:
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError:
                return name
        else:
            sub = {} if fd.is_repeated else seen.setdefault(num, {})
            found = _walk(fd.message_type, chunk, name + ".", sub, depth + 1)
            if found:
                return found
    return None


_FIXED_WIDTH = {
    FieldDescriptor.TYPE_FIXED32: 4, FieldDescriptor.TYPE_SFIXED32: 4,
    FieldDescriptor.TYPE_FLOAT: 4, FieldDescriptor.TYPE_FIXED64: 8,
    FieldDescriptor.TYPE_SFIXED64: 8, FieldDescriptor.TYPE_DOUBLE: 8,
}


def _check_packed(fd: FieldDescriptor, chunk: bytes) -> None:
    """A packed repeated scalar's payload is whole values (else protobuf refuses the
    request, before any string after it: `repeated uint32 token_ids` cut mid-varint)."""
    width = _FIXED_WIDTH.get(fd.type)
    if width is not None:
        if len(chunk) % width:
            raise ValueError("packed value cut")
        return
    i = 0
    while i < len(chunk):
        i = _varint(chunk, i)[1]


def _tag(data: bytes, i: int, has_fields: bool) -> tuple[int, int]:
    key, i = _varint(data, i)
    # protobuf accepts field number 0 in a message without fields (and only there)
    if key >> 3 >= 2**29 or key > 0xFFFFFFFF or (key >> 3 == 0 and has_fields):
        raise ValueError("bad field number")
    return key, i


def _skip(data: bytes, i: int, num: int, wt: int, depth: int) -> int:
    """Index after the value of field `num` of wire type `wt` (not 2) starting at `i`."""
    if wt == 0:
        return _varint(data, i)[1]
    if wt in (1, 5):
        i += 8 if wt == 1 else 4
        if i > len(data):
            raise ValueError("truncated value")
        return i
    if wt == 3:  # a group (unknown to proto3, or a known field sent so): skipped whole
        if depth + 1 > _MAX_DEPTH:
            raise ValueError("nested too deep")
        while True:
            key, i = _tag(data, i, True)
            if key & 7 == 4:
                if key >> 3 != num:
                    raise ValueError("end of another group")
                return i
            if key & 7 == 2:
                n, i = _varint(data, i)
                if n > len(data) - i:
                    raise ValueError("length past the end")
                i += n
            else:
                i = _skip(data, i, key >> 3, key & 7, depth + 1)
    raise ValueError(f"wire type {wt}")  # 4: an end without its group; 6, 7: none
