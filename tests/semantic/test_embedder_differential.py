"""A differential review of the micro-batching embedder (services/semantic/embedder.py) under
concurrency: seeded rounds of 1-40 threads calling `BatchingEmbedder.embed_one_checked` at once,
and of concurrent Lookups and Stores through `SemanticCache` over it, every answer compared
with the reference model.

The model: the same `OnnxEmbedder` called for one text alone, sequentially. A concurrent
caller's vector must equal its text's lone vector (1e-5 absolute per component; padding in a
batch moved no component by more than 1.04e-7 over 300 rounds, with 1 or 2 ONNX Runtime
threads; no doc promises a figure, the tests of test_embedder.py ask 0.9999 cosine) and carry
its own text's truncation flag; a text that fails alone fails its own caller only. The batcher's
documented rules: a batch holds at most `max_batch` texts, batches run the texts in the order
they were queued (each once), `wanted` is asked once when the text's batch is about to run
(False: DeadlineExceeded, not embedded, counted in `dropped_texts`; raising: embedded), the
counters match the batches that ran, and `close` embeds what was queued before it, then stops
the worker. Where the docs are silent the model asserts invariants only: a caller whose
`timeout` passes gets TimeoutError and changes no one else's answer; a call after `close` is
answered at once (Unavailable), never left waiting. Texts: empty, one token, '!' runs around
the 256-token window, words past WordPiece's 100 characters, CJK, Hangul, emoji, decomposed
accents, zero-width spaces, duplicates, lone surrogates and a non-str; random arrival jitter,
slow forward passes (so batches form), wait_ms 0-5, `close` mid-traffic.

Through the cache (a static namespace nothing writes during the round, and a busy one taking
Lookups and Stores, some as the orchestrator makes them, a Lookup then the Store of its text,
which reuses the vector the Lookup kept): each stored row's vector is its prompt's lone vector
and its `over_window` the lone flag (a prompt two Stores wrote: the entry standing); a Lookup
of the static namespace answers as the same Lookup alone afterwards; empty and oversized texts
(> max_text_chars) are refused (InvalidArgument) and never reach a batch.

Run in the review: 440 batcher rounds (140 before the fixes; 300 after, half with one ONNX
thread, half with the default) and 390 cache rounds. Found and fixed (test_embedder_rules.py
guards each deterministically):
- a text the tokenizer cannot take (a lone surrogate, a non-str) failed its whole batch: every
  caller sharing it got a TypeError for a text that embeds alone (84 callers in 40 rounds);
  it is now refused in its own caller's thread;
- a call after `close` was queued behind the stop mark and waited forever (16 callers in 100
  rounds); it is now refused (Unavailable).

Bugs injected to check the harness has teeth (failing rounds of 40): each caller given the
truncation flag of its batch's first text 21; a batch of max_batch + 1 26; a raising `wanted`
taken as "gone" 21; close returning without embedding the batch it was collecting 6; the
attention mask ignored (padding pooled into the mean) 29; a Store reusing a Lookup's vector
without its window flag 10 (cache rounds).

More rounds: TIERCACHE_EMBEDDER_DIFF_SEEDS=400 (default 8 here; half as many cache rounds).
"""

from __future__ import annotations

import os
import random
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout

import numpy as np

from services.common.errors import DeadlineExceeded, InvalidArgument, Unavailable
from services.semantic.cache import Namespace, SemanticCache
from services.semantic.config import SemanticConfig
from services.semantic.embedder import BatchingEmbedder
from services.semantic.store import EntryStore
from tests.blank_text import blank
from tests.clock import Clock

SEEDS = int(os.environ.get("TIERCACHE_EMBEDDER_DIFF_SEEDS", "8"))
TOL = 1e-5
# A caller still waiting this long is taken as left waiting for good.
HANG_S = 10.0

WORDS = ("the a cat dog question python café naïve résumé 一个 女人 🐍 hello world 각 ! ? "
         "long Zürich cafe\u0301 \u200b").split(" ")
BAD = ["\ud800", "a \udcff b", b"bytes"]
_invisible = blank  # refused as empty (tests/blank_text.py)


def _text(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.08:
        return ""
    if r < 0.16:
        return rng.choice(["!", "a", "hi", "🐍", " "])
    if r < 0.30:  # '!' is one token: 254 fill the window with [CLS] [SEP], 255 are cut
        return "!" * rng.choice([252, 253, 254, 255, 256, 300])
    if r < 0.36:  # one word past WordPiece's 100 characters is one [UNK]
        return "x" * rng.choice([99, 100, 101, 2000])
    if r < 0.42:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 300)))
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 30)))


