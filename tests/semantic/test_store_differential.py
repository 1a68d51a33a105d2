"""A differential review of EntryStore (store.py) on real SQLite: seeded random calls of its
whole API against a brute-force model, the committed table compared after every step.

The model is a dict of rows keyed by label (every column), the highest label ever given, and
the buffer of hit counters, each call written from its docstring: `insert` one autocommitted
row whose label is above every label given before (reopens included, the newest deleted
first), an id taken refused with nothing written; `insert_many` one transaction; `get`,
`iter_all` (label order, batches of at most `batch`), `count`, `labels_issued` (the highest
label ever given); `set_verified` and `clamp_future` (created_at and last_hit_at each lowered to
`now`, the rows either was ahead counted) autocommitted; `cap_ttls` (TTLs over the cap, and
with `never` those <= 0, set to it; the matching rows walked by label `WRITE_CHUNK` to a
transaction, ending at the first chunk short of it), `set_embeddings` and `delete`
`WRITE_CHUNK` rows (labels) to a transaction, a failure keeping the chunks before it, and
`delete`'s `committed` extended by exactly the chunks committed (never by the one that
failed), their buffered hits dropped; `record_hit` buffers the latest counter per label,
`flush_hits` writes them in one transaction never lowering a row's values, returns the rows
it updated, and keeps them buffered when it fails; `close` flushes them (a flush failing there
loses them and still closes). WRITE_CHUNK is 1-7 per seed (monkeypatched) so that chunks and
their boundaries are reached in every run.

Faults are injected at the code's seams, planned by the model: temp triggers that raise
(RAISE ABORT / FAIL / ROLLBACK: inside SQLite, part-way through a statement or a chunk) on the
n-th row a call inserts, updates or deletes, and a wrapper around the connection failing the
k-th BEGIN, COMMIT or write statement ("disk I/O error", or "database or disk is full", which
must surface as ResourceExhausted where the docstring promises it). The model predicts
whether the call fails and exactly what stays written. After every step the table another
connection sees (committed rows only) must equal the model's, as must count(),
labels_issued() and the hit buffer, and no transaction may be left open; the store is closed
and reopened every ~15 steps. Ids, texts (empty, non-ASCII, NUL, long), times and TTLs come
from small sets so repeats, ties at the clamp and cap boundaries and taken ids are frequent.

A second test runs a writer process (synchronous=FULL, WRITE_CHUNK 2) inserting and deleting,
kills it with SIGKILL at a random point and reopens: every acknowledged insert is there unless
an acknowledged delete, or the delete under way, took it; no acknowledged delete's row is
there; a new label is above every one given.

Run: 3,000 seeds of 150 steps, 400 of 600 steps and 600 kill -9 runs; one divergence, a
real defect, fixed in its own commit (test_store_rules.py guards it): `flush_hits` returned
how many counters it held, not "how many rows were updated" as its docstring says (a hit
recorded for an entry deleted meanwhile counted). Nothing reads the count yet.

Injected bugs, seeds failing of 200: `committed` extended before the chunk's COMMIT 110;
hit_count written without MAX 102; a delete dropping its chunk's buffered hits before the
chunk commits 60; no ROLLBACK after a failed transaction 196; clamp_future leaving
last_hit_at 139; `never` capping only TTLs < 0 170; TTLs equal to the cap counted as over it
199; labels_issued as the highest label held 200; cap_ttls walking on past a short chunk 11
(only a COMMIT fault in the extra transaction shows it); inserts committed four at a time
200, and 1 of 20 in the kill -9 test (the writer is mostly inside a delete's fsyncs when
killed). Not caught, and equivalent: cap_ttls's WHERE without parentheses around `never`'s
OR (the rows it would take again were capped by earlier chunks and match no more).

`STORE_DIFFERENTIAL_SEEDS=N` runs N seeds of the first test (default 64, ~4 s in all):
`STORE_DIFFERENTIAL_SEEDS=3000 pytest tests/semantic/test_store_differential.py -k model`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

import services.semantic.store as store_mod
from services.common.errors import ResourceExhausted
from services.semantic.store import EntryStore, pack_tokens

SEEDS = int(os.environ.get("STORE_DIFFERENTIAL_SEEDS", "64"))

STAMPS = (0.0, 1.0, 5.5, 100.0, 100.5, 1e9)  # creation, hit and clamp times: ties are common
TTLS = (-5, 0, 1, 9, 10, 11, 100, 1000)
CAPS = (1, 10, 100)
TEXTS = ("", "q", "q", "é ☃", "a\x00b", "x" * 300)

# Column order of a row as compared: label, id, tenant, model_id, context_hash, prompt, answer,
# embedding bytes, embed_model, verified, created_at, last_hit_at, hit_count, ttl_seconds,
# truncated, answer_tokens.
L, ID, EMB, EMB_MODEL, VERIFIED, CREATED, LAST_HIT, HITS, TTL = 0, 1, 7, 8, 9, 10, 11, 12, 13


def committed_rows(path: str) -> dict[int, tuple]:
    """What a second connection sees: only committed rows."""
    with contextlib.closing(sqlite3.connect(path)) as db:
        return {t[0]: (*t[:7], bytes(t[7]), t[8], bool(t[9]), *t[10:15], bytes(t[15]))
                for t in db.execute(f"SELECT {store_mod._COLS} FROM entries")}


def as_tuple(r: store_mod.Row) -> tuple:
    return (r.label, r.id, r.tenant, r.model_id, r.context_hash, r.prompt, r.answer,
            np.asarray(r.embedding, "<f4").tobytes(), r.embed_model, r.verified, r.created_at,
            r.last_hit_at, r.hit_count, r.ttl_seconds, r.truncated, r.answer_tokens)


# --- faults ------------------------------------------------------------------------------------


@dataclass
class Fault:
    """Where the next call fails: on the n-th row a trigger sees for `word` (INSERT, UPDATE,
    DELETE), raising with `how` (ABORT, FAIL, ROLLBACK: inside SQLite, mid-statement), or on the
    n-th statement starting with `word` (BEGIN, COMMIT, or the write itself) passed to the
    connection, which raises `message` instead of running it."""

    kind: str  # "row" | "stmt"
    word: str
    n: int
    how: str = "ABORT"
    message: str = "disk I/O error"


class Faults:
    """The seams of one open store: temp triggers calling back into Python, and a wrapper
    around its connection."""

    def __init__(self) -> None:
        self.armed: Fault | None = None
        self.fired: Fault | None = None  # the statement fault that fired
        self.seen = 0

    def arm(self, f: Fault | None) -> None:
        self.armed, self.seen, self.fired = f, 0, None

    def _boom(self, word: str, how: str) -> int:
        f = self.armed
        if f is None or f.kind != "row" or f.word != word or f.how != how:
            return 0
        self.seen += 1
        if self.seen == f.n:
            self.armed = None
            return 1
        return 0

    def statement(self, sql: str) -> None:
        f = self.armed
        if f is None or f.kind != "stmt" or sql.split(None, 1)[0].upper() != f.word:
            return
        self.seen += 1
        if self.seen == f.n:
            self.armed, self.fired = None, f
            raise sqlite3.OperationalError(f.message)

    def install(self, st: EntryStore) -> None:
        real = st._db
        real.create_function("tc_boom", 2, self._boom)
        for word in ("INSERT", "UPDATE", "DELETE"):
            for how in ("ABORT", "FAIL", "ROLLBACK"):
                real.execute(f"CREATE TEMP TRIGGER tc_{word}_{how} BEFORE {word} ON main.entries "
                             f"WHEN tc_boom('{word}', '{how}') "
                             f"BEGIN SELECT RAISE({how}, 'injected'); END")
        st._db = Conn(real, self)


class Conn:
    def __init__(self, db: sqlite3.Connection, faults: Faults) -> None:
        self.db, self.faults = db, faults

    def execute(self, sql: str, *args):
        self.faults.statement(sql)
        return self.db.execute(sql, *args)

    def executemany(self, sql: str, *args):
        self.faults.statement(sql)
        return self.db.executemany(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self.db, name)


# --- the model ---------------------------------------------------------------------------------


ANY = object()  # an answer the model does not know (a new label: checked by the caller)


class Failed(Exception):
    """The model's answer: the call raises (the transactions before it stay written)."""


