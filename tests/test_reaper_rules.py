"""Rules of `StreamReaper` (services/common/reaper.py) a mutation audit found unchecked: a
nearer deadline armed later, armed calls kept when the heap is compacted, one thread, and a
failing end or `on_reap` stopping neither the reaper nor the calls behind it."""

from __future__ import annotations

import threading
import time

from services.common.reaper import StreamReaper
from tests.test_reaper import _wait_for


class _Ctx:
    """A server context with the public `cancel()` only; `fails` makes that raise."""

    def __init__(self, ended: list[str], name: str, fails: bool = False) -> None:
        self.ended, self.name, self.fails = ended, name, fails

    def cancel(self) -> None:
        if self.fails:
            raise RuntimeError("cannot cancel")
        self.ended.append(self.name)


def test_a_nearer_deadline_armed_later_is_ended_at_its_time():
    """The reaper waits for the earliest deadline: one armed after a far one must wake it."""
    ended: list[str] = []
    reaper = StreamReaper()
    reaper.arm(time.monotonic() + 30, _Ctx(ended, "far"), "far")
    time.sleep(0.1)  # the reaper thread now waits on the far one
    reaper.arm(time.monotonic() + 0.2, _Ctx(ended, "near"), "near")
    _wait_for(lambda: ended == ["near"], timeout=3)
    assert reaper.armed() == 1


def test_compacting_the_heap_keeps_the_calls_still_armed():
    """Disarmed entries are swept out of the heap; an armed call among them still ends."""
    ended: list[str] = []
    reaper = StreamReaper()
    reaper.arm(time.monotonic() + 0.5, _Ctx(ended, "armed"), "armed")
    for _ in range(500):
        reaper.disarm(reaper.arm(time.monotonic() + 60, _Ctx(ended, "sent"), "sent"))
    assert len(reaper._heap) < 100  # compacted
    _wait_for(lambda: ended == ["armed"], timeout=5)


def test_one_thread_reaps_every_call_of_a_reaper():
    """'One thread for the process': arming more calls starts no more threads."""
    ended: list[str] = []
    reaper = StreamReaper()
    # Threads, not a count: another reaper's idle thread may end meanwhile (IDLE_EXIT_S).
    before = {t for t in threading.enumerate() if t.name == "stream-reaper"}
    for i in range(5):
        reaper.arm(time.monotonic() + 30, _Ctx(ended, str(i)), str(i))
    assert {t for t in threading.enumerate() if t.name == "stream-reaper"} - before == {
        reaper._thread}


def test_a_call_that_fails_to_end_is_not_reported_and_the_reaper_goes_on():
    """`on_reap` hears of each call ended, not of one whose end raised; neither that nor an
    `on_reap` that raises stops the reaper ending the calls behind."""
    ended: list[str] = []
    told: list[str] = []

    def on_reap(details: str) -> None:
        told.append(details)
        if details == "told, then raises":
            raise RuntimeError("on_reap broke")

    reaper = StreamReaper(on_reap=on_reap)
    now = time.monotonic()
    reaper.arm(now + 0.1, _Ctx(ended, "x", fails=True), "cannot end")
    reaper.arm(now + 0.2, _Ctx(ended, "a"), "told, then raises")
    reaper.arm(now + 0.3, _Ctx(ended, "b"), "last")
    _wait_for(lambda: ended == ["a", "b"], timeout=3)
    _wait_for(lambda: told == ["told, then raises", "last"], timeout=3)
    assert reaper.armed() == 0


def test_disarming_a_call_already_ended_is_harmless():
    """A handler disarms when its stream ends, which may be after the reaper ended it."""
    ended: list[str] = []
    reaper = StreamReaper()
    token = reaper.arm(time.monotonic() + 0.05, _Ctx(ended, "x"), "x")
    _wait_for(lambda: ended == ["x"], timeout=3)
    reaper.disarm(token)
    assert reaper.armed() == 0


def test_the_thread_ends_when_idle_and_the_next_arm_starts_another(monkeypatch):
    """Nothing armed for IDLE_EXIT_S: the thread ends (each servicer's reaper kept one for
    the life of the process); a call armed after that is still ended at its deadline, and
    one armed while the thread waits out its idle time keeps it."""
    from services.common import reaper as reaper_mod
    monkeypatch.setattr(reaper_mod, "IDLE_EXIT_S", 60.0)
    ended: list[str] = []
    reaper = StreamReaper()
    with reaper._cv:  # the thread's first look finds the call disarmed: it goes idle
        reaper.disarm(reaper.arm(time.monotonic() + 30, _Ctx(ended, "done"), "done"))
    first = reaper._thread
    assert first is not None
    # Waiting out its idle time, fixed at 60 s as it began (no sleep racing a short one on a
    # loaded host): an arm now keeps this thread; the idle times after it are 0.3 s.
    _wait_for(lambda: len(reaper._cv._waiters) == 1, timeout=3)
    monkeypatch.setattr(reaper_mod, "IDLE_EXIT_S", 0.3)
    reaper.arm(time.monotonic() + 0.4, _Ctx(ended, "kept"), "kept")
    assert reaper._thread is first
    _wait_for(lambda: ended == ["kept"], timeout=3)
    _wait_for(lambda: not first.is_alive(), timeout=3)
    assert reaper._thread is None
    reaper.arm(time.monotonic() + 0.1, _Ctx(ended, "later"), "later")
    second = reaper._thread
    assert second is not None and second is not first
    _wait_for(lambda: ended == ["kept", "later"], timeout=3)
    _wait_for(lambda: not second.is_alive(), timeout=3)
