"""Replaying a workload trace against a running stack (`tiercache replay trace.jsonl`).

Sessions run as chains (turn k+1 is sent after turn k's answer, with the history: the answers
as generated, not stripped), starting at their arrival time (scaled by `time_scale`; 0 = as
fast as the concurrency allows), and at most `concurrency` requests are in flight. Each
request's outcome is recorded for reports. A turn that fails, or answers nothing, ends its
session (the later turns are recorded as skipped: sent with a made-up answer in their history,
their figures would describe a conversation that never happened).
Ctrl-C sends nothing more and cancels the requests in flight.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import grpc
from tiercache.v1 import common_pb2, orchestrator_pb2

from benchmarks.workload import Request, Workload
from clients.python.client import IncompleteStream, TierCacheClient
from services.common.errors import blank


@dataclass
class Outcome:
    session_id: str
    tenant: str
    turn: int
    kind: str
    sent_at: float
    ttft_ms: float  # client-side: request sent -> first text
    total_ms: float
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    semantic_hit: bool
    similarity: float
    replica_id: str
    route: str
    error: str = ""
    # CacheReport.index_matched_tokens: what the chosen replica was expected to hold.
    expected_tokens: int = 0

    @property
    def cache_class(self) -> str:
        if self.semantic_hit:
            return "semantic_hit"
        return "prefix_hit" if self.cached_tokens >= 32 else "cold"


# Sessions a timed replay runs at once (each waits in a thread of its own between turns).
MAX_TIMED_SESSIONS = 512


def replay(workload: Workload, clients: dict[str, TierCacheClient], *, concurrency: int = 2,
           time_scale: float = 0.0, max_tokens: int = 16,
           cache_policy: common_pb2.CachePolicy | None = None,
           progress: Callable[[int, int], None] | None = None) -> list[Outcome]:
    """Run every session of `workload`; `clients` maps tenant -> client (with its token)."""
    sessions = workload.sessions()
    run = _Replay(workload, clients, concurrency, time_scale, max_tokens, cache_policy,
                  progress)
    ordered = sorted(sessions.values(), key=lambda rs: rs[0].at)
    # Timed, a session waits between its turns in its worker: with only 2 x concurrency of
    # them, later sessions started late and sent their overdue turns back to back. A worker
    # per session (bounded) then; `gate` alone bounds the requests in flight.
    workers = max(concurrency, 1) * 2
    if time_scale > 0:  # sessions past the cap start when a worker is free (late)
        workers = max(workers, min(len(ordered), MAX_TIMED_SESSIONS))
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        # Submitted under the handler: a Ctrl-C between two submits left the sessions already
        # submitted sending at their times, with their clients never closed.
        futures = [pool.submit(run.run_session, s) for s in ordered]
        # A session's own exception (its progress line's reader gone: a BrokenPipeError) ends
        # the run as Ctrl-C does: the others went on sending after `| head -1` had exited.
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
    except BaseException:  # Ctrl-C: nothing more is sent; the calls in flight are cancelled
        run.stopping.set()
        for c in clients.values():
            c.close()
        pool.shutdown(wait=False, cancel_futures=True)
        with run.lock:  # a progress line being written is done before the caller goes on
            pass
        raise
    pool.shutdown()
    return run.outcomes


@dataclass
class _Answer:
    """One turn's call: when it was sent, its first text came and it ended (monotonic); the
    text, the final message, and why it failed ("" = it did not)."""

    sent: float
    first_text: float | None = None
    end: float = 0.0
    text: list[str] = field(default_factory=list)
    final: orchestrator_pb2.GenerateFinal | None = None
    err: str = ""


class _Replay:
    """The state a replay's sessions share: outcomes, requests in flight, Ctrl-C."""

    def __init__(self, workload: Workload, clients: dict[str, TierCacheClient],
                 concurrency: int, time_scale: float, max_tokens: int,
                 cache_policy: common_pb2.CachePolicy | None,
                 progress: Callable[[int, int], None] | None) -> None:
        self.workload, self.clients = workload, clients
        self.time_scale, self.max_tokens, self.cache_policy = time_scale, max_tokens, cache_policy
        self.progress = progress
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.gate = threading.Semaphore(concurrency)
        self.total = len(workload.requests)
        self.t0 = time.monotonic()
        self.stopping = threading.Event()  # Ctrl-C: no new request

    def record(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)
            # Not once stopped: the calls Ctrl-C cancelled were counted after the CLI had
            # ended its counter's line.
            if self.progress and not self.stopping.is_set():
                self.progress(len(self.outcomes), self.total)

    def run_session(self, reqs: list[Request]) -> None:
        history: list[dict[str, str]] = []
        first = reqs[0]
        sys_prompt = self.workload.system_prompts[first.tenant][first.system_index]
        for i, r in enumerate(reqs):
            if not self._on_time(r):
                return
            msgs = [{"role": "system", "content": sys_prompt}, *history,
                    {"role": "user", "content": r.question}]
            ans = self._send(r, msgs)
            if ans is None:
                return
            self.record(self._outcome(r, ans))
            # Sent back as generated, not stripped (as the CLI saves a session's answers): an
            # answer ending in a newline, stripped, no longer matched the tokens its replica
            # cached, so the next turn recomputed them and the benchmark measured that.
            answer = "".join(ans.text)
            if ans.err or blank(answer):
                # An empty answer (or one of only invisible characters, blank as the server
                # reads it) cannot be sent back as an assistant turn (refused), and a
                # made-up one ("ok" was) would describe a conversation that never happened.
                why = "failed" if ans.err else "answered nothing"
                self._skip(reqs[i + 1:], r, why, ans.end)
                return
            history += [{"role": "user", "content": r.question},
                        {"role": "assistant", "content": answer}]

    def _on_time(self, r: Request) -> bool:
        """Wait for turn `r`'s time (timed replays); False once stopping."""
        if self.time_scale > 0:
            # Every turn at its own time (later turns arrive after the user has read the
            # answer): only the first waited, and the gaps that let caches evict were gone.
            delay = r.at * self.time_scale - (time.monotonic() - self.t0)
            if delay > 0 and self.stopping.wait(delay):
                return False
        return True

    def _send(self, r: Request, msgs: list[dict[str, str]]) -> _Answer | None:
        """Send turn `r` once a place in flight is free; None once stopping."""
        with self.gate:
            if self.stopping.is_set():
                return None
            ans = _Answer(time.monotonic())
            try:
                for ch in self.clients[r.tenant].stream(msgs, max_tokens=self.max_tokens,
                                                        session_id=r.session_id,
                                                        cache_policy=self.cache_policy):
                    if ch.text and ans.first_text is None:
                        ans.first_text = time.monotonic()
                    ans.text.append(ch.text)
                    if ch.final is not None:
                        ans.final = ch.final
            except grpc.RpcError as e:
                ans.err = f"{e.code().name}: {e.details()}"
            except IncompleteStream:
                ans.err = "stream ended without a final message"
            except Exception as e:  # noqa: BLE001 - one turn's failure, not the run's
                # Raised in a worker, it surfaced only at the end and lost every outcome.
                ans.err = f"{type(e).__name__}: {e}"
            else:
                if ans.final is None:  # a client whose stream() does not raise it
                    ans.err = "stream ended without a final message"
            ans.end = time.monotonic()
        return ans

    def _outcome(self, r: Request, ans: _Answer) -> Outcome:
        final = ans.final
        rep = final.cache_report if final is not None else common_pb2.CacheReport()
        return Outcome(
            r.session_id, r.tenant, r.turn, r.kind, ans.sent - self.t0,
            ((ans.first_text or ans.end) - ans.sent) * 1000.0, (ans.end - ans.sent) * 1000.0,
            rep.prompt_tokens, rep.cached_tokens,
            final.usage.completion_tokens if final is not None else 0,
            rep.semantic_hit, rep.semantic_similarity, rep.replica_id, rep.route, ans.err,
            rep.index_matched_tokens)

    def _skip(self, rest: list[Request], r: Request, why: str, end: float) -> None:
        """Record the session's turns after `r` as skipped."""
        for s in rest:
            self.record(Outcome(s.session_id, s.tenant, s.turn, s.kind, end - self.t0, 0.0, 0.0,
                                0, 0, 0, False, 0.0, "", "",
                                f"skipped: turn {r.turn} of the session {why}"))