@dataclass
class Txn:
    """One transaction as the docstrings describe the call's writes: the write statements it
    runs (word, rows each touches) and what it changes once committed. `explicit`: BEGIN ...
    COMMIT; else one autocommitted statement."""

    writes: list[tuple[str, int]]
    apply: Callable[[], None]
    explicit: bool = True


@dataclass
class Model:
    chunk: int
    rows: dict[int, tuple] = field(default_factory=dict)
    issued: int = 0  # the highest label ever given
    pending: dict[int, tuple[float, int]] = field(default_factory=dict)

    def run(self, txns: list[Txn], fault: Fault | None) -> None:
        """Applies `txns` in order up to the one `fault` hits; raises Failed there."""
        seen = 0

        def stmt(word: str) -> bool:
            nonlocal seen
            if fault and fault.kind == "stmt" and fault.word == word:
                seen += 1
                return seen == fault.n
            return False

        for t in txns:
            if t.explicit and stmt("BEGIN"):
                raise Failed
            for word, n_rows in t.writes:
                if stmt(word):
                    raise Failed
                if fault and fault.kind == "row" and fault.word == word:
                    seen += n_rows
                    if seen >= fault.n:
                        raise Failed
            if t.explicit and stmt("COMMIT"):
                raise Failed
            t.apply()

    def set_field(self, label: int, col: int, value) -> None:
        r = list(self.rows[label])
        r[col] = value
        self.rows[label] = tuple(r)

    # Each call as its docstring gives it: the transactions it runs, in order.

    def insert(self, row: tuple, fault: Fault | None) -> object:
        """One autocommitted INSERT; the label is checked by the caller."""
        dup = any(r[ID] == row[ID] for r in self.rows.values())
        self.run([Txn([("INSERT", 1)], lambda: None, explicit=False)], fault)
        if dup:
            raise Failed  # id is UNIQUE: nothing written
        return ANY

    def insert_many(self, n: int, dup_at: int | None, fault: Fault | None) -> None:
        """One transaction; a repeated id fails it whole (the trigger sees rows up to it)."""
        self.run([Txn([("INSERT", n if dup_at is None else dup_at + 1)], lambda: None)], fault)
        if dup_at is not None:
            raise Failed

    def set_verified(self, label: int, v: bool, fault: Fault | None) -> None:
        hit = label in self.rows
        self.run([Txn([("UPDATE", int(hit))],
                      lambda: hit and self.set_field(label, VERIFIED, v), explicit=False)], fault)

    def clamp_future(self, now: float, fault: Fault | None) -> int:
        ahead = [lab for lab, r in self.rows.items() if r[CREATED] > now or r[LAST_HIT] > now]

        def apply() -> None:
            for lab in ahead:
                self.set_field(lab, CREATED, min(self.rows[lab][CREATED], now))
                self.set_field(lab, LAST_HIT, min(self.rows[lab][LAST_HIT], now))

        self.run([Txn([("UPDATE", len(ahead))], apply, explicit=False)], fault)
        return len(ahead)

    def cap_ttls(self, cap: int, never: bool, fault: Fault | None) -> int:
        """Matching rows by label, `chunk` per transaction; the walk ends at the first chunk
        short of `chunk` (an empty one when the count is a multiple of it)."""
        match = sorted(lab for lab, r in self.rows.items()
                       if r[TTL] > cap or (never and r[TTL] <= 0))
        txns = []
        for i in range(0, len(match) + 1, self.chunk):
            part = match[i:i + self.chunk]

            def apply(part=part) -> None:
                for lab in part:
                    self.set_field(lab, TTL, cap)

            txns.append(Txn([("UPDATE", len(part))] if part else [], apply))
            if len(part) < self.chunk:
                break
        self.run(txns, fault)
        return len(match)

    def set_embeddings(self, rows: list[tuple[int, bytes, str]], fault: Fault | None) -> None:
        txns = []
        for i in range(0, len(rows), self.chunk):
            part = rows[i:i + self.chunk]

            def apply(part=part) -> None:
                for lab, blob, model in part:
                    if lab in self.rows:
                        self.set_field(lab, EMB, blob)
                        self.set_field(lab, EMB_MODEL, model)

            txns.append(Txn([("UPDATE", sum(lab in self.rows for lab, _, _ in part))], apply))
        self.run(txns, fault)

    def delete(self, labels: list[int], committed: list[int], fault: Fault | None) -> None:
        """`chunk` labels per transaction; `committed` extended by each chunk once it is gone,
        and that chunk's buffered hits dropped."""
        txns, live = [], set(self.rows)
        for i in range(0, len(labels), self.chunk):
            part = labels[i:i + self.chunk]
            touched = 0
            for lab in part:  # a label repeated is gone by its second time
                touched += lab in live
                live.discard(lab)

            def apply(part=part) -> None:
                for lab in part:
                    self.rows.pop(lab, None)
                    self.pending.pop(lab, None)
                committed.extend(part)

            txns.append(Txn([("DELETE", touched)], apply))
        self.run(txns, fault)

    def record_hit(self, label: int, at: float, n: int) -> None:
        self.pending[label] = (at, n)

    def flush_hits(self, fault: Fault | None) -> int:
        """One transaction; counters never lowered; a failure keeps them buffered."""
        if not self.pending:
            return 0
        pending = dict(self.pending)

        def apply() -> None:
            self.pending.clear()
            for lab, (at, n) in pending.items():
                if lab in self.rows:
                    self.set_field(lab, LAST_HIT, max(self.rows[lab][LAST_HIT], at))
                    self.set_field(lab, HITS, max(self.rows[lab][HITS], n))

        updated = sum(lab in self.rows for lab in pending)
        self.run([Txn([("UPDATE", updated)], apply)], fault)
        return updated


