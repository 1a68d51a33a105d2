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
from dataclasses import dataclass

import grpc
from tiercache.v1 import common_pb2

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
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    gate = threading.Semaphore(concurrency)
    total = len(workload.requests)
    t0 = time.monotonic()
    stopping = threading.Event()  # Ctrl-C: no new request

    def record(o: Outcome) -> None:
        with lock:
            outcomes.append(o)
            # Not once stopped: the calls Ctrl-C cancelled were counted after the CLI had
            # ended its counter's line.
            if progress and not stopping.is_set():
                progress(len(outcomes), total)

    def run_session(reqs: list[Request]) -> None:
        history: list[dict[str, str]] = []
        first = reqs[0]
        sys_prompt = workload.system_prompts[first.tenant][first.system_index]
        for i, r in enumerate(reqs):
            if time_scale > 0:
                # Every turn at its own time (later turns arrive after the user has read the
                # answer): only the first waited, and the gaps that let caches evict were gone.
                delay = r.at * time_scale - (time.monotonic() - t0)
                if delay > 0 and stopping.wait(delay):
                    return
            msgs = [{"role": "system", "content": sys_prompt}, *history,
                    {"role": "user", "content": r.question}]
            with gate:
                if stopping.is_set():
                    return
                sent = time.monotonic()
                first_text = None
                text: list[str] = []
                final = None
                err = ""
                try:
                    for ch in clients[r.tenant].stream(msgs, max_tokens=max_tokens,
                                                       session_id=r.session_id,
                                                       cache_policy=cache_policy):
                        if ch.text and first_text is None:
                            first_text = time.monotonic()
                        text.append(ch.text)
                        if ch.final is not None:
                            final = ch.final
                except grpc.RpcError as e:
                    err = f"{e.code().name}: {e.details()}"
                except IncompleteStream:
                    err = "stream ended without a final message"
                except Exception as e:  # noqa: BLE001 - one turn's failure, not the run's
                    # Raised in a worker, it surfaced only at the end and lost every outcome.
                    err = f"{type(e).__name__}: {e}"
                else:
                    if final is None:  # a client whose stream() does not raise it
                        err = "stream ended without a final message"
                end = time.monotonic()
            rep = final.cache_report if final is not None else common_pb2.CacheReport()
            o = Outcome(
                r.session_id, r.tenant, r.turn, r.kind, sent - t0,
                ((first_text or end) - sent) * 1000.0, (end - sent) * 1000.0,
                rep.prompt_tokens, rep.cached_tokens,
                final.usage.completion_tokens if final is not None else 0,
                rep.semantic_hit, rep.semantic_similarity, rep.replica_id, rep.route, err,
                rep.index_matched_tokens)
            record(o)
            # Sent back as generated, not stripped (as the CLI saves a session's answers): an
            # answer ending in a newline, stripped, no longer matched the tokens its replica
            # cached, so the next turn recomputed them and the benchmark measured that.
            answer = "".join(text)
            if err or blank(answer):
                # An empty answer (or one of only invisible characters, blank as the server
                # reads it) cannot be sent back as an assistant turn (refused), and a
                # made-up one ("ok" was) would describe a conversation that never happened.
                why = "failed" if err else "answered nothing"
                for s in reqs[i + 1:]:
                    record(Outcome(s.session_id, s.tenant, s.turn, s.kind, end - t0, 0.0, 0.0,
                                   0, 0, 0, False, 0.0, "", "",
                                   f"skipped: turn {r.turn} of the session {why}"))
                return
            history += [{"role": "user", "content": r.question},
                        {"role": "assistant", "content": answer}]

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
        futures = [pool.submit(run_session, s) for s in ordered]
        # A session's own exception (its progress line's reader gone: a BrokenPipeError) ends
        # the run as Ctrl-C does: the others went on sending after `| head -1` had exited.
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in done if f.exception() is not None), None)
        if failed is not None:
            raise failed.exception()
    except BaseException:  # Ctrl-C: nothing more is sent; the calls in flight are cancelled
        stopping.set()
        for c in clients.values():
            c.close()
        pool.shutdown(wait=False, cancel_futures=True)
        with lock:  # a progress line being written is done before the caller goes on
            pass
        raise
    pool.shutdown()
    return outcomes
