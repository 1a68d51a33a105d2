"""A differential review of routing.PrefixAwarePolicy: seeded random request sequences against
a brute-force model of its documented rules, every answer compared as it is given.

The model (written from routing.py's module docstring, docs/architecture.md step 6 and
services/common/ring.py's docstrings, not from the code) recomputes everything from scratch
for each request:

- live replicas are the ones given minus `exclude`; none: no answer;
- a replica is under the bounded-load cap when its load + 1 <= ceil((1 + eps)(total + 1)/n)
  (total and n over the live replicas, exact rational arithmetic) or its load is at most
  `load_floor`;
- the recent share: every recorded route is kept with its time, and a replica's count is the
  sum of exp(-age / window_s) over its routes; once the live replicas' total reaches
  min_recent x n (n >= 2), a replica with more than (1 + eps) / n of it is over its share, for
  a new conversation only (`continues` = never);
- among the live replicas under the cap, not over their share, with a match >=
  min_prefix_tokens, the best matched - load_penalty x load wins ("prefix"); a tie may go to
  any of the tied replicas, but (a per-key hash, not list order) the same whatever order the
  replicas are listed in, and never one way for a key and the other way later;
- else the ring ("ring"): the live replicas in clockwise order from the key, computed by brute
  force from the ring's documented placement (each node at BLAKE2b-64 of "name#i",
  i < vnodes; a key belongs to the first point clockwise from its own hash), each replica
  ranked by its nearest point; the first under the cap that is not over its share and, when
  `new_blocks` is given, has free_blocks >= new_blocks; else the first under the cap not over
  its share; else the first under the cap (the docs are silent on whether room still counts
  there: either answer is taken); else the least loaded, first in clockwise order;
- `matched_tokens` is the chosen replica's match; `record=False` (and `record()` called
  directly) counts no route (counts one).

Comparisons within floating-point reach of a share boundary (the code's decay multiplies and
drops counts under 1e-3; the model sums exponentials) accept either side. After every step the
ring's own points are checked against the brute-force placement of exactly the replicas of
the last call that had any live, so joins and leaves are covered by the comparison itself (a
key moves only when the replica it sat on left, or when one joined ahead of it).

Run: 5,000 seeds x 160 steps (~650,000 routed requests: eps 0 / 0.1 / 0.25 / 1, vnodes 1-16,
floors 0-2, min_recent 0 / 1 / 4 / inf, windows 0.5-30 s, replicas joining and leaving,
exclusions, stale matches for departed replicas, tiny free-block counts), and round robin.
Found: a new conversation whose replicas with room were all over the load cap went to a
replica over its recent share ahead of one under it, for about one seed in 30 (the walk was
handed the room set alone, and its fallback was any replica under the cap); fixed in
routing.py, test_routing_rules.py::test_room_never_outranks_the_share_rule_on_the_ring guards
it deterministically. Also seen, not a defect: a share exactly on its boundary (seed 330: one
replica of four with exactly (1 + 1) / 4 of the decayed counts) is decided by the last bit of
a sum taken in list order, so the same request listed in another order may differ there.
Each of 8 hand-made mutants (cap off by one, min_recent as a total, the share rule moving
later turns, ties by list order, a doubled window, the ring ignoring the floor, a ring
keeping a removed node, shares counted over excluded replicas) fails 15-100 % of seeds.
`ROUTING_DIFFERENTIAL_SEEDS=N` runs more (default 200, ~3 s).
"""

from __future__ import annotations

import math
import os
import random
from fractions import Fraction

import pytest

from services.orchestrator.routing import PrefixAwarePolicy, ReplicaView, RoundRobinPolicy
from tests.clock import Clock
from tests.test_ring_differential import h64

SEEDS = int(os.environ.get("ROUTING_DIFFERENTIAL_SEEDS", "200"))
STEPS = 160
POOL = ["r0", "r1", "r2", "kvpool-0", "kvpool-1", "kvpool-10"]
KEYS = ["s", "acme\x1fsess-1", "acme\x1fsess-2", "beta\x1f7", "", "x" * 40]