# --- the run -----------------------------------------------------------------------------------


@dataclass
class Tally:
    steps: int = 0
    failures: int = 0
    reopens: int = 0
    ops: dict[str, int] = field(default_factory=dict)


class Run:
    def __init__(self, seed: int, folder: str) -> None:
        self.rng = np.random.default_rng(seed)
        self.path = os.path.join(folder, f"s{seed}.db")
        self.m = Model(chunk=int(self.rng.choice([1, 2, 3, 4, 7])))
        self.sync = str(self.rng.choice(["OFF", "NORMAL", "FULL"], p=[0.6, 0.3, 0.1]))
        self.next_id = 0
        self.t = Tally()
        self.open()

    def open(self) -> None:
        self.st = EntryStore(self.path, self.sync)
        self.faults = Faults()
        self.faults.install(self.st)

    def reopen(self, lose_hits: bool) -> None:
        if lose_hits:  # the flush at close fails: it closes anyway, those hits are lost
            self.faults.arm(Fault("stmt", "BEGIN", 1))
            self.m.pending.clear()
        else:
            self.m.flush_hits(None)
        self.st.close()
        self.st.close()  # idempotent
        self.t.reopens += 1
        self.open()

    # random draws

    def pick(self, a) -> object:
        return a[int(self.rng.integers(len(a)))]

    def label(self) -> int:
        live = sorted(self.m.rows)
        r = self.rng.random()
        if live and r < 0.7:
            return self.pick(live)
        if r < 0.85 and self.m.issued:
            return int(self.rng.integers(1, self.m.issued + 1))  # often one deleted
        return self.m.issued + int(self.rng.integers(1, 3))  # not given yet

    def new_row(self, eid: str | None = None) -> dict:
        if eid is None:
            if self.m.rows and self.rng.random() < 0.08:
                eid = self.m.rows[self.pick(sorted(self.m.rows))][ID]  # taken: refused
            else:
                eid, self.next_id = f"e{self.next_id}", self.next_id + 1
        toks = [int(x) for x in self.rng.integers(0, self.pick([50, 70000]),
                                                  int(self.rng.integers(0, 4)))]
        return dict(id=eid, tenant=self.pick(("t", "u")), model_id=self.pick(TEXTS),
                    context_hash=self.pick(TEXTS), prompt=self.pick(TEXTS),
                    answer=self.pick(TEXTS), embedding=self.rng.standard_normal(4).astype("<f4"),
                    embed_model=self.pick(("e", "f")), verified=bool(self.rng.random() < 0.3),
                    created_at=self.pick(STAMPS), ttl_seconds=self.pick(TTLS),
                    truncated=int(self.pick((0, 0, 1, 16))), answer_tokens=pack_tokens(toks))

    def fault(self, words: tuple[str, ...], hows=("ABORT", "FAIL", "ROLLBACK")) -> Fault | None:
        if self.rng.random() > 0.3:
            return None
        word = self.pick(words)
        n = int(self.rng.integers(1, 3 * self.m.chunk + 2))
        if word in ("INSERT", "UPDATE", "DELETE") and self.rng.random() < 0.7:
            return Fault("row", word, n, how=self.pick(hows))
        msg = self.pick(("disk I/O error", "database or disk is full"))
        return Fault("stmt", word, int(self.rng.integers(1, 4)), message=msg)

    # one step

    def call(self, name: str, real: Callable, model: Callable, fault: Fault | None,
             exhausted: bool = False):
        """Runs the call on both; they must agree on failing, and on the answer."""
        self.t.ops[name] = self.t.ops.get(name, 0) + 1
        self.faults.arm(fault)
        try:
            want = model()
        except Failed:
            want = Failed
        try:
            got = real()
        except (sqlite3.Error, ResourceExhausted) as e:
            got = Failed
            self.t.failures += 1
            if exhausted and self.faults.fired and "full" in fault.message:
                assert isinstance(e, ResourceExhausted), (name, fault, e)
        finally:
            self.faults.armed = None
        if want is ANY:
            assert got is not Failed, (name, fault)
        else:
            assert got == want, (name, fault, got, want)
        assert not self.st._db.in_transaction, name  # a failure left no transaction open
        return got

    def step(self) -> None:
        m, st, rng = self.m, self.st, self.rng
        op = self.pick(("insert",) * 6 + ("insert_many", "get", "verify", "verify") +
                       ("hit",) * 4 + ("flush", "flush", "delete", "delete", "delete",
                                       "cap", "cap", "clamp", "embed", "iter", "reopen", "reopen"))
        if op == "insert":
            d = self.new_row()
            row = self.row_of(d)
            f = self.fault(("INSERT",), hows=("ABORT", "FAIL", "ROLLBACK"))
            before = m.issued
            lab = self.call(op, lambda: st.insert(**d), lambda: m.insert(row, f), f,
                            exhausted=True)
            if lab is not Failed:
                assert isinstance(lab, int) and lab > before, (lab, before)  # never reused
                m.rows[lab] = (lab, *row[1:])
                m.issued = lab
        elif op == "insert_many":
            n = int(rng.integers(0, 2 * m.chunk + 2))
            ds = [self.new_row(f"e{self.next_id + i}") for i in range(n)]
            self.next_id += n
            dup_at = None
            if n and rng.random() < 0.2:
                j = int(rng.integers(n))
                taken = [r[ID] for r in m.rows.values()] + [d["id"] for d in ds[:j]]
                if taken:
                    ds[j]["id"], dup_at = self.pick(taken), j
            f = self.fault(("INSERT", "BEGIN", "COMMIT"))
            got = self.call(op, lambda: st.insert_many(ds), lambda: m.insert_many(n, dup_at, f),
                            f)
            if got is not Failed:
                on_disk = {r[ID]: r[L] for r in committed_rows(self.path).values()}
                labs = [on_disk[d["id"]] for d in ds]
                assert len(set(labs)) == n and all(x > m.issued for x in labs)
                for d, lab in zip(ds, labs, strict=True):
                    m.rows[lab] = (lab, *self.row_of(d)[1:])
                m.issued = max([m.issued, *labs])
        elif op == "get":
            for eid in {r[ID] for r in m.rows.values()} | {f"e{self.next_id}"}:
                r = st.get(eid)
                want = [x for x in m.rows.values() if x[ID] == eid]
                assert (as_tuple(r) if r else None) == (want[0] if want else None), eid
        elif op == "verify":
            lab, v = self.label(), bool(rng.random() < 0.5)
            f = self.fault(("UPDATE",))
            self.call(op, lambda: st.set_verified(lab, v), lambda: m.set_verified(lab, v, f), f,
                      exhausted=True)
        elif op == "hit":
            lab, at, n = self.label(), self.pick(STAMPS), int(rng.integers(0, 6))
            st.record_hit(lab, at, n)
            m.record_hit(lab, at, n)
        elif op == "flush":
            f = self.fault(("UPDATE", "BEGIN", "COMMIT"))
            self.call(op, st.flush_hits, lambda: m.flush_hits(f), f)
        elif op == "delete":
            labels = [self.label() for _ in range(int(rng.integers(0, 3 * m.chunk + 2)))]
            if m.rows and rng.random() < 0.2:
                labels.append(max(m.rows))  # the newest: its label must not come back
            pre = self.pick((None, [], [-1]))  # not asked for; asked; a list already begun
            got_c, want_c = (None, []) if pre is None else (list(pre), list(pre))
            f = self.fault(("DELETE", "BEGIN", "COMMIT"))
            self.call(op, lambda: st.delete(labels, got_c), lambda: m.delete(labels, want_c, f),
                      f, exhausted=True)
            if got_c is not None:
                assert got_c == want_c, (labels, got_c, want_c, f)
                assert not set(got_c) & set(committed_rows(self.path))  # reported gone: gone
        elif op == "cap":
            cap, never = self.pick(CAPS), bool(rng.random() < 0.5)
            f = self.fault(("UPDATE", "BEGIN", "COMMIT"))
            self.call(op, lambda: st.cap_ttls(cap, never), lambda: m.cap_ttls(cap, never, f), f,
                      exhausted=True)
        elif op == "clamp":
            now = self.pick(STAMPS)
            f = self.fault(("UPDATE",), hows=("ABORT", "ROLLBACK"))  # FAIL would keep a part
            self.call(op, lambda: st.clamp_future(now), lambda: m.clamp_future(now, f), f,
                      exhausted=True)
        elif op == "embed":
            rows = [(self.label(), rng.standard_normal(4).astype("<f4"), self.pick(("e", "g")))
                    for _ in range(int(rng.integers(0, 3 * m.chunk + 2)))]
            f = self.fault(("UPDATE", "BEGIN", "COMMIT"))
            mrows = [(lab, v.tobytes(), em) for lab, v, em in rows]
            self.call(op, lambda: st.set_embeddings(rows), lambda: m.set_embeddings(mrows, f), f,
                      exhausted=True)
        elif op == "iter":
            batch = int(rng.integers(1, 2 * m.chunk + 3))
            got = [as_tuple(r) for rows in st.iter_all(batch) for r in rows]
            assert got == [m.rows[k] for k in sorted(m.rows)]
            assert all(0 < len(rows) <= batch for rows in st.iter_all(batch))
        elif op == "reopen":
            self.reopen(lose_hits=bool(rng.random() < 0.3))
        self.t.steps += 1
        self.compare()

    def row_of(self, d: dict) -> tuple:
        return (0, d["id"], d["tenant"], d["model_id"], d["context_hash"], d["prompt"],
                d["answer"], np.asarray(d["embedding"], "<f4").tobytes(), d["embed_model"],
                d["verified"], d["created_at"], 0.0, 0, d["ttl_seconds"], d["truncated"],
                d["answer_tokens"])

    def compare(self) -> None:
        assert committed_rows(self.path) == self.m.rows
        assert self.st.count() == len(self.m.rows)
        assert self.st.labels_issued() == self.m.issued
        assert self.st._pending_hits == self.m.pending

    def close(self) -> None:
        self.reopen(lose_hits=False)
        self.st.close()
        assert committed_rows(self.path) == self.m.rows


