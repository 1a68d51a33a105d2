"""A differential review of `DispatchMemory` (services/orchestrator/dispatched.py): seeded random
sequences of dispatches (`record`), failed replicas (`forget`), index answers to merge
(`merged`), lookups (`match`, `len`) and the clock moving are driven through the real memory
and through a brute-force model of its documented memory; every answer is compared after every
step, and the memory's two maps are checked to agree.

The model, from the module's docstring and docs/architecture.md step 5: a record per (replica,
block hash), stamped with when it was last sent there (a resend refreshes it) and a running
number; it is remembered while younger than `ttl_s` (gone at exactly `ttl_s`: "a stale credit
lasts at most ttl_s"); past `max_blocks` records over all replicas, the oldest stamp goes first,
whichever replica holds it; `forget` drops a replica's records at once; a replica matches the
leading run of a prompt's hashes it holds, in tokens (run x block_size); `merged` raises the
index's figure per replica to that, never lowers it; ttl 0 is off (nothing kept or matched).
Capacities of 1-8 blocks, 2-6 distinct hashes, repeated hashes in one prompt, clock steps of
exactly `ttl_s` make evictions, refreshes and the expiry boundary frequent.

Run: 3,000 seeds of 60 steps by hand, no divergence (the memory agrees with its docs).
Injected bugs each caught (seeds of 3,000 failing): expiry at `<` instead of `<=` the cutoff
(1,158), a resend not refreshing the record's age and order (1,297), eviction taking the
newest (1,790), `forget` leaving the replica's hashes matchable (2,389).
`ORCH_DISPATCHED_DIFFERENTIAL_SEEDS=N` runs more (default 1,000, under half a second);
`python -m tests.orchestrator.test_dispatched_differential 3000` by hand.
"""

from __future__ import annotations

import os
import random
import sys

import pytest

from services.orchestrator.dispatched import DispatchMemory
from tests.clock import Clock

SEEDS = int(os.environ.get("ORCH_DISPATCHED_DIFFERENTIAL_SEEDS", "1000"))


class Model:
    def __init__(self, block_size: int, ttl_s: float, max_blocks: int) -> None:
        self.bs, self.ttl, self.cap = block_size, ttl_s, max_blocks
        self.rec: dict[tuple[str, bytes], tuple[float, int]] = {}  # -> (sent at, number)
        self.n = 0

    def live(self, now: float) -> dict[tuple[str, bytes], tuple[float, int]]:
        return {k: v for k, v in self.rec.items() if now - v[0] < self.ttl}

    def record(self, rid: str, hashes: list[bytes], now: float) -> None:
        if self.ttl <= 0:
            return
        for h in hashes:
            self.n += 1
            self.rec[(rid, h)] = (now, self.n)
        self.rec = self.live(now)
        while len(self.rec) > self.cap:
            del self.rec[min(self.rec, key=self.rec.__getitem__)]

    def match(self, hashes: list[bytes], now: float) -> dict[str, int]:
        if self.ttl <= 0:
            return {}
        live = self.live(now)
        out = {}
        for rid in {r for r, _ in live}:
            run = 0
            for h in hashes:
                if (rid, h) not in live:
                    break
                run += 1
            if run:
                out[rid] = run * self.bs
        return out

    def forget(self, rid: str) -> None:
        self.rec = {k: v for k, v in self.rec.items() if k[0] != rid}


def run(seed: int, steps: int = 60) -> None:
    rng = random.Random(seed)
    bs = rng.choice([1, 4, 16])
    ttl = rng.choice([0, 1, 2, 3, 5, 10])
    cap = rng.choice([1, 2, 3, 5, 8, 50])
    clock = Clock(float(rng.randint(0, 100)))
    mem = DispatchMemory(bs, ttl, cap, clock=clock)
    model = Model(bs, ttl, cap)
    replicas = [f"r{i}" for i in range(rng.randint(1, 3))]
    pool = [bytes([i]) for i in range(rng.randint(2, 6))]
    log: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            tail = "\n".join(log[-12:])
            raise AssertionError(f"seed {seed} (block {bs}, ttl {ttl}, max {cap}), step "
                                 f"{len(log)}: {what}\n{tail}")

    for _ in range(steps):
        op = rng.random()
        hs = [rng.choice(pool) for _ in range(rng.randint(0, 5))]
        if op < 0.35:
            rid = rng.choice(replicas)
            mem.record(rid, hs[:4])
            model.record(rid, hs[:4], clock.t)
            log.append(f"t={clock.t} record {rid} {[h[0] for h in hs[:4]]}")
        elif op < 0.45:
            rid = rng.choice(replicas)
            mem.forget(rid)
            model.forget(rid)
            log.append(f"t={clock.t} forget {rid}")
        elif op < 0.65:
            clock.t += rng.choice([0, 0.5, 1, 1, 2, ttl, max(0, ttl - 0.5)])
            log.append(f"t={clock.t}")
        elif op < 0.75:
            got, want = len(mem), len(model.live(clock.t))
            log.append(f"t={clock.t} len -> {got}")
            check(got == want, f"len {got}, model {want}")
        elif op < 0.88:
            got, want = mem.match(hs), model.match(hs, clock.t)
            log.append(f"t={clock.t} match {[h[0] for h in hs]} -> {got}")
            check(got == want, f"match {got}, model {want}")
        else:
            index = {r: rng.choice([0, bs, 2 * bs, 5 * bs])
                     for r in rng.sample(replicas, rng.randint(0, len(replicas)))}
            got = mem.merged(index, hs)
            want = dict(index)
            for r, t in model.match(hs, clock.t).items():
                want[r] = max(want.get(r, 0), t)
            log.append(f"t={clock.t} merged {index} {[h[0] for h in hs]} -> {got}")
            check(got == want, f"merged {got}, model {want}")
        with mem._lock:  # its own integrity: the order and the per-replica sets agree
            check(set(mem._order) == {(r, h) for r, s in mem._by_replica.items() for h in s}
                  and all(mem._by_replica.values()), "the order and the per-replica sets differ")


@pytest.mark.parametrize("first", range(0, SEEDS, 100))
def test_the_memory_answers_as_the_documented_model(first: int) -> None:
    for seed in range(first, min(first + 100, SEEDS)):
        run(seed)


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    failed = 0
    for s in range(n):
        try:
            run(s)
        except AssertionError as e:
            failed += 1
            if failed <= 3:
                print(e, "\n")
    print(f"{failed} of {n} seeds failed")