_POINTS: dict[tuple[str, int], list[int]] = {}


def points(name: str, vnodes: int) -> list[int]:
    got = _POINTS.get((name, vnodes))
    if got is None:
        got = _POINTS[(name, vnodes)] = [h64(f"{name}#{i}".encode()) for i in range(vnodes)]
    return got


def clockwise(key: str, names: list[str], vnodes: int) -> list[str]:
    """`names` ordered by their nearest point strictly clockwise of the key's hash (a point at
    the key's own hash is a full turn away), ties by name."""
    k = h64(key.encode())
    dist = {n: min((p - k - 1) % 2**64 for p in points(n, vnodes)) for n in names}
    return sorted(names, key=lambda n: (dist[n], n))


def over_cap(load: float, total: float, n: int, eps: Fraction, floor: int) -> bool:
    if Fraction(load) <= floor:
        return False
    bound = math.ceil((1 + eps) * (Fraction(total) + 1) / n)
    return Fraction(load) + 1 > bound


class Model:
    def __init__(self, eps: str, min_prefix: int, penalty: float, vnodes: int, window: float,
                 min_recent: float, floor: int) -> None:
        self.eps_f = float(eps)
        self.eps = Fraction(eps)
        self.min_prefix, self.penalty, self.vnodes = min_prefix, penalty, vnodes
        self.window, self.min_recent, self.floor = window, min_recent, floor
        self.routed: list[tuple[float, str]] = []  # (time, replica) of every counted route
        self.ring: set[str] = set()
        self.prefers: dict[str, set[tuple[str, str]]] = {}  # key -> (winner, loser) on ties

    def record(self, now: float, rid: str) -> None:
        self.routed.append((now, rid))

    def busy_sets(self, now: float, live: list[str]) -> list[frozenset[str]] | None:
        """Every over-share set the docs allow, given the floating-point slack (None: too
        many boundary cases to enumerate)."""
        n = len(live)
        counts = dict.fromkeys(live, 0.0)
        for t, rid in self.routed:
            if rid in counts:
                counts[rid] += math.exp(-(now - t) / self.window)
        total = sum(counts.values())
        seen = len({rid for _, rid in self.routed})
        tol = 1e-9 * (1 + total) + 2e-3 * seen
        if n < 2 or self.min_recent == math.inf:
            return [frozenset()]
        gate = total - self.min_recent * n
        gates = [gate >= 0] if abs(gate) > tol else [True, False]
        sure: set[str] = set()
        maybe: list[str] = []
        for rid, c in counts.items():
            d = c - (1 + self.eps_f) * total / n
            if abs(d) <= tol:
                maybe.append(rid)
            elif d > 0:
                sure.add(rid)
        if len(maybe) > 6:
            return None
        out = set()
        for g in gates:
            if not g:
                out.add(frozenset())
                continue
            for mask in range(2 ** len(maybe)):
                out.add(frozenset(sure | {m for i, m in enumerate(maybe) if mask >> i & 1}))
        return list(out)

    def answers(self, views: list[ReplicaView], matches: dict[str, int], key: str,
                exclude: frozenset[str], new_blocks: int | None, busy: frozenset[str]):
        """(acceptable (replica, route) pairs, tied replicas of a prefix route or None)."""
        live = [v for v in views if v.replica_id not in exclude]
        n = len(live)
        total = sum(v.load for v in live)
        under = {v.replica_id for v in live
                 if not over_cap(v.load, total, n, self.eps, self.floor)}
        scored = {v.replica_id: matches.get(v.replica_id, 0) - self.penalty * v.load
                  for v in live if matches.get(v.replica_id, 0) >= self.min_prefix
                  and v.replica_id in under and v.replica_id not in busy}
        if scored:
            top = max(scored.values())
            tied = {r for r, s in scored.items() if s == top}
            return {(r, "prefix") for r in tied}, (tied if len(tied) > 1 else None)
        order = clockwise(key, [v.replica_id for v in live], self.vnodes)
        room = ({v.replica_id for v in live if v.free_blocks >= new_blocks}
                if new_blocks is not None else set())
        for tier in (under - busy) & room, under - busy:
            first = next((r for r in order if r in tier), None)
            if first is not None:
                return {(first, "ring")}, None
        if under:
            got = {next(r for r in order if r in under)}
            with_room = next((r for r in order if r in under & room), None)
            if with_room is not None:
                got.add(with_room)
            return {(r, "ring") for r in got}, None
        loads = {v.replica_id: v.load for v in live}
        least = min(loads.values())
        return {(next(r for r in order if loads[r] == least), "ring")}, None

    def check_tie(self, key: str, tied: set[str], winner: str) -> None:
        """A tie goes by a per-key order of the replicas: never a before b and later b
        before a for one key."""
        seen = self.prefers.setdefault(key, set())
        for other in tied - {winner}:
            assert (other, winner) not in seen, (key, other, winner)
            seen.add((winner, other))


