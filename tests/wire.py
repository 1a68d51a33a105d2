"""Values as the protobuf wire carries them, for the tests' models and bad-input cases."""

from __future__ import annotations

import struct


def f32(x: float) -> float:
    """`x` rounded to the nearest float32."""
    return struct.unpack("f", struct.pack("f", x))[0]
