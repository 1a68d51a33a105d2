"""Values as the protobuf wire carries them, for the tests' models and bad-input cases."""

from __future__ import annotations

import struct


def bad_utf8(msg, placeholder: str) -> bytes:
    """`msg` serialized with one byte of `placeholder`'s field made invalid UTF-8 (the field
    must hold `placeholder`, and nothing else in `msg` the same bytes)."""
    raw = msg.SerializeToString()
    b = placeholder.encode()
    assert raw.count(b) == 1
    return raw.replace(b, b[:2] + b"\xff" + b[3:])


def f32(x: float) -> float:
    """`x` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]
