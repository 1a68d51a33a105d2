"""A differential review of the shard-list checks (services/common/shard_list.py,
services/prefix/shard_list.py, services/semantic/shard_list.py): seeded random sequences of
(caller, its shard list, time) events against a model of the documented rules, every answer
compared after every event.

The model is written from docs/reliability.md ("Known gaps", items 60-61), docs/deploy.md and
the modules' docstrings. A list is a set of shards, each spelled in one of several ways that
name it (`Prefix-0.prefix.:50053`, `dns:///prefix-0.prefix:050053`, `ipv4:`, IPv6 spellings)
beside names that are other shards to placement (`localhost` / `127.0.0.1`, `prefix-0` /
`prefix-0.prefix`); the model knows which shard each spelling is from its own table, not from
`canonical_address`, and sends what a caller sends (size, `shard_fingerprint`). Two lists
differ when their shards differ and either has more than one. Raw lists (a size and a
fingerprint as sent) add not-said fingerprints (""), overlong ones (cut to 64 characters)
and sizes that disagree. The rules modelled:

- prefix: a Match is compared with the lists of the replicas it names that registered one;
  naming none, with every registered list (a mismatch only when none agrees); a replica
  registering without a list, or forgotten (lease lapsed), no longer counts; at most
  MAX_REMEMBERED replicas' lists, the one registered first dropped first;
- semantic: a call is compared with every list last seen within WINDOW_SECONDS before it
  (inclusive), each list remembered from its last call, at most MAX_LISTS lists (the least
  recently seen dropped); the report names the latest list that differs and its caller;
- both: a mismatch is counted (`mismatches_total` and the tier's Prometheus counter), warned
  at most once a minute (the first at once, the next one WARN_EVERY_SECONDS or more after the
  last warning, saying how many since), and Stats' note gives the last mismatch, how long
  ago, and the total, for SHOWN_SECONDS after it (inclusive; the docs say "for 5 minutes").

Where the docs are silent the model asserts only an invariant: which replica a prefix
mismatch names (one of those whose list differs: a named one when the Match named any).
A third test drives a real PrefixServicer (Register with and without a list, for the Match's
model or another, Matches naming the replicas the index answers with, leases lapsing on a fake
clock) against the same model.

Run: 3,000 seeds of each sequence (80 events; MAX_REMEMBERED / MAX_LISTS cut to 3 on half of
them) and 600 of the servicer's (40 events). Found: no divergence. Injected bugs, seeds failing
of 300 (servicer: of 60): the note shown until 300 s exclusive 78 prefix + 134 semantic; a
warning only past 60 s 51 + 77 + 5; a Match naming nobody mismatching when any list differs
296; the newest replica's list dropped at the bound 276; the semantic window exclusive 108; the
oldest differing list named 293; a semantic fingerprint not cut 111; the servicer keeping a
lapsed replica's list 10 of 60, not passing Register's list 59 of 60.
By default 150 seeds (50 for the servicer), ~3 s. More:
SHARD_LIST_DIFF_SEEDS=3000 pytest tests/test_shard_list_differential.py
"""

from __future__ import annotations

import logging
import os
import random
from collections import OrderedDict

import pytest
from tiercache.v1 import common_pb2, prefix_pb2

from services.common import shard_list as common
from services.common.addresses import canonical_address, shard_fingerprint
from services.prefix import shard_list as prefix_mod
from services.semantic import shard_list as semantic_mod
from tests.clock import Clock

SEEDS = int(os.environ.get("SHARD_LIST_DIFF_SEEDS", "150"))

# Shard -> its spellings (the model's own table: each row is one shard to placement).
SHARDS = {
    "p0": ["prefix-0.prefix:50053", " Prefix-0.prefix.:50053", "dns:///PREFIX-0.prefix:050053",
           "dns:prefix-0.PREFIX:50053"],
    "p0short": ["prefix-0:50053", "PREFIX-0:50053"],  # another name for p0's host: another shard
    "lh": ["localhost:50053", "LocalHost.:50053"],
    "lo": ["127.0.0.1:50053", "ipv4:127.0.0.1:50053", "127.0.0.1:0050053"],
    "v6": ["[::1]:9000", "[0:0:0:0:0:0:0:1]:9000", "ipv6:[::1]:9000"],
}
NAMES = list(SHARDS)
WINDOW = 300.0  # the docs' "5 minutes", for the note and the semantic window
WARN_EVERY = 60.0
STEPS = [0, 0, 0.4, 0.5, 1, 1.5, 30, 59, 59.5, 60, 61, 120, 299, 300, 300.5, 301, 600]


