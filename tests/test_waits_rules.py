"""tests/waits.py: what the tests' shared waits return and say when they give up."""

from __future__ import annotations

import itertools
import time

import pytest

from tests.waits import holds_within, wait_until


def test_wait_until_returns_the_first_truthy_value_asked_every_interval():
    asked = itertools.count()
    t0 = time.monotonic()
    assert wait_until(lambda: [1] if next(asked) == 3 else [], 5, every=0.05) == [1]
    assert next(asked) == 4
    assert time.monotonic() - t0 >= 0.15  # three sleeps of 0.05 s


def test_wait_until_fails_with_the_callers_message_or_the_state_when_it_gave_up():
    with pytest.raises(AssertionError) as e:
        wait_until(lambda: False, 0.05)
    assert str(e.value) == "condition not reached in time"
    with pytest.raises(AssertionError) as e:
        wait_until(lambda: 0, 0.05, "the replica's load stayed")
    assert str(e.value) == "the replica's load stayed"
    state = ["before"]
    with pytest.raises(AssertionError) as e:
        wait_until(lambda: state.append("asked"), 0.05, lambda: f"{len(state)} states")
    assert str(e.value) == f"{len(state)} states"


def test_wait_until_asks_again_after_a_sleep_past_its_deadline_before_failing():
    t0 = time.monotonic()
    assert wait_until(lambda: time.monotonic() - t0 >= 0.1, 0.1, every=0.3)


def test_holds_within_answers_without_failing_and_asks_once_more_at_the_end():
    t0 = time.monotonic()
    assert holds_within(lambda: False, 0.1) is False
    assert 0.1 <= time.monotonic() - t0 < 5
    answers = iter([False, True])
    assert holds_within(lambda: next(answers), 0.0) is True  # the last ask, past the deadline
