"""Waiting, in a test, for what another thread or process brings about."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(pred: Callable[[], T], timeout: float, what: str | Callable[[], str] =
               "condition not reached in time", every: float = 0.02) -> T:
    """`pred()`'s first truthy value, asked every `every` s; after `timeout` s an
    AssertionError saying `what` (or `what()`: the state of things when it gave up)."""
    end = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() >= end:
            raise AssertionError(what() if callable(what) else what)
        time.sleep(every)
    return got


def holds_within(cond: Callable[[], object], timeout: float = 5.0, every: float = 0.02) -> bool:
    """Whether `cond()` holds within `timeout` s (asked every `every` s, and once more at the
    end); no error when it does not, for a test that asserts on the answer itself."""
    end = time.monotonic() + timeout
    while not cond() and time.monotonic() < end:
        time.sleep(every)
    return bool(cond())