class _Lone:
    """The reference: the embedder called for one text alone (memoised)."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.memo: dict[object, tuple] = {}

    def __call__(self, text) -> tuple:
        key = (type(text), text)
        if key not in self.memo:
            try:
                v, c = self.inner.embed_checked([text])
                self.memo[key] = ("ok", v[0].copy(), c[0])
            except Exception as e:  # noqa: BLE001 - what a lone call gives
                self.memo[key] = ("err", type(e), None)
        return self.memo[key]


class _Recorder:
    """The real embedder, each batch's texts noted (and optionally a slower forward pass, so
    that callers queue behind a running batch)."""

    def __init__(self, inner, slow: float = 0.0) -> None:
        self.inner, self.slow = inner, slow
        self.name, self.identity, self.dim = inner.name, inner.identity, inner.dim
        self.max_seq_length = inner.max_seq_length
        self.exceeds_window, self.unseen = inner.exceeds_window, inner.unseen
        self.batches: list[tuple[list, bool]] = []

    def embed(self, texts):
        return self.inner.embed(texts)

    def embed_checked(self, texts):
        if self.slow:
            time.sleep(self.slow)
        try:
            out = self.inner.embed_checked(texts)
        except BaseException:
            self.batches.append((list(texts), False))
            raise
        self.batches.append((list(texts), True))
        return out


class _OrderedQueue:
    """The batcher's queue with the order of its puts noted (by caller thread name): puts are
    serialised, so the note is the queue's own order."""

    def __init__(self, q) -> None:
        self.q, self.lock, self.order = q, threading.Lock(), []

    def put(self, item) -> None:
        with self.lock:
            self.q.put(item)
            if item is not None:
                self.order.append(threading.current_thread().name)

    def get(self, *a, **k):
        return self.q.get(*a, **k)

    def get_nowait(self):
        return self.q.get_nowait()

    def qsize(self) -> int:
        return self.q.qsize()


