"""Soak: mixed traffic with client cancellations and deadline expiries, round after round, on a
loopback stack; checks that nothing leaks and memory does not grow.

    python -m benchmarks.soak [--rounds 12] [--requests 48] [--concurrency 6]
        ->  benchmarks/results/soak.json        (`make soak`; 1-4 minutes on 2 CPUs)

The same `run_soak` drives the short form in `make test` (tests/hardening/test_soak.py).

Each round sends the same mix from two tenants: repeated questions (semantic hits after the
first round), questions under shared system prompts (prefix hits; semantic tier skipped so the
model runs every round), and cold prompts new in every round (semantic tier skipped: they run
the model from scratch and churn the pools, whose size bounds what they leave behind). 10% of
requests are cancelled by the client after their first chunk and 10% carry a deadline too
short to finish. After every round, once traffic stops: every replica has no running sequence
and no referenced block (`free + cached + pinned == total`), and the RSS, open file
descriptors and threads of every process (from /proc) are recorded. Reported: latency p50/p99
of completed requests, outcome counts, RSS, descriptors and threads per process per round, and
their growth after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tiercache.v1 import common_pb2

from benchmarks import proc_status_value, rss_bytes
from clients.python.client import TierCacheClient

OUT = Path(__file__).resolve().parent / "results" / "soak.json"
CLEAN = {"OK", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
SYSTEMS = [f"You are assistant number {i} of the Harbour Museum. " + " ".join(
    f"Exhibit {j}: hall {j % 4}, open {8 + j % 3} to {17 + j % 2}." for j in range(10))
    for i in range(3)]
REPEATED = ["What is the capital of France?", "Name three primary colours.",
            "How many legs does a spider have?", "What is the boiling point of water?"]
# Growth allowed from the end of the first (warm-up) round to the end of the last one.
RSS_GROWTH_LIMIT = (48 * 2**20, 0.10)  # bytes, fraction: the larger of the two
# Open descriptors and threads may grow by this many over the same span. Measured (2026-12-07)
# on a live stack after hundreds of chats (semantic and prefix hits, cancels, deadline
# expiries), Warm, Stats, Feedback, EraseTenant, semantic Store/Lookup/Invalidate, grpcurl
# reflection and health calls, each on a new channel, a replica stopped past its lease three
# times and one killed and restarted four times: no process's descriptors grew, and they read
# +-1 from one idle moment to the next (a connection opening or closing as they are counted).
# Threads grew only with the concurrency (gRPC's and the Warm pool's workers start on demand,
# up to their max_workers, and stay) and then read -1..+2 at a steady one; the long form moved
# them by at most +1. A leak of one per request or per cancelled request (5 of the long
# form's 48) exceeds these within two rounds.
COUNT_GROWTH_LIMIT = {"fds": 4, "threads": 8}


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid: int) -> int:
    return proc_status_value(pid, "Threads")


def growth(res: SoakResult, key: str, since: int = 0) -> dict[str, int]:
    """Per process: `key` ("rss", "fds", "threads") at the last round minus at round `since`."""
    first, last = res.rounds[since][key], res.rounds[-1][key]
    return {k: last[k] - first[k] for k in first}


@dataclass
class Job:
    kind: str  # "repeat" | "prefix" | "cold"
    messages: list[dict]
    tenant_token: str
    mode: str  # "normal" | "cancel" | "deadline"
    policy: common_pb2.CachePolicy = field(default_factory=common_pb2.CachePolicy)
    deadline_s: float = 0.0  # the client's deadline in "deadline" mode (drawn with the mode)


@dataclass
class SoakResult:
    rounds: list[dict] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)
    outcomes: Counter = field(default_factory=Counter)
    by_kind: Counter = field(default_factory=Counter)

    def summary(self) -> dict:
        lat = sorted(self.latencies_ms)

        def pct(q: float) -> float:
            return round(lat[min(len(lat) - 1, int(q * (len(lat) - 1) + 0.5))], 1) if lat else 0.0

        return {"requests": sum(self.outcomes.values()), "outcomes": dict(self.outcomes),
                "by_kind_mode_outcome": dict(sorted(self.by_kind.items())),
                "latency_ms": {"p50": pct(0.5), "p99": pct(0.99), "max": pct(1.0),
                               "completed": len(lat)},
                "rss_growth_bytes_after_warmup": growth(self, "rss"),
                "fd_growth_after_warmup": growth(self, "fds"),
                "thread_growth_after_warmup": growth(self, "threads"),
                "rounds": self.rounds}


def make_jobs(n: int, tokens: tuple[str, str], round_no: int, seed: int) -> list[Job]:
    """The mix of a round: the same kinds and repeated content every round, fresh cold prompts
    and fresh cancellation/deadline draws per round."""
    content = random.Random(seed)
    modes = random.Random(seed * 1000 + round_no)
    model_only = common_pb2.CachePolicy(skip_semantic_lookup=True, skip_semantic_store=True)
    jobs = []
    for i in range(n):
        r = content.random()
        tok = tokens[i % 2]
        if r < 0.35:
            kind, msgs = "repeat", [{"role": "user", "content": content.choice(REPEATED)}]
        elif r < 0.8:
            kind = "prefix"
            msgs = [{"role": "system", "content": content.choice(SYSTEMS)},
                    {"role": "user", "content": f"Where is exhibit {content.randrange(10)}?"}]
        else:
            kind, msgs = "cold", [{"role": "user", "content": (
                f"Round {round_no}: spell the number {modes.randrange(10**6)}.")}]
        m = modes.random()
        mode = "cancel" if m < 0.10 else "deadline" if m < 0.20 else "normal"
        jobs.append(Job(kind, msgs, tok, mode,
                        common_pb2.CachePolicy() if kind == "repeat" else model_only,
                        modes.uniform(0.05, 0.6)))
    return jobs


def run_job(address: str, job: Job, max_tokens: int, timeout: float) -> tuple[str, float]:
    t0 = time.monotonic()
    deadline = timeout if job.mode != "deadline" else job.deadline_s
    try:
        with TierCacheClient(address, token=job.tenant_token, timeout=deadline) as c:
            stream = c.stream(job.messages, max_tokens=max_tokens, ignore_eos=True,
                              cache_policy=job.policy)
            for ch in stream:
                if job.mode == "cancel":
                    stream.close()  # the client's finally cancels the call
                    return "CANCELLED", (time.monotonic() - t0) * 1000
                if ch.final is not None:
                    break
        return "OK", (time.monotonic() - t0) * 1000
    except grpc.RpcError as e:
        return e.code().name, (time.monotonic() - t0) * 1000


def run_soak(*, address: str, pids: dict[str, int], wait_idle, rounds: int, requests: int,
             concurrency: int, tokens: tuple[str, str], max_tokens: int = 6,
             timeout: float = 60.0, seed: int = 7, idle_timeout: float = 60.0,
             log=print) -> SoakResult:
    """Run `rounds` rounds of `requests` jobs. After each, `wait_idle(idle_timeout)` returns
    every replica's Stats once every sequence ended, no block is referenced and the pools'
    books balance, or raises AssertionError (the stack's `wait_kv_idle`)."""
    res = SoakResult()
    for rnd in range(rounds):
        t0 = time.monotonic()
        jobs = make_jobs(requests, tokens, rnd, seed)
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            outs = list(pool.map(lambda j: run_job(address, j, max_tokens, timeout), jobs))
        for job, (code, ms) in zip(jobs, outs, strict=True):
            res.outcomes[code] += 1
            res.by_kind[f"{job.kind}/{job.mode}/{code}"] += 1
            if code not in CLEAN:
                raise AssertionError(f"round {rnd}: {job.kind}/{job.mode} ended {code}")
            if code == "OK" and job.mode == "normal":
                res.latencies_ms.append(ms)
        try:
            st = wait_idle(idle_timeout)
        except AssertionError as e:
            raise AssertionError(f"round {rnd}: {e}") from None
        rss = {name: rss_bytes(pid) for name, pid in pids.items()}
        res.rounds.append({"round": rnd, "seconds": round(time.monotonic() - t0, 1),
                           "outcomes": dict(Counter(code for code, _ in outs)),
                           "rss": rss,
                           "fds": {name: open_fds(pid) for name, pid in pids.items()},
                           "threads": {name: thread_count(pid) for name, pid in pids.items()},
                           "blocks_cached": {s.replica_id: s.blocks_cached for s in st}})
        log(f"round {rnd}: {res.rounds[-1]['outcomes']} in {res.rounds[-1]['seconds']} s, "
            f"rss MiB {{{', '.join(f'{k}: {v / 2**20:.0f}' for k, v in rss.items())}}}, "
            f"fds {res.rounds[-1]['fds']}, threads {res.rounds[-1]['threads']}")
    return res


def rss_growth_ok(res: SoakResult, since: int = 0) -> dict[str, bool]:
    """Per process: whether its RSS grew from round `since` to the last within
    RSS_GROWTH_LIMIT."""
    first = res.rounds[since]["rss"]
    lim_b, lim_f = RSS_GROWTH_LIMIT
    return {k: g <= max(lim_b, lim_f * first[k]) for k, g in growth(res, "rss", since).items()}


def count_growth_over(res: SoakResult, since: int = 0) -> dict[str, dict[str, int]]:
    """Per count ("fds", "threads"): the processes whose count grew past its limit, and by
    how much; empty when none did."""
    return {key: over for key, lim in COUNT_GROWTH_LIMIT.items()
            if (over := {k: g for k, g in growth(res, key, since).items() if g > lim})}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)

    from tests.hardening.conftest import TOK_A, TOK_B, start_stack

    with tempfile.TemporaryDirectory() as tmp:
        stack = start_stack(Path(tmp))
        try:
            pids = {f"{p.name}:{p.port}": p.proc.pid for p in stack.all()}
            t0 = time.monotonic()
            res = run_soak(address=stack.orch.address, pids=pids, wait_idle=stack.wait_kv_idle,
                           rounds=args.rounds, requests=args.requests,
                           concurrency=args.concurrency, tokens=(TOK_A, TOK_B))
            wall = time.monotonic() - t0
        finally:
            stack.stop()
    rss_ok, counts_over = rss_growth_ok(res), count_growth_over(res)
    out = {"benchmark": "soak", "wall_s": round(wall, 1),
           "config": {"rounds": args.rounds, "requests_per_round": args.requests,
                      "concurrency": args.concurrency, "cancel_fraction": 0.10,
                      "deadline_fraction": 0.10, "max_tokens": 6},
           **res.summary(),
           "targets": {"no_leaked_blocks": "met (checked after every round)",
                       "rss_growth_after_warmup": "met" if all(rss_ok.values())
                       else f"not met: {rss_ok}",
                       "rss_growth_limit": f"max({RSS_GROWTH_LIMIT[0] // 2**20} MiB, "
                                           f"{RSS_GROWTH_LIMIT[1]:.0%})",
                       "fd_thread_growth_after_warmup": "met" if not counts_over
                       else f"not met: {counts_over}",
                       "fd_thread_growth_limit": COUNT_GROWTH_LIMIT}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(json.dumps({k: out[k] for k in ("wall_s", "outcomes", "latency_ms", "targets")},
                     indent=2))
    return 0 if all(rss_ok.values()) and not counts_over else 1


if __name__ == "__main__":
    sys.exit(main())
