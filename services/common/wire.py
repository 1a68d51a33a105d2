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


def find_invalid_utf8(desc: Descriptor, data: bytes, prefix: str = "") -> str | None:
    """Path of the first string field holding invalid UTF-8, or None if there is none."""
    counts: dict[int, int] = {}
    i = 0
    try:
        while i < len(data):
            key, i = _varint(data, i)
            num, wt = key >> 3, key & 7
            if wt == 0:
                _, i = _varint(data, i)
            elif wt == 1:
                i += 8
            elif wt == 5:
                i += 4
            elif wt == 2:
                n, i = _varint(data, i)
                chunk, i = data[i : i + n], i + n
                fd = desc.fields_by_number.get(num)
                if fd is None:
                    continue
                name = prefix + fd.name
                if fd.is_repeated:
                    idx = counts.get(num, 0)
                    counts[num] = idx + 1
                    name += f"[{idx}]"
                if fd.type == FieldDescriptor.TYPE_STRING:
                    try:
                        chunk.decode("utf-8")
                    except UnicodeDecodeError:
                        return name
                elif fd.type == FieldDescriptor.TYPE_MESSAGE:
                    if fd.message_type.GetOptions().map_entry:
                        name = prefix + fd.name
                    found = find_invalid_utf8(fd.message_type, chunk, name + ".")
                    if found:
                        return found
            else:
                return None
    except ValueError:
        return None
    return None