def test_the_spellings_fold_as_the_table_says():
    assert common.SHOWN_SECONDS == semantic_mod.WINDOW_SECONDS == WINDOW
    assert common.WARN_EVERY_SECONDS == WARN_EVERY
    for name, spellings in SHARDS.items():
        assert len({canonical_address(s) for s in spellings}) == 1, name
    assert len({canonical_address(s[0]) for s in SHARDS.values()}) == len(SHARDS)


def _shown(shards: int, fp: str) -> str:
    return f"{shards} shard{'' if shards == 1 else 's'} ({fp[:64]})"


class Sent:
    """A list as a caller sends it, with the model's identity for it."""

    def __init__(self, shards: int, fp: str, key) -> None:
        self.shards, self.fp, self.key = shards, fp, key

    def differs(self, other: Sent) -> bool:
        return self.key != other.key and max(self.shards, other.shards) > 1

    def __str__(self) -> str:
        return _shown(self.shards, self.fp)


def random_list(rng: random.Random) -> Sent:
    r = rng.random()
    if r < 0.08:
        return Sent(rng.choice([0, 1, 2, 3]), "", None)  # not said
    if r < 0.18:  # raw: as a caller might send it (cut to 64 characters)
        fp = rng.choice(["aaaa", "bbbb", "a" * 64, "a" * 64 + "x", "a" * 64 + "yy", "c" * 70])
        return Sent(rng.choice([0, 1, 2, 3]), fp, ("raw", fp[:64]))
    k = rng.choice([1, 1, 2, 2, 2, 3, 4])
    names = rng.sample(NAMES, k)
    spelled = [rng.choice(SHARDS[n]) for n in names]
    return Sent(len(spelled), shard_fingerprint(spelled), frozenset(names))


class Report:
    """The shared MismatchReport as the docs describe it."""

    def __init__(self, clock: Clock, between: str, calls: tuple[str, str]) -> None:
        self.clock, self.between, self.calls = clock, between, calls
        self.total = 0
        self.last: tuple[float, set[str]] | None = None  # when, the texts it may say
        self.warned_at: float | None = None
        self.unwarned = 0
        self.warnings: list[tuple[set[str], int]] = []

    def record(self, whats: set[str]) -> None:
        now = self.clock()
        self.total += 1
        self.unwarned += 1
        self.last = (now, whats)
        if self.warned_at is None or now - self.warned_at >= WARN_EVERY:
            self.warnings.append((whats, self.unwarned))
            self.warned_at, self.unwarned = now, 0

    def notes(self) -> set[str]:
        if self.last is None or self.clock() - self.last[0] > WINDOW:
            return {""}
        ago = f"{self.clock() - self.last[0]:.0f}"
        said = self.calls[0] if self.total == 1 else self.calls[1]
        return {f"shard list differs between {self.between}: {w} {ago} s ago ({self.total} "
                f"such {said} in all)" for w in self.last[1]}


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


@pytest.fixture
def warnings():
    h = Warnings()
    loggers = [logging.getLogger(m.__name__) for m in (prefix_mod, semantic_mod)]
    for lg in loggers:
        lg.addHandler(h)
    yield h
    for lg in loggers:
        lg.removeHandler(h)


def _metric(tier: str) -> float:
    """The tier's counter, read from its own collector: the whole registry's collect took
    seconds per read once earlier tests had left many series (0.9 s → 24 s for this file)."""
    counter = (prefix_mod if tier == "prefix" else semantic_mod).MISMATCHES
    return sum(s.value for m in counter.collect() for s in m.samples
               if s.name == f"tiercache_{tier}_shard_list_mismatches_total")


def _compare_report(real, model: Report, warnings: Warnings, tier: str, metric0: float,
                    where: str) -> None:
    assert real.mismatches_total == model.total, where
    assert _metric(tier) - metric0 == model.total, where
    assert real.note() in model.notes(), where
    assert len(warnings.records) == len(model.warnings), where
    if model.warnings:
        msg, (whats, n) = warnings.records[-1], model.warnings[-1]
        said = model.calls[0] if n == 1 else model.calls[1]
        assert any(msg.startswith(f"{tier} shard lists differ: {w} ({n} such {said} "
                                  "since the last warning); ") for w in whats), (where, msg)


