"""A settable clock for code that takes `clock=` (a callable returning seconds): tests move
it by setting or adding to `t`."""

from __future__ import annotations


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t
