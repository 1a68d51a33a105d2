"""Ends server streams at their deadline even while their handler is stuck sending.

A streaming handler sends each message and waits for the client's flow-control window: a
client that stops reading (and keeps its connection, which answers keepalive pings) holds
the handler inside that send, where no check of the request's own deadline runs. The stream,
its worker thread and its tenant's slot were held until the connection's maximum age, or for
good with none. `StreamReaper` ends such a call from outside: one thread for the process,
a heap of deadlines.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from typing import Any

import grpc

log = logging.getLogger(__name__)

# Seconds with nothing armed after which the reaper's thread ends (see `StreamReaper._run`).
IDLE_EXIT_S = 60.0


def end_call(context: Any, code: grpc.StatusCode, details: str) -> None:
    """End the server call of `context` now with `code` and `details` (the client sees them;
    the handler's pending send returns and its generator is closed). Falls back to the public
    `cancel()` (status CANCELLED) where this grpc keeps its call elsewhere."""
    try:
        # What the interceptor's count of the call reads (`bootstrap.rpc_ended`): its handler
        # only sees the call closed, as if the client had gone.
        context.tiercache_ended_with = code
    except AttributeError:
        pass
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    if call is not None:
        try:
            call.cancel(code.value[0], details)
            return
        except Exception:  # noqa: BLE001 - another grpc build: the public way below
            pass
    cancel = getattr(context, "cancel", None)
    if cancel is not None:
        cancel()


class StreamReaper:
    """Ends calls whose deadline passed: `arm(when, context, details)` and, when the call ends
    first, `disarm(token)`. `on_reap(details)` is told of each call it ends. Its one thread
    starts at the first `arm` and ends after IDLE_EXIT_S seconds with nothing armed."""

    def __init__(self, on_reap=None) -> None:
        self._heap: list[tuple[float, int]] = []
        self._armed: dict[int, tuple[Any, str]] = {}
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._on_reap = on_reap

    def arm(self, when: float, context: Any, details: str) -> int:
        """End the call of `context` at monotonic time `when` unless disarmed before."""
        with self._cv:
            token = next(self._ids)
            self._armed[token] = (context, details)
            heapq.heappush(self._heap, (when, token))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stream-reaper",
                                                 daemon=True)
                self._thread.start()
            if self._heap[0][1] == token:
                # Only a new earliest deadline changes the reaper's wait: kvpool arms once per
                # message sent, and woke the reaper thread for each.
                self._cv.notify()
        return token

    def disarm(self, token: int) -> None:
        with self._cv:
            self._armed.pop(token, None)  # its heap entry is skipped when it comes up
            # Entries are popped from the top only: behind one armed far in the future (a
            # stalled stream), every later disarmed one stayed, one per message sent.
            if len(self._heap) > 2 * len(self._armed) + 64:
                self._heap = [e for e in self._heap if e[1] in self._armed]
                heapq.heapify(self._heap)

    def armed(self) -> int:
        with self._cv:
            return len(self._armed)

    def _run(self) -> None:
        idle_until: float | None = None
        while True:
            with self._cv:
                while True:
                    while self._heap and self._heap[0][1] not in self._armed:
                        heapq.heappop(self._heap)  # disarmed: the call ended by itself
                    now = time.monotonic()
                    if not self._heap:
                        # Nothing armed for IDLE_EXIT_S: the thread ends (each server's reaper
                        # kept one for the life of the process, stopped servers' too); the
                        # next `arm` starts another under this lock.
                        if idle_until is None:
                            idle_until = now + IDLE_EXIT_S
                        elif now >= idle_until:
                            self._thread = None
                            return
                        self._cv.wait(idle_until - now)
                        continue
                    idle_until = None
                    wait = self._heap[0][0] - now
                    if wait <= 0:
                        _, token = heapq.heappop(self._heap)
                        context, details = self._armed.pop(token)
                        break
                    self._cv.wait(wait)
                failed: Exception | None = None
                try:
                    # Under the lock: once `disarm` has returned, the call is never ended
                    # from here (a whole answer ending at the deadline was cut otherwise).
                    end_call(context, grpc.StatusCode.DEADLINE_EXCEEDED, details)
                except Exception as exc:  # noqa: BLE001 - one call must not stop the reaper
                    failed = exc
            if failed is not None:  # logged outside the lock: a stuck log handler stalls none
                log.error("ending a call past its deadline failed: %r", failed)
                continue
            if self._on_reap is not None:
                try:
                    self._on_reap(details)
                except Exception:  # noqa: BLE001
                    log.exception("on_reap failed")