# -- prefix: replicas' lists against Matches' ---------------------------------------------------


class PrefixModel:
    def __init__(self, clock: Clock, max_remembered: int) -> None:
        self.regs: OrderedDict[str, Sent] = OrderedDict()  # in the order registered
        self.max = max_remembered
        self.report = Report(clock, "replicas and orchestrator", ("Match", "Matches"))

    def registered(self, rid: str, sent: Sent) -> None:
        self.regs.pop(rid, None)
        if sent.fp:
            self.regs[rid] = sent
            while len(self.regs) > self.max:
                self.regs.popitem(last=False)

    def forget(self, rid: str) -> None:
        self.regs.pop(rid, None)

    def check(self, sent: Sent, named: list[str]) -> bool:
        if not sent.fp or not self.regs:
            return True
        named_here = [r for r in named if r in self.regs]
        pool = named_here if named_here else list(self.regs)
        bad = [r for r in pool if self.regs[r].differs(sent)]
        if (bad and named_here) or (not named_here and len(bad) == len(pool)):
            self.report.record({f"replica {r} registered with {self.regs[r]}, a Match came "
                                f"with {sent}" for r in bad})
            return False
        return True


RIDS = ["r0", "r1", "r2", "r3", "r4"]


def run_prefix(seed: int, warnings: Warnings, monkeypatch, steps: int = 80) -> None:
    rng = random.Random(seed)
    cap = rng.choice([3, prefix_mod.MAX_REMEMBERED])
    monkeypatch.setattr(prefix_mod, "MAX_REMEMBERED", cap)
    clock = Clock(rng.choice([0.0, 1000.0]))
    real = prefix_mod.ShardListCheck(clock)
    model = PrefixModel(clock, cap)
    warnings.records.clear()
    metric0 = _metric("prefix")
    rollout = [random_list(rng) for _ in range(2)]  # the lists in use: two mid-rollout
    for i in range(steps):
        where = f"seed {seed} step {i}"
        op = rng.random()
        if rng.random() < 0.1:
            rollout[rng.randrange(2)] = random_list(rng)  # a list changes
        if op < 0.3:
            rid = rng.choice(RIDS)
            sent = rng.choice(rollout) if rng.random() < 0.85 else random_list(rng)
            real.registered(rid, sent.shards, sent.fp)
            model.registered(rid, sent)
        elif op < 0.38:
            rid = rng.choice(RIDS)
            real.forget(rid)
            model.forget(rid)
        elif op < 0.88:
            sent = rng.choice(rollout) if rng.random() < 0.85 else random_list(rng)
            named = rng.sample(RIDS + ["ghost"], rng.choice([0, 0, 1, 1, 2, 3]))
            assert real.check(sent.shards, sent.fp, iter(named)) == model.check(sent, named), \
                where
        else:
            clock.t += rng.choice(STEPS)
        _compare_report(real, model.report, warnings, "prefix", metric0, where)


def test_prefix_check_against_the_model(warnings, monkeypatch):
    for seed in range(SEEDS):
        run_prefix(seed, warnings, monkeypatch)


# -- semantic: orchestrators' lists against each other ------------------------------------------


class SemanticModel:
    def __init__(self, clock: Clock, max_lists: int) -> None:
        self.clock = clock
        self.seen: list[tuple[Sent, float, str]] = []  # each list's last call, oldest first
        self.max = max_lists
        self.report = Report(clock, "orchestrators", ("call", "calls"))

    def check(self, sent: Sent, method: str, caller: str) -> bool:
        if not sent.fp:
            return True
        now = self.clock()
        self.seen = [s for s in self.seen if now - s[1] <= WINDOW]
        differing = [s for s in self.seen if s[0].differs(sent)]
        self.seen = [s for s in self.seen if s[0].key != sent.key] + [(sent, now, caller)]
        self.seen = self.seen[-self.max:]
        if not differing:
            return True
        theirs, _, their_caller = differing[-1]  # the latest that differs
        frm = f" from {their_caller}" if their_caller else ""
        me = f" from {caller}" if caller else ""
        self.report.record({f"a call came with {theirs}{frm}, a {method} with {sent}{me}"})
        return False


CALLERS = ["ipv4:10.0.0.1:4000", "ipv4:10.0.0.2:4100", "ipv6:[::1]:4200", ""]