def run(seed: int, steps: int, folder: str) -> Tally:
    r = Run(seed, folder)
    old = store_mod.WRITE_CHUNK
    store_mod.WRITE_CHUNK = r.m.chunk
    try:
        for _ in range(steps):
            r.step()
        r.close()
    finally:
        store_mod.WRITE_CHUNK = old
        with contextlib.suppress(Exception):
            r.st.close()
    return r.t


@pytest.mark.parametrize("block", range(2))
def test_the_store_answers_as_the_model_after_every_step(block, tmp_path):
    """SEEDS seeds of 150 steps, in two blocks: every call and failure, the committed table,
    count, labels_issued and the hit buffer compared after each step."""
    tally = Tally()
    for seed in range(block, SEEDS, 2):
        t = run(seed, 150, str(tmp_path))
        tally.failures += t.failures
        tally.reopens += t.reopens
        for k, v in t.ops.items():
            tally.ops[k] = tally.ops.get(k, 0) + v
    # The runs reach what they are for: failures injected, reopens, every call.
    assert tally.failures > SEEDS and tally.reopens > SEEDS
    assert set(tally.ops) == {"insert", "insert_many", "verify", "flush", "delete", "cap",
                              "clamp", "embed"}


# --- kill -9 ---------------------------------------------------------------------------------