def ring_points_ok(policy: PrefixAwarePolicy, members: set[str], vnodes: int) -> None:
    want = sorted((p, n) for n in members for p in points(n, vnodes))
    assert list(zip(policy.ring._points, policy.ring._owners, strict=True)) == want
    assert policy.ring.nodes == sorted(members)


def run_seed(seed: int, steps: int = STEPS, policy_cls=PrefixAwarePolicy) -> dict[str, int]:
    rng = random.Random(seed)
    eps = rng.choice(["0", "0.1", "0.25", "0.25", "1"])
    cfg = {
        "min_prefix": rng.choice([0, 1, 32, 32]),
        "penalty": rng.choice([0.0, 16.0, 16.0, 7.5]),
        "vnodes": rng.choice([1, 2, 4, 16]),
        "window": rng.choice([0.5, 5.0, 30.0]),
        "min_recent": rng.choice([0.0, 1.0, 4.0, 4.0, math.inf]),
        "floor": rng.choice([0, 1, 2, 2]),
    }
    clock = Clock(100.0)
    policy = policy_cls(epsilon=float(eps), min_prefix_tokens=cfg["min_prefix"],
                        load_penalty_tokens=cfg["penalty"], vnodes=cfg["vnodes"],
                        window_s=cfg["window"], min_recent=cfg["min_recent"], clock=clock,
                        load_floor=cfg["floor"])
    model = Model(eps, cfg["min_prefix"], cfg["penalty"], cfg["vnodes"], cfg["window"],
                  cfg["min_recent"], cfg["floor"])
    pool = rng.sample(POOL, rng.randint(2, len(POOL)))
    keys = rng.sample(KEYS, rng.randint(1, 4))
    members = rng.sample(pool, rng.randint(1, len(pool)))
    stats = {"prefix": 0, "ring": 0, "none": 0, "ties": 0, "ambiguous": 0, "skipped": 0}
    mp = cfg["min_prefix"]
    for _ in range(steps):
        clock.t += rng.choice([0.0, 0.0, 0.0, rng.uniform(0, cfg["window"] / 4),
                               cfg["window"], 10 * cfg["window"]])
        r = rng.random()
        if r < 0.1:  # a replica joins or leaves
            rid = rng.choice(pool)
            members = ([m for m in members if m != rid] if rid in members
                       else [*members, rid])
        elif r < 0.13:
            members = rng.sample(pool, rng.randint(0, len(pool)))
        elif r < 0.18 and members:  # a route counted outside choose
            rid = rng.choice(members)
            policy.record(rid)
            model.record(clock.t, rid)
            continue
        views = [ReplicaView(m, rng.choice([0, 0, 0, 1, 1, 2, 3, 5, 8])
                             + (0.5 if rng.random() < 0.1 else 0.0),
                             rng.choice([-1, 0, 3, 8, 64, 64])) for m in members]
        rng.shuffle(views)
        matches = {p: rng.choice([0, max(mp - 1, 0), mp, mp + 16, 64, 512, 512])
                   for p in pool if rng.random() < 0.4}
        key = rng.choice(keys) if rng.random() < 0.9 else f"fresh-{rng.random()}"
        exclude = (frozenset(rng.sample(pool, rng.randint(1, max(1, len(pool) // 2))))
                   if rng.random() < 0.2 else frozenset())
        new_blocks = rng.choice([None, None, 0, 3, 8, 64])
        continues = rng.random() < 0.3
        record = rng.random() < 0.85
        live = [v.replica_id for v in views if v.replica_id not in exclude]
        busy = [frozenset()] if continues else model.busy_sets(clock.t, live)
        # The same request with the replicas listed in another order, not counted: the same
        # answer (ties go by a per-key hash, not list order) and no trace in the counts.
        shuffled = list(reversed(views))
        probe = policy.choose(shuffled, matches, key, exclude, new_blocks, continues,
                              record=False)
        got = policy.choose(views, matches, key, exclude, new_blocks, continues, record=record)
        # Unless a share sits on its boundary: the counts are then summed in list order, and
        # the last bit of the sum may decide (seed 330: one of four at exactly (1 + 1) / 4).
        assert got == probe or busy is None or len(busy) > 1, (seed, got, probe)
        if live:
            model.ring = {v.replica_id for v in views}
        ring_points_ok(policy, model.ring, cfg["vnodes"])
        if not live:
            assert got is None, (seed, got)
            stats["none"] += 1
            continue
        assert got is not None
        if busy is None:
            stats["skipped"] += 1
        else:
            ok: set[tuple[str, str]] = set()
            tied_sets = []
            for b in busy:
                allowed, tied = model.answers(views, matches, key, exclude, new_blocks, b)
                ok |= allowed
                if tied is not None:
                    tied_sets.append(tied)
            assert probe is not None and (probe.replica_id, probe.route) in ok, (seed, probe)
            assert (got.replica_id, got.route) in ok, (
                seed, got, sorted(ok), cfg, eps, views, matches, key, exclude, new_blocks,
                continues, busy)
            if len(busy) > 1:
                stats["ambiguous"] += 1
            if len(busy) == 1 and tied_sets:
                model.check_tie(key, tied_sets[0], got.replica_id)
                stats["ties"] += 1
        assert got.matched_tokens == matches.get(got.replica_id, 0)
        stats[got.route] += 1
        if record:
            model.record(clock.t, got.replica_id)
    return stats


@pytest.mark.parametrize("first", range(0, SEEDS, 8))
def test_routing_matches_the_model(first):
    totals: dict[str, int] = {}
    for seed in range(first, min(first + 8, SEEDS)):
        for k, v in run_seed(seed).items():
            totals[k] = totals.get(k, 0) + v
    # The runs reach both routes, ties and empty answers, and rarely give up on a step.
    assert totals["prefix"] and totals["ring"] and totals["none"] and totals["ties"]
    assert totals["skipped"] <= totals["prefix"] // 50


def test_round_robin_matches_the_model():
    """Round robin: the live replicas sorted by id, a turn counter advanced by recorded
    choices only."""
    rng = random.Random(5)
    p, turn = RoundRobinPolicy(), 0
    for _ in range(2000):
        views = [ReplicaView(r, 0.0) for r in rng.sample(POOL, rng.randint(0, 4))]
        exclude = frozenset(rng.sample(POOL, rng.randint(0, 2)))
        record = rng.random() < 0.7
        live = sorted(v.replica_id for v in views if v.replica_id not in exclude)
        got = p.choose(views, {"r0": 7}, "k", exclude, record=record)
        if not live:
            assert got is None
            continue
        want = live[turn % len(live)]
        assert got == (want, "round_robin", 7 if want == "r0" else 0)
        turn += record