def run_semantic(seed: int, warnings: Warnings, monkeypatch, steps: int = 80) -> None:
    rng = random.Random(seed)
    cap = rng.choice([3, semantic_mod.MAX_LISTS])
    monkeypatch.setattr(semantic_mod, "MAX_LISTS", cap)
    clock = Clock(rng.choice([0.0, 1000.0]))
    real = semantic_mod.RecentShardLists(clock)
    model = SemanticModel(clock, cap)
    warnings.records.clear()
    metric0 = _metric("semantic")
    lists = {c: random_list(rng) for c in CALLERS}  # each orchestrator's list
    if rng.random() < 0.5:  # most deployments agree but for one
        common_list = random_list(rng)
        lists.update({c: common_list for c in CALLERS[1:]})
    active = list(CALLERS)
    for i in range(steps):
        where = f"seed {seed} step {i}"
        op = rng.random()
        if op < 0.08:
            c = rng.choice(CALLERS)
            lists[c] = random_list(rng) if rng.random() < 0.5 else lists[rng.choice(CALLERS)]
        elif op < 0.12:  # a caller goes quiet, or comes back
            c = rng.choice(CALLERS)
            active = [a for a in active if a != c] if c in active else active + [c]
        elif op < 0.8 and active:
            c = rng.choice(active)
            sent = lists[c] if rng.random() < 0.9 else random_list(rng)
            method = rng.choice(["Lookup", "Store"])
            assert (real.check(sent.shards, sent.fp, method, c)
                    == model.check(sent, method, c)), where
        else:
            clock.t += rng.choice(STEPS)
        _compare_report(real, model.report, warnings, "semantic", metric0, where)


def test_semantic_check_against_the_model(warnings, monkeypatch):
    for seed in range(SEEDS):
        run_semantic(seed, warnings, monkeypatch)


# -- prefix, through the servicer: Register, lapsed leases, Matches ----------------------------


def run_servicer(seed: int, warnings: Warnings, steps: int = 40) -> None:
    from services.prefix.server import PrefixServicer
    from tests.prefix.conftest import BS, MODEL, make_index

    rng = random.Random(seed)
    clock = Clock()
    index = make_index(clock, lease_seconds=10.0)
    s = PrefixServicer(index)
    model = PrefixModel(clock, prefix_mod.MAX_REMEMBERED)
    warnings.records.clear()
    metric0 = _metric("prefix")
    rollout = [random_list(rng) for _ in range(2)]
    for i in range(steps):
        where = f"seed {seed} step {i}"
        op = rng.random()
        if op < 0.35:
            rid = rng.choice(RIDS[:3])
            sent = rng.choice(rollout) if rng.random() < 0.8 else random_list(rng)
            s.Register(prefix_pb2.RegisterRequest(
                replica_id=rid, incarnation="i1", address=f"{rid}:1",
                model_id=rng.choice([MODEL, "other"]), block_size=BS, capacity_blocks=10,
                shard_list=common_pb2.ShardList(shards=sent.shards, fingerprint=sent.fp)),
                None)
            model.registered(rid, sent)
        elif op < 0.75:
            sent = rng.choice(rollout) if rng.random() < 0.8 else random_list(rng)
            r = s.Match(prefix_pb2.MatchRequest(
                model_id=MODEL, token_ids=list(range(2 * BS)),
                shard_list=common_pb2.ShardList(shards=sent.shards, fingerprint=sent.fp)), None)
            # The lists of lapsed replicas are forgotten (the Match may have found the lapse).
            live = {x.replica_id for x in index.stats().replicas}
            for rid in [x for x in model.regs if x not in live]:
                model.forget(rid)
            model.check(sent, [m.replica_id for m in r.matches])
        elif op < 0.85:
            for rid in index.sweep():
                model.forget(rid)
        else:
            clock.t += rng.choice([1, 4, 9, 10, 11, 30])
            if rng.random() < 0.5:
                for rid in index.sweep():
                    model.forget(rid)
        _compare_report(s.shard_lists, model.report, warnings, "prefix", metric0, where)
        assert s.Stats(prefix_pb2.PrefixStatsRequest(), None).shard_list_mismatch in (
            model.report.notes()), where


def test_prefix_servicer_against_the_model(warnings):
    for seed in range(max(1, SEEDS // 3)):
        run_servicer(seed, warnings)