CHILD = """
import sys
import numpy as np
import services.semantic.store as store_mod
store_mod.WRITE_CHUNK = 2
st = store_mod.EntryStore(sys.argv[1])  # synchronous=FULL, the default
rng = np.random.default_rng(int(sys.argv[2]))
i = 0
while True:
    if i and rng.random() < 0.25:
        done, labels = [], [int(x) for x in rng.integers(1, i + 1, int(rng.integers(1, 6)))]
        print("P", *labels, flush=True)  # under way: may be gone, in part, if killed now
        st.delete(labels, done)
        print("D", *done, flush=True)
    else:
        label = st.insert(id=f"e{i}", tenant="t", model_id="m", context_hash="", prompt="p",
                          answer="a" * int(rng.integers(1, 3000)),
                          embedding=np.ones(4, np.float32), embed_model="e", verified=False,
                          created_at=1.0, ttl_seconds=0)
        print("I", label, f"e{i}", flush=True)
        i += 1
"""


def kill_9_run(seed: int, folder: Path) -> tuple[int, int]:
    """A writer killed at a random point; every acknowledged insert and delete must have
    happened after the reopen, and no label it was given comes back."""
    rng = np.random.default_rng(seed)
    path = str(folder / f"k{seed}.db")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", CHILD, path, str(seed)],
                            stdout=subprocess.PIPE, text=True, cwd=root,
                            env={**os.environ, "PYTHONPATH": f"{root}:{root / 'gen'}"})
    inserted: dict[str, int] = {}
    deleted: set[int] = set()
    maybe: set[int] = set()  # the labels of a delete not yet acknowledged
    lines = []
    try:
        for _ in range(int(rng.integers(5, 80))):  # then killed, a moment into its next call
            lines.append(proc.stdout.readline())
            assert lines[-1], "the writer died"
        time.sleep(float(rng.uniform(0, 0.003)))
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    with proc.stdout:  # and all it wrote after those before it died
        lines += proc.stdout.readlines()
    for line in lines:
        if not line.endswith("\n"):  # a line cut short: not known to have been acknowledged
            continue
        w = line.split()
        if w[0] == "I":
            inserted[w[2]] = int(w[1])
        elif w[0] == "P":
            maybe = {int(x) for x in w[1:]}
        else:
            deleted.update(int(x) for x in w[1:])
            maybe = set()
    st = EntryStore(path)
    try:
        for eid, label in inserted.items():
            row = st.get(eid)
            if label in deleted:
                assert row is None, eid
            elif label not in maybe:
                assert row is not None and row.label == label, eid
        on_disk = {r.label for rows in st.iter_all() for r in rows}
        assert not on_disk & deleted
        top = max(inserted.values(), default=0)
        assert st.labels_issued() >= top
        new = st.insert(id="after", tenant="t", model_id="m", context_hash="", prompt="p",
                        answer="a", embedding=np.ones(4, np.float32), embed_model="e",
                        verified=False, created_at=1.0, ttl_seconds=0)
        assert new > top and new > max(on_disk, default=0)
    finally:
        st.close()
    return len(inserted), len(deleted)


def test_acknowledged_writes_survive_kill_9(tmp_path):
    for seed in range(3):
        kill_9_run(seed, tmp_path)