def run_batcher_round(seed: int, inner, lone: _Lone, seen: dict) -> list[str]:
    """One round of concurrent callers; the model's complaints ([] = it agrees)."""
    rng = random.Random(seed)
    n = rng.randint(1, 40)
    max_batch = rng.choice([1, 2, 3, 4, 8, 32])
    rec = _Recorder(inner, slow=rng.choice([0, 0, 0.002, 0.01]))
    b = BatchingEmbedder(rec, max_batch=max_batch, wait_ms=rng.choice([0, 0, 0, 1, 5]))
    b._q = oq = _OrderedQueue(b._q)
    dups = [_text(rng) for _ in range(3)]
    callers = []
    for i in range(n):
        r = rng.random()
        text = (rng.choice(dups) if r < 0.25 else rng.choice(BAD) if r < 0.30 else _text(rng))
        w = rng.random()
        wanted = "no" if w < 0.15 else "yes" if w < 0.25 else "raises" if w < 0.30 else None
        timeout = rng.choice([0.0005, 0.003]) if rng.random() < 0.1 else None
        callers.append(dict(i=i, text=text, wanted=wanted, timeout=timeout,
                            delay=rng.random() * 0.004, asked=0))
    close_at = rng.random() * 0.01 if rng.random() < 0.25 else None
    barrier = threading.Barrier(n + (close_at is not None))
    closed: dict[str, float] = {}

    def call(c: dict) -> None:
        def wanted() -> bool:
            c["asked"] += 1
            if c["wanted"] == "raises":
                raise RuntimeError("a broken predicate")
            return c["wanted"] == "yes"

        barrier.wait()
        time.sleep(c["delay"])
        try:
            got = b.embed_one_checked(c["text"], c["timeout"] or HANG_S,
                                      wanted=None if c["wanted"] is None else wanted)
            c["got"] = ("ok", np.array(got[0]), got[1])
        except BaseException as e:  # noqa: BLE001 - what the caller got
            c["got"] = ("err", type(e), e)
        c["t1"] = time.monotonic()

    def closer() -> None:
        barrier.wait()
        time.sleep(close_at)
        closed["t0"] = time.monotonic()
        b.close()

    threads = [threading.Thread(target=call, args=(c,), name=f"c{c['i']}") for c in callers]
    if close_at is not None:
        threads.append(threading.Thread(target=closer))
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S + 10)
    b.close()

    problems: list[str] = []
    p = problems.append
    for c in callers:
        got, want = c["got"], lone(c["text"])
        tag = f"caller {c['i']} {c['text'][:16]!r}({len(c['text'])})"
        if got[0] == "ok":
            seen["ok"] += 1
            seen["cut"] += got[2]
            if want[0] != "ok" or c["text"] in BAD:
                p(f"{tag}: a vector, though alone it raises")
                continue
            if c["wanted"] == "no":
                p(f"{tag}: embedded though its caller was gone")
            d = float(np.abs(got[1] - want[1]).max())
            seen["max_diff"] = max(seen["max_diff"], d)
            if d > TOL:
                p(f"{tag}: its vector is {d:.2e} from its lone vector")
            if got[2] is not want[2]:
                p(f"{tag}: truncation flag {got[2]}, alone {want[2]}")
            if got[1].shape != (inner.dim,) or got[1].dtype != np.float32:
                p(f"{tag}: shape {got[1].shape} {got[1].dtype}")
        elif got[1] is DeadlineExceeded:
            seen["dropped"] += 1
            if c["wanted"] != "no" or c["asked"] != 1:
                p(f"{tag}: DeadlineExceeded, wanted {c['wanted']} asked {c['asked']} times")
        elif got[1] in (FutureTimeout, TimeoutError):
            seen["timed_out"] += 1
            if c["timeout"] is None:
                p(f"{tag}: still waiting after {HANG_S} s (close begun: {bool(closed)})")
        elif got[1] is Unavailable:
            seen["refused_closed"] += 1
            if not closed or c["t1"] < closed["t0"]:
                p(f"{tag}: Unavailable before close")
        elif c["text"] in BAD:
            seen["bad"] += 1
            if want[0] != "err" or got[1] not in (want[1], InvalidArgument):
                p(f"{tag}: raised {got[1].__name__}, alone {want}")
        else:
            p(f"{tag}: raised {got[1].__name__}: {str(got[2])[:80]}; alone it embeds")
        if c["wanted"] is not None and c["asked"] > 1:
            p(f"{tag}: wanted asked {c['asked']} times")
    # The batches: at most max_batch, the queue's order, each live caller's text once.
    for texts, _ in rec.batches:
        if not 1 <= len(texts) <= max_batch:
            p(f"a batch of {len(texts)} (max_batch {max_batch})")
        seen["batched"] += len(texts) > 1
    dropped = {c["i"] for c in callers if c["wanted"] == "no" and c["asked"]}
    order = [callers[int(name[1:])]["text"] for name in oq.order
             if int(name[1:]) not in dropped]
    ran = [t for texts, _ in rec.batches for t in texts]
    if ran != order:
        p(f"batches ran {len(ran)} texts, not the {len(order)} queued in their order")
    ok = [texts for texts, good in rec.batches if good]
    if (b.batches, b.batched_texts, b.dropped_texts) != (len(ok), sum(map(len, ok)),
                                                          len(dropped)):
        p(f"counters {b.batches, b.batched_texts, b.dropped_texts}")
    if b._thread.is_alive():
        p("the worker runs after close")
    seen["closes"] += close_at is not None
    return problems


