"""A settable clock for code that takes `clock=` (a callable returning seconds): tests move
it by setting or adding to `t`. `LogsTime`: `time` as services/common/logs.py reads it (the
`logs_clock` fixture of tests/conftest.py puts one in its place)."""

from __future__ import annotations

import time


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class LogsTime:
    """`time` as the logs module reads it, with a monotonic and a wall clock the test moves."""

    def __init__(self) -> None:
        self.mono, self.wall = 1000.0, 1_700_000_000.0
        self.strftime, self.gmtime, self.sleep = time.strftime, time.gmtime, time.sleep

    def monotonic(self) -> float:
        return self.mono

    def time(self) -> float:
        return self.wall

    def advance(self, s: float) -> None:
        self.mono += s
        self.wall += s