def run_cache_round(seed: int, inner, lone: _Lone, tmp: str, seen: dict) -> list[str]:
    """Concurrent Lookups and Stores through the cache; the model's complaints."""
    rng = random.Random(seed)
    max_chars = 700
    cfg = SemanticConfig(address="127.0.0.1:0", metrics_port=-1, db_path=f"{tmp}/s{seed}.db",
                         sqlite_synchronous="NORMAL", guard_tiers=(), verifier_tiers=(),
                         max_text_chars=max_chars, max_batch=rng.choice([1, 2, 4, 8]))
    cfg.validate()
    rec = _Recorder(inner, slow=rng.choice([0, 0.003]))
    b = BatchingEmbedder(rec, max_batch=cfg.max_batch)
    store = EntryStore(cfg.resolved_db_path(), "NORMAL")
    cache = SemanticCache(cfg, b, store, Clock(1_000_000.0))
    cache.load()
    static, busy = Namespace("t", "m", "aa"), Namespace("t", "m", "bb")
    pool = [_text(rng) for _ in range(8)] + ["x" * (max_chars + 1), "a" * max_chars,
                                             "! " * 300]  # 300 tokens: past the window

    def pick() -> str:
        return rng.choice(pool) if rng.random() < 0.5 else _text(rng)

    for i in range(rng.randint(0, 5)):  # the static namespace, written beforehand
        t = pick()
        if not _invisible(t) and len(t) <= max_chars:
            cache.store_entry(static, t, f"s{i}")
    ops = []
    for _ in range(rng.randint(1, 30)):
        r, t = rng.random(), pick()
        ops.append(("lookup", static, t) if r < 0.4 else ("lookup", busy, t) if r < 0.6
                   else ("store", busy, t))
        if r < 0.6 and rng.random() < 0.3:
            ops.append(("store", busy, t))  # a Store of it at the same time
        if rng.random() < 0.2:  # as the orchestrator: a Lookup, then its Store (reusing)
            ops.append(("lookup+store", busy, pick()))
    results: list = [None] * len(ops)
    barrier = threading.Barrier(len(ops))
    delays = [rng.random() * 0.003 for _ in ops]

    def run(i: int) -> None:
        kind, ns, t = ops[i]
        barrier.wait()
        time.sleep(delays[i])
        try:
            if kind != "store":
                looked = cache.lookup(ns, t)
            results[i] = ("ok", looked if kind == "lookup"
                          else cache.store_entry(ns, t, f"a{i}"))
        except Exception as e:  # noqa: BLE001 - what the caller got
            results[i] = ("err", e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ops))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S + 10)
    problems: list[str] = []
    p = problems.append
    try:
        embedded = {t for texts, _ in rec.batches for t in texts}
        for i, ((kind, ns, t), res) in enumerate(zip(ops, results, strict=True)):
            tag = f"op {i} {kind} {ns.context_hash} {t[:16]!r}({len(t)})"
            if _invisible(t) or len(t) > max_chars:
                seen["refused"] += 1
                if res[0] != "err" or not isinstance(res[1], InvalidArgument):
                    p(f"{tag}: not refused: {res}")
                if len(t) > max_chars and t in embedded:
                    p(f"{tag}: an oversized text was embedded")
                continue
            if res is None or res[0] == "err":
                p(f"{tag}: {res}")
                continue
            want = lone(t)
            if kind != "lookup":
                e = res[1]
                row = store.get(e.id)
                if row is None:  # a later Store of the prompt replaced it: the one standing
                    twice = sum(o[0] != "lookup" and o[1:] == (ns, t) for o in ops) > 1
                    label = cache._by_prompt.get((ns, t))
                    e = cache._entries.get(label) if label is not None else None
                    row = store.get(e.id) if e is not None else None
                    if row is None or not twice:
                        p(f"{tag}: its row is gone")
                        continue
                seen["stored"] += 1
                seen["stored_over"] += bool(e.over_window)
                d = float(np.abs(row.embedding - want[1]).max())
                if d > TOL:
                    p(f"{tag}: stored vector {d:.2e} from its lone vector")
                if e.over_window is not want[2]:
                    p(f"{tag}: over_window {e.over_window}, alone {want[2]}")
            elif ns == static:  # nothing writes there: as the same Lookup alone
                r, alone = res[1], cache.lookup(ns, t)
                seen["hits"] += r.hit
                label = r.entry.label if r.entry else None
                alone_label = alone.entry.label if alone.entry else None
                if ((r.hit, label) != (alone.hit, alone_label)
                        and abs(r.similarity - r.threshold) > 1e-4):
                    p(f"{tag}: hit {r.hit} {label}, alone {alone.hit} {alone_label}")
                if abs(r.similarity - alone.similarity) > TOL:
                    p(f"{tag}: similarity {r.similarity}, alone {alone.similarity}")
    finally:
        cache.close_indexes()
        store.close()
        b.close()
    return problems


def test_each_concurrent_caller_gets_its_lone_vector_and_flag(onnx_embedder):
    lone = _Lone(onnx_embedder)
    seen = dict.fromkeys(("ok", "cut", "dropped", "timed_out", "refused_closed", "bad",
                          "batched", "closes", "max_diff"), 0)
    failed = {}
    for seed in range(SEEDS):
        problems = run_batcher_round(seed, onnx_embedder, lone, seen)
        if problems:
            failed[seed] = problems[:3]
    assert not failed, failed
    # The rounds reached what they are for.
    assert seen["ok"] > 20 * SEEDS // 2 and seen["cut"] and seen["batched"], seen
    assert seen["dropped"] and seen["bad"] and seen["closes"], seen


def test_concurrent_lookups_and_stores_keep_lone_vectors_and_flags(onnx_embedder, tmp_path):
    lone = _Lone(onnx_embedder)
    seen = dict.fromkeys(("refused", "stored", "stored_over", "hits"), 0)
    failed = {}
    for seed in range(SEEDS // 2 + 1):
        problems = run_cache_round(seed, onnx_embedder, lone, str(tmp_path), seen)
        if problems:
            failed[seed] = problems[:3]
    assert not failed, failed
    assert seen["refused"] and seen["stored"] > SEEDS and seen["stored_over"], seen
