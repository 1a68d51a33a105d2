"""A differential review of "bad input gets a clear gRPC status naming the problem, and leaves
no state behind", for every RPC of the three internal services (semantic, prefix, kvpool),
called over a real loopback gRPC channel (each service's own `serve` / `create_server`).

Each step builds a valid request for a random RPC from the service's current state, then
(most steps) corrupts one or two fields: empty, oversize, just past / just at a limit,
negative, NaN / inf floats, unknown ids, namespaces, tiers and replicas, malformed, repeated or
root-keyed hashes, token counts that do not fill blocks, out-of-vocabulary ids, a missing
oneof or message. A REFERENCE MODEL written from the protos, the service READMEs, the
docstrings and docs/architecture.md "Errors" decides, from the request and the model's state
alone, whether the request is fine or which (status, field) pairs it may be refused with:

- a refused request must get one of those statuses (never INTERNAL / UNKNOWN) whose details
  start with "field:" (the house style of services/common/errors.py), and leave the whole
  observable state exactly as before the call: the Stats answer, the in-process objects
  (every entry, LRU, index, embedding memo and SQLite row for semantic; the tree's slots,
  replicas, batch numbers, lapse records and hasher caches for prefix; the pool's blocks,
  ref counts, pins, free queue, eviction heap and the engine's queues for kvpool) and every
  tiercache_* metric but the per-call RPC counters;
- a request the model finds fine must succeed, and answer as the docs say for what the model
  tracks (a stored prompt looked up again is an exact hit of that id; removed counts; batch
  numbers; matched blocks of published chains; token counts of a generation);
- a status the model did not expect (accepting what the docs refuse, or refusing what they
  allow) is a divergence.

Requests have no enum fields (tiers are strings; PublishStatus and FinishReason are answers
only), and Stats takes no input: it is called between the others as a valid request. Bytes
that are no protobuf message are the interceptor's (INVALID_ARGUMENT "request: ...", checked
by hand in this review); a field sent with the wrong wire type parses as unknown (unset).

Run in a scratch script, one server per service, the final model: semantic 720 seeds (28,000
calls), prefix 720 seeds (26,000), kvpool 520 seeds (15,600), 30-40 steps each. No defect:
every refusal was a documented status naming its field, and no refused call changed anything.
Model errors fixed on the way: the sweeper reaps unheld nodes on its own pace (the pictures
wait for it), "N s ago" in a shard-list note is the clock, an entry stored with a 60 s TTL
expires within a run. Undocumented behaviour met (the model takes either answer there):
- PublishEvents refuses an event with no kind set (the servicer's own check) even in a batch
  that is a retry (seq < next_seq: acknowledged) or after a gap (RESYNC), where any other
  malformed event passes unread;
- a stored block hash or parent_hash equal to a root key (h_0) of another model or salt is
  refused only once the index holds that root (else: an unknown parent, the chain dropped);
- semantic text, prompt and answer of white space only are refused as empty;
- kvpool draft token ids past sampling.max_tokens are not checked (dropped unread; its server
  test says so, the proto does not);
- a refused PublishEvents may make the index's block hasher for the replica's (served) model
  early: a cache, not observable; hashers of models no replica serves are compared.

Teeth (60 seeds x 30 steps each, failing seeds): Lookup recording the caller's shard list
before validating 28, Store's ttl_seconds limit dropped 23, a refused publish renewing the
lease (renew before validate) 36, Match's block-count limit dropped 14, Generate's cache_salt
checked after the engine submit 24, Prefill's pin ttl check dropped 19; the bounded test below
catches each.

Bounded: 5 / 6 / 8 seeds x 30 steps (about 7 s here, 3.5 s of it building the tiny model);
BAD_INPUT_DIFFERENTIAL_SEEDS=N runs N seeds per service.
"""

from __future__ import annotations

import array
import collections
import enum
import functools
import logging
import math
import os
import queue
import random
import re
import sqlite3
import threading
import types
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import numpy as np
import pytest
from prometheus_client import REGISTRY
from tiercache.v1 import (
    common_pb2,
    kvpool_pb2,
    kvpool_pb2_grpc,
    prefix_pb2,
    prefix_pb2_grpc,
    semantic_pb2,
    semantic_pb2_grpc,
)

from services.common.hashing import BlockHasher
from services.launcher import free_port
from tests.blank_text import blank, hidden, lookalike
from tests.waits import holds_within
from tests.wire import f32

SEEDS = int(os.environ.get("BAD_INPUT_DIFFERENTIAL_SEEDS", "0"))
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
FAILED, EXHAUSTED = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED

# ---- state snapshots ----------------------------------------------------------------------

_OPAQUE = (type(threading.Lock()), type(threading.RLock()), threading.Event,
           threading.Condition, threading.Thread, queue.Queue, logging.Logger,
           types.FunctionType, types.MethodType, types.BuiltinFunctionType,
           types.ModuleType, functools.partial, sqlite3.Connection)


def dump(x, skip: frozenset = frozenset(), depth: int = 0, seen: set | None = None):
    """A comparable picture of `x`: every attribute, item and element, recursively (locks,
    threads, callables, connections and tensors by type only; `skip`: attribute names)."""
    seen = set() if seen is None else seen
    if x is None or isinstance(x, (bool, int, str, bytes)):
        return x
    if isinstance(x, float):
        return repr(x)
    if isinstance(x, enum.Enum):
        return repr(x)
    if isinstance(x, (bytearray, memoryview)):
        return bytes(x)
    if isinstance(x, array.array):
        return (x.typecode, x.tobytes())
    if isinstance(x, np.ndarray):
        return ("ndarray", x.shape, str(x.dtype), x.tobytes())
    if isinstance(x, np.generic):
        return repr(x)
    if isinstance(x, _OPAQUE) or type(x).__name__ in ("Tensor", "Parameter") or depth > 14:
        return f"<{type(x).__name__}>"
    if id(x) in seen:
        return "<seen>"
    seen.add(id(x))
    d = depth + 1
    if isinstance(x, dict):
        return ("dict", [(dump(k, skip, d, seen), dump(v, skip, d, seen)) for k, v in x.items()])
    if isinstance(x, (list, tuple, collections.deque)):
        return [dump(v, skip, d, seen) for v in x]
    if isinstance(x, (set, frozenset)):
        return ("set", sorted(repr(dump(v, skip, d, seen)) for v in x))
    attrs = {}
    if hasattr(x, "__dict__"):
        attrs.update(vars(x))
    for cls in type(x).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(x, name):
                attrs[name] = getattr(x, name)
    if not attrs:
        return f"<{type(x).__name__}>"
    return (type(x).__name__, {k: dump(v, skip, d, seen) for k, v in sorted(attrs.items())
                               if k not in skip})


def metrics_picture() -> dict:
    """Every tiercache_* sample but the interceptor's per-call timings and counts of calls that
    did not end OK (a refused call is counted there by its code), and the label sets' creation
    times."""
    out = {}
    for fam in REGISTRY.collect():
        for s in fam.samples:
            if not s.name.startswith("tiercache_") or s.name.endswith("_created"):
                continue
            if s.name.startswith("tiercache_rpc_") and not (
                    s.name == "tiercache_rpc_total" and s.labels.get("code") == "OK"
                    and s.labels.get("method") != "Stats"):  # the pictures' own Stats calls
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def diff(a, b, path: str = "") -> str:
    """Where two pictures first differ (for the failure message)."""
    if type(a) is not type(b):
        return f"{path}: {a!r:.200} != {b!r:.200}"
    if isinstance(a, dict):
        for k in a.keys() | b.keys():
            if a.get(k, "<missing>") != b.get(k, "<missing>"):
                return diff(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{path}.{k}")
    if isinstance(a, (list, tuple)) and len(a) == len(b):
        for i, (u, v) in enumerate(zip(a, b, strict=True)):
            if u != v:
                return diff(u, v, f"{path}[{i}]")
    return f"{path}: {a!r:.300} != {b!r:.300}"


# ---- the common driver ----------------------------------------------------------------------

OK = "ok"


@dataclass
class Verdict:
    """The model's answer for one request: OK, or the (status, field) pairs it may be refused
    with (any one of them: with two fields corrupted either may be named first)."""

    refusals: list[tuple[grpc.StatusCode, str]] = field(default_factory=list)
    # Where the docs leave it open whether a flaw is looked at (a batch that is not applied):
    # an OK answer is right too, then checked as a valid request's.
    may_pass: bool = False

    def bad(self, code: grpc.StatusCode, fieldname: str) -> None:
        self.refusals.append((code, fieldname))

    @property
    def ok(self) -> bool:
        return not self.refusals


class Divergence(AssertionError):
    pass


def check_refusal(what: str, verdict: Verdict, err: grpc.RpcError | None,
                  before, after) -> None:
    """A refused request: an expected status naming an expected field, state untouched."""
    if err is None:
        raise Divergence(f"{what}: accepted; the docs refuse it with {verdict.refusals}")
    code, details = err.code(), err.details() or ""
    if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
        raise Divergence(f"{what}: {code.name} {details!r}")
    named = [(c, f) for c, f in verdict.refusals if c == code and details.startswith(f + ":")]
    if not named:
        raise Divergence(f"{what}: {code.name} {details!r}; expected one of "
                         f"{[(c.name, f) for c, f in verdict.refusals]}")
    if before != after:
        raise Divergence(f"{what}: refused ({code.name} {details!r}) but state changed at "
                         f"{diff(before, after)}")


def call(fn, req, timeout: float = 20.0):
    """(answer, None) or (None, RpcError); a stream's messages are collected."""
    try:
        r = fn(req, timeout=timeout)
        if isinstance(r, grpc.Future) or hasattr(r, "__next__"):
            r = list(r)
        return r, None
    except grpc.RpcError as e:
        return None, e


def pick(rng: random.Random, options):
    return options[rng.randrange(len(options))]


Corruption = Callable[[random.Random, object], None]


def corrupt(rng: random.Random, req, corruptions: list[Corruption]) -> list[str]:
    """Applies one or two corruptions (names returned, for messages)."""
    n = 1 if rng.random() < 0.6 else 2
    done = []
    for fn in rng.sample(corruptions, min(n, len(corruptions))):
        fn(rng, req)
        done.append(fn.__name__)
    return done


def oneof(*fns: Corruption) -> Corruption:
    """A corruption that applies one of `fns` (they are variants of one field)."""
    def run(rng, req):
        f = pick(rng, fns)
        run.__name__ = f.__name__
        f(rng, req)
    run.__name__ = fns[0].__name__
    return run


# ==== semantic ==================================================================================

SEM_DIM = 16


class HashEmbedder:
    """A vector per text derived from its hash: distinct texts land far apart (cosine of two
    random 16-dim unit vectors), so only the exact repeats the model tracks are hits."""

    name = identity = "hash@test"
    dim = SEM_DIM

    def embed_one(self, text: str) -> np.ndarray:
        rng = np.random.default_rng(abs(hash(text)) % 2**32)
        v = rng.standard_normal(SEM_DIM).astype(np.float32)
        return v / np.linalg.norm(v)

    def embed(self, texts: list[str]) -> np.ndarray:
        return (np.stack([self.embed_one(t) for t in texts]) if texts
                else np.zeros((0, SEM_DIM), np.float32))


class SemanticWorld:
    """A served semantic cache and the model's view of it: (namespace, prompt) -> id."""

    TIERS = ("strict", "standard", "relaxed")

    def __init__(self, tmp: str) -> None:
        from services.semantic.config import SemanticConfig
        from services.semantic.server import serve

        self.cfg = SemanticConfig(address=f"127.0.0.1:{free_port()}", metrics_port=-1,
                                  db_path=os.path.join(tmp, "s.db"),
                                  sqlite_synchronous="NORMAL", guard_tiers=(),
                                  verifier_tiers=(), max_text_chars=64, max_answer_chars=96,
                                  max_tenant_chars=64, max_ttl_seconds=10_000,
                                  default_ttl_seconds=3600,
                                  expiry_interval_s=3600)
        self.cfg.validate()
        self.svc = serve(self.cfg, embedder=HashEmbedder())
        self.svc.housekeeper.stop()  # no hit flush nor purge between two pictures
        self.channel = grpc.insecure_channel(self.svc.handle.address)
        self.stub = semantic_pb2_grpc.SemanticCacheStub(self.channel)
        self.entries: dict[tuple[tuple[str, str, str], str], str] = {}  # (ns, prompt) -> id
        self.verified: dict[str, bool] = {}
        self.gone: list[str] = []  # ids removed (unknown now)
        self.tenants = ["acme", "beta", "t" * 64]
        self.models = ["m1", "mm"]
        self.hashes = ["", "00ff", "abc", "0" * 128]

    def close(self) -> None:
        self.channel.close()
        self.svc.stop(grace=0)

    # -- pictures --

    def picture(self):
        c = self.svc.cache
        c.store.flush_hits()
        # The db's rows through a connection of our own (WAL: the service's writes are seen).
        with sqlite3.connect(c.store.path) as db:
            rows = db.execute("SELECT * FROM entries ORDER BY rowid").fetchall()
        st = self.stub.Stats(semantic_pb2.SemanticStatsRequest(), timeout=10)
        # "... 12 s ago": the clock's, not state.
        st.shard_list_mismatch = re.sub(r"[0-9.]+ s ago", "s ago", st.shard_list_mismatch)
        return {"stats": str(st).splitlines(), "rows": rows,
                "cache": dump(c, frozenset({"embedder", "cfg", "_m", "store", "policy",
                                            "verifier", "guard", "clock"})),
                "shard_lists": dump(self.shard_lists),
                "metrics": metrics_picture()}

    @functools.cached_property
    def shard_lists(self):
        return self._servicer().shard_lists

    def _servicer(self):
        # The servicer serve() made: the one object holding this cache.
        import gc

        for o in gc.get_referrers(self.svc.cache):
            if type(o).__name__ == "SemanticServicer":
                return o
            if isinstance(o, dict):
                for r in gc.get_referrers(o):
                    if type(r).__name__ == "SemanticServicer":
                        return r
        raise AssertionError("no servicer")

    # -- requests --

    def ns(self, rng) -> semantic_pb2.Namespace:
        h = pick(rng, self.hashes)
        if h and rng.random() < 0.2:
            h = h.upper()
        return semantic_pb2.Namespace(tenant=pick(rng, self.tenants),
                                      model_id=pick(rng, self.models), context_hash=h)

    def text(self, rng) -> str:
        if self.entries and rng.random() < 0.5:
            return pick(rng, sorted(self.entries))[1]
        return f"question {rng.randrange(40)}?" if rng.random() < 0.9 else "q" * 64

    def known_id(self, rng) -> str:
        ids = sorted(self.entries.values())
        if ids and rng.random() < 0.85:
            return pick(rng, ids)
        return pick(rng, self.gone) if self.gone and rng.random() < 0.5 else "f" * 32

    def valid(self, rng, rpc: str):
        if rpc == "Lookup":
            if self.entries and rng.random() < 0.6:
                (t, m, h), text = pick(rng, sorted(self.entries))
                ns = semantic_pb2.Namespace(tenant=t, model_id=m, context_hash=h)
            else:
                ns, text = self.ns(rng), self.text(rng)
            return semantic_pb2.LookupRequest(
                namespace=ns, text=text, tier=pick(rng, ("",) + self.TIERS),
                threshold=pick(rng, (0.0, 0.0, 0.85, 0.9, 1.0)),
                want_draft=rng.random() < 0.5, shard_list=self.shard_list(rng))
        if rpc == "Store":
            ans = "an answer " + str(rng.randrange(100))
            ids = [rng.randrange(2**32) for _ in range(rng.randrange(len(ans.encode()) + 2))]
            return semantic_pb2.StoreRequest(
                namespace=self.ns(rng), prompt=self.text(rng), answer=ans,
                verified=rng.random() < 0.3, ttl_seconds=pick(rng, (0, 5000, 10_000)),
                truncated_at=pick(rng, (0, 0, 1, 2**32 - 1)), answer_token_ids=ids,
                shard_list=self.shard_list(rng))
        if rpc == "Verify":
            return semantic_pb2.VerifyRequest(id=self.known_id(rng), verified=rng.random() < .5)
        if rpc == "Invalidate":
            if rng.random() < 0.6:
                return semantic_pb2.InvalidateRequest(id=self.known_id(rng))
            if rng.random() < 0.75:
                return semantic_pb2.InvalidateRequest(namespace=self.ns(rng))
            # Every entry of one tenant, in every namespace (erasure on request).
            return semantic_pb2.InvalidateRequest(tenant=pick(rng, self.tenants))
        return semantic_pb2.SemanticStatsRequest()

    @staticmethod
    def shard_list(rng) -> common_pb2.ShardList:
        if rng.random() < 0.7:
            return common_pb2.ShardList()
        return common_pb2.ShardList(shards=rng.randrange(4),
                                    fingerprint=pick(rng, ("", "aa", "bb", "x" * 300)))

    def corruptions(self, rpc: str) -> list[Corruption]:
        def no_namespace(rng, r):
            r.ClearField("namespace")

        def tenant_empty(rng, r):
            r.namespace.tenant = ""

        def tenant_long(rng, r):
            r.namespace.tenant = "t" * pick(rng, (65, 300, 5000))

        def model_empty(rng, r):
            r.namespace.model_id = ""

        def model_long(rng, r):
            r.namespace.model_id = "m" * pick(rng, (65, 257, 64))

        def model_hidden(rng, r):  # refused where stored or looked up, erasable
            r.namespace.model_id = pick(rng, ("m\n", "llama\u200b", "m\u3164", "my model"))

        def context_not_hex(rng, r):
            r.namespace.context_hash = pick(rng, ("xyz", "00 ff", "0x00", "é", "-1"))

        def context_long(rng, r):
            r.namespace.context_hash = "a" * pick(rng, (129, 1000))

        def tenant_space(rng, r):  # refused blank, a lookalike where stored or looked up
            r.namespace.tenant = pick(rng, (" ", "a b", "\t", "\u3164", "\u200b", "a\u200b",
                                            "cafe\u0301", "a\nb", "a\u202eb"))

        ns_fix = [no_namespace, oneof(tenant_empty, tenant_long, tenant_space),
                  oneof(model_empty, model_long, model_hidden),
                  oneof(context_not_hex, context_long)]

        def text_bad(rng, r):
            name = "text" if rpc == "Lookup" else "prompt"
            setattr(r, name, pick(rng, ("", " ", "\n\t ", "\u200b\ufeff", "x" * 65,
                                        "x" * 10_000, "x" * 64)))

        def tier_bad(rng, r):
            r.tier = pick(rng, ("lenient", "STRICT", " strict", "explicit", "s" * 300))

        def threshold_bad(rng, r):
            r.threshold = pick(rng, (math.nan, math.inf, -math.inf, -0.5, 0.5, 0.84, 1.0001,
                                     2.0, 1e30, -0.0, 0.85, 1.0, 1e-40))

        def answer_bad(rng, r):
            r.answer = pick(rng, ("", "   ", "a" * 97, "a" * 70_000, "a" * 96))

        def ttl_bad(rng, r):
            r.ttl_seconds = pick(rng, (10_001, 2**31, 2**32 - 1, 10_000))

        def token_ids_bad(rng, r):
            n = len(r.answer.encode()) + pick(rng, (2, 3, 50, 1))
            del r.answer_token_ids[:]
            r.answer_token_ids.extend(rng.randrange(2**32) for _ in range(n))

        def truncated_any(rng, r):
            r.truncated_at = rng.randrange(2**32)

        def id_bad(rng, r):
            r.id = pick(rng, ("", "nope", "F" * 32, "x" * 5000, " "))

        def no_target(rng, r):
            r.ClearField("target")

        def id_empty_target(rng, r):
            r.id = ""

        def tenant_target_bad(rng, r):  # required; a lookalike is erasable, as in a namespace
            r.tenant = pick(rng, ("", " ", "\t", "\u3164", "\u200b", "t" * 257, "t" * 256,
                                  "acme\u200b", "cafe\u0301", "a b"))

        if rpc == "Lookup":
            return [*ns_fix, text_bad, tier_bad, threshold_bad]
        if rpc == "Store":
            return [*ns_fix, text_bad, answer_bad, ttl_bad, token_ids_bad, truncated_any]
        if rpc == "Verify":
            return [id_bad]
        if rpc == "Invalidate":
            return [no_target, id_empty_target, id_bad, tenant_target_bad, *ns_fix]
        return []

    # -- the model of the docs --

    def expect_ns(self, v: Verdict, r, erasing: bool = False) -> None:
        if not r.HasField("namespace"):
            v.bad(INVALID, "namespace")
            return
        ns = r.namespace
        for name, value in (("tenant", ns.tenant), ("model_id", ns.model_id)):
            # "Required (not whitespace or invisible characters only)", the proto says.
            if blank(value) or len(value) > self.cfg.max_tenant_chars:
                v.bad(INVALID, f"namespace.{name}")
        if lookalike(ns.tenant) and not erasing:  # "... nor one that prints as another"
            v.bad(INVALID, "namespace.tenant")
        if hidden(ns.model_id) and not erasing:  # "... no control, format or invisible"
            v.bad(INVALID, "namespace.model_id")
        h = ns.context_hash
        if len(h) > 128 or any(c not in "0123456789abcdefABCDEF" for c in h):
            v.bad(INVALID, "namespace.context_hash")

    def expect_text(self, v: Verdict, name: str, text: str, limit: int) -> None:
        # "Non-empty, within the size limit" (the proto); blank text counts as empty
        # (`_check_text`: nothing to embed).
        if blank(text) or len(text) > limit:
            v.bad(INVALID, name)

    def expect(self, rpc: str, r) -> Verdict:
        v = Verdict()
        if rpc == "Lookup":
            self.expect_ns(v, r)
            self.expect_text(v, "text", r.text, self.cfg.max_text_chars)
            if r.tier not in ("",) + self.TIERS:
                v.bad(INVALID, "tier")
            t = r.threshold
            if t != 0 and not (math.isfinite(t) and f32(self.cfg.threshold_floor) - 1e-6
                               <= t <= 1 + 1e-6):
                v.bad(INVALID, "threshold")
        elif rpc == "Store":
            self.expect_ns(v, r)
            self.expect_text(v, "prompt", r.prompt, self.cfg.max_text_chars)
            self.expect_text(v, "answer", r.answer, self.cfg.max_answer_chars)
            if r.ttl_seconds > self.cfg.max_ttl_seconds:
                v.bad(INVALID, "ttl_seconds")
            if len(r.answer_token_ids) > len(r.answer.encode()) + 1:
                v.bad(INVALID, "answer_token_ids")
        elif rpc in ("Verify", "Invalidate"):
            which = r.WhichOneof("target") if rpc == "Invalidate" else "id"
            if which is None:
                v.bad(INVALID, "target")
            elif which == "namespace":
                self.expect_ns(v, r, erasing=True)  # an earlier release's lookalike, erased
            elif which == "tenant":
                if blank(r.tenant) or len(r.tenant) > self.cfg.max_tenant_chars:
                    v.bad(INVALID, "tenant")
            elif not r.id:
                v.bad(INVALID, "id")
            elif r.id not in self.entries.values():
                v.bad(NOT_FOUND, "id")
        return v

    @staticmethod
    def key_ns(ns) -> tuple[str, str, str]:
        return (ns.tenant, ns.model_id, ns.context_hash.lower())

    def apply(self, rpc: str, r, resp) -> None:
        """A request the model found fine succeeded: check the answer, update the model."""
        if rpc == "Lookup":
            key = (self.key_ns(r.namespace), r.text)
            if key in self.entries:
                assert resp.hit and resp.exact and resp.entry.id == self.entries[key], resp
            elif resp.hit:  # only a stored prompt of this namespace can be served
                assert resp.entry.id in self.entries.values(), resp
        elif rpc == "Store":
            key = (self.key_ns(r.namespace), r.prompt)
            if key in self.entries:  # the same prompt again replaces the answer
                self.gone.append(self.entries[key])
            self.entries[key] = resp.id
            self.verified[resp.id] = r.verified
        elif rpc == "Verify":
            assert resp.id == r.id and resp.verified == r.verified, resp
            self.verified[r.id] = r.verified
        elif rpc == "Invalidate":
            if r.WhichOneof("target") == "id":
                assert resp.removed == 1, resp
                gone = [k for k, i in self.entries.items() if i == r.id]
            elif r.WhichOneof("target") == "tenant":
                gone = [k for k in self.entries if k[0][0] == r.tenant]
                assert resp.removed == len(gone), (resp, gone)
            else:
                ns = self.key_ns(r.namespace)
                gone = [k for k in self.entries if k[0] == ns]
                assert resp.removed == len(gone), (resp, gone)
            for k in gone:
                self.gone.append(self.entries.pop(k))
        else:
            assert resp.entries == len(self.entries), (resp, len(self.entries))
        self.svc.cache.check_integrity()

    RPCS = ("Lookup", "Store", "Store", "Verify", "Invalidate", "Stats")


# ==== prefix =====================================================================================

BS = 4
MODELS = ("tiny", "other")


class PrefixWorld:
    """A served prefix index over a clock of its own, moved only between calls (no lease lapses,
    no hit halvings), and the model: replicas, their batch numbers, the chains they published."""

    def __init__(self, tmp: str) -> None:
        from services.prefix.config import PrefixConfig
        from services.prefix.index import PrefixIndex
        from services.prefix.server import serve

        self.now = 1000.0
        self.index = PrefixIndex(BS, lease_seconds=3600, max_nodes=100_000, max_events=6,
                                 max_blocks=12, verify_hashes=False, clock=lambda: self.now)
        self.svc = serve(PrefixConfig(address=f"127.0.0.1:{free_port()}", block_size=BS,
                                      metrics_port=-1), self.index)
        self.channel = grpc.insecure_channel(self.svc.address)
        self.stub = prefix_pb2_grpc.PrefixIndexStub(self.channel)
        self.replicas: dict[str, dict] = {}  # id -> incarnation, model, next_seq
        self.replaced: set[tuple[str, str]] = set()
        self.chains: dict[tuple[str, str, str], list[tuple[list[int], list[bytes]]]] = {}
        self.hashers = _Hashers(self.index.hash_key)

    def close(self) -> None:
        self.channel.close()
        self.svc.stop(0)

    def picture(self):
        # Nodes a resync or a clear left unheld are deleted by the sweeper thread, in steps:
        # its own pace, not the call's. Both pictures are taken once it is done.
        holds_within(lambda: not self.index.tree.unheld, 10, 0.002)
        with self.svc.servicer.lock:
            self.svc.servicer._gauges()
            st = self.index.stats()
            idx = dump(self.index, frozenset({"clock", "policy", "_hashers", "_verifiers",
                                              "on_drop", "_m"}))
            # Hasher caches: kept only for the models served (a refused Register of a made-up
            # model must not add one); one made early for a served model is a cache warmed.
            served = {rp.model_id for rp in self.index._replicas.values()}
            extra = (sorted(set(self.index._hashers) - served),
                     sorted(set(self.index._verifiers) - served))
            sl = dump(self.svc.servicer.shard_lists, frozenset({"clock", "_log"}))
        return {"stats": dump(st), "index": idx, "hashers": extra, "shard_lists": sl,
                "metrics": metrics_picture()}

    # -- requests --

    def some_replica(self, rng) -> tuple[str, str]:
        if self.replicas and rng.random() < 0.85:
            rid = pick(rng, sorted(self.replicas))
            return rid, self.replicas[rid]["inc"]
        return f"r{rng.randrange(4)}", f"i{rng.randrange(3)}"

    def chain(self, rng, model: str, salt: str = "") -> tuple[list[int], list[bytes]]:
        n = rng.randrange(1, 4)
        toks = [rng.randrange(50) for _ in range(n * BS)]
        return toks, self.hashers[model].hashes(toks, salt)

    def valid(self, rng, rpc: str):
        # Time moves between calls (leases of an hour never lapse in a run): a refused call
        # that renewed a lease or stamped a replica would show.
        self.now += 0.25
        if rpc == "Register":
            if self.replicas and rng.random() < 0.5:
                rid = pick(rng, sorted(self.replicas))
                inc, model = self.replicas[rid]["inc"], self.replicas[rid]["model"]
            else:
                rid, inc, model = (f"r{rng.randrange(4)}", f"i{rng.randrange(100)}",
                                   pick(rng, MODELS))
            return prefix_pb2.RegisterRequest(
                replica_id=rid, incarnation=inc, address=pick(rng, (
                    "127.0.0.1:7000", "kv-0.kv:50053", "[::1]:1", "fd00::5:50054")),
                model_id=model, block_size=BS, capacity_blocks=rng.randrange(100),
                hash_probe=(self.hashers[model].probe() if rng.random() < 0.5 else b""),
                shard_list=common_pb2.ShardList(shards=rng.randrange(3),
                                                fingerprint=pick(rng, ("", "a", "b"))))
        if rpc == "Heartbeat":
            rid, inc = self.some_replica(rng)
            free = rng.randrange(2**32)
            return prefix_pb2.HeartbeatRequest(replica_id=rid, incarnation=inc,
                                               load=prefix_pb2.ReplicaLoad(
                                                   running=rng.randrange(5), free_blocks=free,
                                                   total_blocks=rng.randrange(free, 2**32)))
        if rpc == "PublishEvents":
            rid, inc = self.some_replica(rng)
            rep = self.replicas.get(rid)
            model = rep["model"] if rep else "tiny"
            seq = rep["next"] if rep else 1
            events = []
            for _ in range(rng.randrange(1, 3)):
                kind = rng.random()
                if kind < 0.75:
                    salt = pick(rng, ("", "s1"))
                    toks, hs = self.chain(rng, model, salt)
                    known = self.chains.get((rid, model, salt))
                    if known and rng.random() < 0.4:  # a continuation of a published chain
                        ptoks, phs = pick(rng, known)
                        more = [rng.randrange(50) for _ in range(BS)]
                        hs2 = self.hashers[model].hashes(ptoks + more, salt)[len(phs):]
                        events.append(prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
                            parent_hash=phs[-1], block_hashes=hs2, token_ids=more,
                            first_block_hash=phs[0], start_block=len(phs))))
                    else:
                        events.append(prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
                            block_hashes=hs, token_ids=toks, cache_salt=salt,
                            first_block_hash=hs[0] if rng.random() < 0.7 else b"")))
                elif kind < 0.95:
                    known = [h for c in self.chains.get((rid, model, ""), []) for h in c[1]]
                    hs = rng.sample(known, min(len(known), 2)) or [bytes(16)]
                    events.append(prefix_pb2.KvEvent(removed=prefix_pb2.BlocksRemoved(
                        block_hashes=hs)))
                else:
                    events.append(prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared()))
            return prefix_pb2.PublishEventsRequest(replica_id=rid, incarnation=inc, seq=seq,
                                                   events=events)
        if rpc == "Match":
            model = pick(rng, MODELS)
            salt = pick(rng, ("", "s1"))
            toks, hs = self.chain(rng, model, salt)
            for (_, m, s), cs in self.chains.items():
                if m == model and s == salt and cs and rng.random() < 0.7:
                    toks, hs = pick(rng, cs)
            if rng.random() < 0.5:
                return prefix_pb2.MatchRequest(model_id=model, cache_salt=salt, token_ids=toks,
                                               probe=rng.random() < 0.2)
            return prefix_pb2.MatchRequest(model_id=model, block_hashes=hs,
                                           probe=rng.random() < 0.2,
                                           shard_list=common_pb2.ShardList(
                                               shards=rng.randrange(3), fingerprint="a"))
        if rpc == "TopPrefixes":
            r = prefix_pb2.TopPrefixesRequest(k=rng.randrange(1, 1001),
                                              model_id=pick(rng, ("",) + MODELS),
                                              min_hits=rng.randrange(3))
            if rng.random() < 0.3:
                r.cache_salt = pick(rng, ("", "s1"))
            return r
        return prefix_pb2.PrefixStatsRequest()

    def corruptions(self, rpc: str) -> list[Corruption]:
        def ids_empty(rng, r):
            setattr(r, pick(rng, ("replica_id", "incarnation")), "")

        def load_bad(rng, r):  # more free blocks than blocks
            r.load.total_blocks = min(r.load.total_blocks, 2**32 - 2)
            r.load.free_blocks = r.load.total_blocks + pick(rng, (1, 1000))

        def ids_odd(rng, r):
            setattr(r, pick(rng, ("replica_id", "incarnation")),
                    pick(rng, ("a b", "x" * 257, "a\0b", "tab\t", "new\nline", "é" * 3,
                               "\u3164")))

        def address_bad(rng, r):
            r.address = pick(rng, ("", "nohost", "host:0", "host:70000", "a b:1", ":1",
                                   "http://h:1", "h:1,h:2", "h:-1", "x" * 300 + ":1",
                                   "\u3164:1"))

        def model_bad(rng, r):
            r.model_id = pick(rng, ("", "m" * 257, "a\0b", "m" * 256, "a b", "unknown",
                                    "\u200b\u3164", "m\x1b[2J\n", "llama\u200b", "m\u2800"))

        def block_size_bad(rng, r):
            r.block_size = pick(rng, (0, BS + 1, 2**32 - 1, 1))

        def probe_bad(rng, r):
            r.hash_probe = pick(rng, (b"\0", bytes(15), bytes(17), bytes(16), b"x" * 1000))

        def seq_bad(rng, r):
            r.seq = pick(rng, (0, 2**64 - 1, 2**64 - 2, r.seq + 1, max(1, r.seq - 1)))

        def too_many_events(rng, r):
            while len(r.events) <= self.index.max_events:
                r.events.append(prefix_pb2.KvEvent(cleared=prefix_pb2.AllCleared()))

        def event_unset(rng, r):
            r.events.insert(rng.randrange(len(r.events) + 1), prefix_pb2.KvEvent())

        def stored(r):
            s = [e.stored for e in r.events if e.WhichOneof("event") == "stored"]
            if not s:
                r.events.append(prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
                    block_hashes=[bytes(range(16))], token_ids=[1] * BS)))
                s = [r.events[-1].stored]
            return s

        def hashes_bad(rng, r):
            s = pick(rng, stored(r))
            how = rng.randrange(5)
            if how == 0:
                del s.block_hashes[:]
            elif how == 1:
                s.block_hashes[rng.randrange(len(s.block_hashes))] = pick(
                    rng, (b"", b"\1" * 15, b"\1" * 17, b"\1" * 32))
            elif how == 2:  # a repeated hash, the tokens still filling the blocks
                s.block_hashes.append(s.block_hashes[0])
                s.token_ids.extend([1] * BS)
            elif how == 3:  # the chain's own root key (h_0) as a block
                h0 = self.hashers["tiny"].root(s.cache_salt)
                s.block_hashes[0] = h0
                if not s.parent_hash:
                    s.first_block_hash = b""
            else:
                s.block_hashes.append(bytes(16))  # no tokens for it

        def tokens_bad(rng, r):
            s = pick(rng, stored(r))
            if s.token_ids and rng.random() < 0.5:
                del s.token_ids[-1]
            else:
                s.token_ids.extend([7] * pick(rng, (1, BS, BS + 1)))

        def parent_bad(rng, r):
            s = pick(rng, stored(r))
            s.parent_hash = pick(rng, (b"\1", bytes(15), bytes(17),
                                       self.hashers["tiny"].root(""),
                                       self.hashers["other"].root(""), bytes(16)))

        def root_fields_bad(rng, r):
            s = pick(rng, stored(r))
            s.parent_hash = b""
            if rng.random() < 0.5:
                s.start_block = rng.randrange(1, 5)
            else:
                s.first_block_hash = pick(rng, (b"\2" * 16, b"\2"))

        def salt_bad(rng, r):
            s = pick(rng, stored(r))
            s.cache_salt = pick(rng, ("a\0", "s" * 257, "s" * 256))

        def removed_bad(rng, r):
            r.events.append(prefix_pb2.KvEvent(removed=prefix_pb2.BlocksRemoved(
                block_hashes=[pick(rng, (b"", b"\3" * 15, b"\3" * 16, b"\3" * 64))])))

        def too_many_blocks(rng, r):
            n = self.index.max_blocks + 1
            r.events.append(prefix_pb2.KvEvent(removed=prefix_pb2.BlocksRemoved(
                block_hashes=[bytes([i]) * 16 for i in range(n)])))

        def match_model_bad(rng, r):
            r.model_id = pick(rng, ("", "m" * 257, "unknown", "a\0b", "m\n", "m\u00a0x"))

        def match_inputs_bad(rng, r):
            how = rng.randrange(4)
            if how == 0:
                del r.token_ids[:]
                del r.block_hashes[:]
            elif how == 1:
                r.token_ids.extend([1] * BS)
                r.block_hashes.append(bytes(16))
            elif how == 2:
                del r.token_ids[:]
                del r.block_hashes[:]
                r.block_hashes.extend([pick(rng, (b"", b"\1" * 15, b"\1" * 17, bytes(16)))])
            else:
                del r.block_hashes[:]
                del r.token_ids[:]
                r.token_ids.extend([1] * (self.index.max_blocks * BS
                                          + pick(rng, (0, 1, BS - 1, BS, BS + 1))))

        def match_hashes_many(rng, r):
            del r.token_ids[:]
            del r.block_hashes[:]
            r.block_hashes.extend(bytes([i]) * 16 for i in range(
                self.index.max_blocks + pick(rng, (0, 1))))

        def match_salt_bad(rng, r):
            r.cache_salt = pick(rng, ("a\0", "s" * 257))

        def k_bad(rng, r):
            r.k = pick(rng, (0, 1001, 2**32 - 1, 1000, 1))

        def top_model(rng, r):  # empty = every model; blank, NUL or over 256 refused as by Match
            r.model_id = pick(rng, ("x" * 5000, "x" * 256, "a\0b", "", " ", "\u3164",
                                    "m\u2028"))
            r.min_hits = pick(rng, (0, 2**64 - 1))

        def top_salt(rng, r):  # a salt Match refuses is refused as a filter too
            r.cache_salt = pick(rng, ("a\0", "s" * 257, "s" * 256, ""))

        if rpc == "Register":
            return [ids_empty, ids_odd, address_bad, model_bad, block_size_bad, probe_bad]
        if rpc == "Heartbeat":
            return [ids_empty, ids_odd, load_bad]
        if rpc == "PublishEvents":
            return [ids_empty, seq_bad, too_many_events, event_unset, hashes_bad, tokens_bad,
                    parent_bad, root_fields_bad, salt_bad, removed_bad, too_many_blocks]
        if rpc == "Match":
            return [match_model_bad, match_inputs_bad, match_hashes_many, match_salt_bad]
        if rpc == "TopPrefixes":
            return [k_bad, top_model, top_salt]
        return []

    # -- the model of the docs --

    def root_keys(self) -> set[bytes]:
        return {self.hashers[m].root(s) for m in MODELS for s in ("", "s1", "s" * 256)}

    def expect(self, rpc: str, r) -> Verdict:
        v = Verdict()
        idx = self.index
        if rpc == "Register":
            for name in ("replica_id", "incarnation", "address", "model_id"):
                value = getattr(r, name)
                if blank(value) or len(value) > 256 or "\0" in value or (
                        name != "model_id" and (not value.isprintable()
                                                or any(c.isspace() for c in value))) or (
                        name == "model_id" and hidden(value)):
                    v.bad(INVALID, name)
            if r.address and not _host_port(r.address):
                v.bad(INVALID, "address")
            if r.hash_probe and len(r.hash_probe) != 16:
                v.bad(INVALID, "hash_probe")
            if not r.block_size:
                v.bad(INVALID, "block_size")
            if v.ok:
                if r.block_size != BS:
                    v.bad(FAILED, "block_size")
                if r.hash_probe and r.hash_probe != BlockHasher(
                        r.model_id, BS, idx.hash_key).probe():
                    v.bad(FAILED, "hash_probe")
                if (r.replica_id, r.incarnation) in self.replaced:
                    v.bad(FAILED, "incarnation")
        elif rpc == "Heartbeat":
            if not r.replica_id:
                v.bad(INVALID, "replica_id")
            if r.load.free_blocks > r.load.total_blocks:
                v.bad(INVALID, "load.free_blocks")
        elif rpc == "PublishEvents":
            # Either flaw may be named first: the replica's, the batch number's or an event's.
            rep = self.replicas.get(r.replica_id)
            if not r.replica_id:
                v.bad(INVALID, "replica_id")
            elif rep is None:
                v.bad(NOT_FOUND, "replica_id")
            elif rep["inc"] != r.incarnation:
                v.bad(NOT_FOUND, "incarnation")
            if not 1 <= r.seq <= 2**64 - 2:
                v.bad(INVALID, "seq")
            if len(r.events) > idx.max_events:
                v.bad(EXHAUSTED, "events")
            flaws, soft = Verdict(), Verdict()
            self.expect_events(flaws, r, soft)
            strict = v.ok and flaws.ok  # nothing but soft flaws, if any
            v.refusals += flaws.refusals + soft.refusals
            v.may_pass = strict and not soft.ok
            if rep is not None and rep["inc"] == r.incarnation and v.refusals == \
                    flaws.refusals + soft.refusals and (r.seq < rep["next"] or
                                        (r.seq > rep["next"] and not r.resync)):
                # A retry (acknowledged) or a gap (RESYNC): the batch is not applied, and the
                # docs do not say whether its events are looked at.
                v.may_pass = True
        elif rpc == "Match":
            if (not r.model_id or len(r.model_id) > 256 or blank(r.model_id)
                    or hidden(r.model_id)):  # a NUL is a control character
                v.bad(INVALID, "model_id")
            if r.token_ids and r.block_hashes:
                v.bad(INVALID, "token_ids")
            elif r.block_hashes:
                if len(r.block_hashes) > idx.max_blocks:
                    v.bad(INVALID, "block_hashes")
                for i, h in enumerate(r.block_hashes):
                    if len(h) != 16:
                        v.bad(INVALID, f"block_hashes[{i}]")
            elif r.token_ids:
                if len(r.token_ids) // BS > idx.max_blocks:  # full blocks (the proto)
                    v.bad(INVALID, "token_ids")
                if len(r.cache_salt) > 256 or "\0" in r.cache_salt:
                    v.bad(INVALID, "cache_salt")
            else:
                v.bad(INVALID, "token_ids")
        elif rpc == "TopPrefixes":
            if not 1 <= r.k <= 1000:
                v.bad(INVALID, "k")
            if r.model_id and (blank(r.model_id) or len(r.model_id) > 256
                               or hidden(r.model_id)):
                v.bad(INVALID, "model_id")
            if r.HasField("cache_salt") and (len(r.cache_salt) > 256 or "\0" in r.cache_salt):
                v.bad(INVALID, "cache_salt")
        return v

    def expect_events(self, v: Verdict, r, soft: Verdict) -> None:
        """The flaws of a batch's events: into `v` those the docs refuse, into `soft` those a
        root key of another model or salt makes (refused only where the index knows that root:
        the docs are silent, so either answer is taken)."""
        rep = self.replicas.get(r.replica_id)
        model = rep["model"] if rep else None
        blocks, roots = 0, self.root_keys()
        for i, e in enumerate(r.events):
            which = e.WhichOneof("event")
            f = f"events[{i}]"
            if which is None:
                v.bad(INVALID, f)
            elif which == "removed":
                blocks += len(e.removed.block_hashes)
                for j, h in enumerate(e.removed.block_hashes):
                    if len(h) != 16:
                        v.bad(INVALID, f"{f}.removed.block_hashes[{j}]")
            elif which == "stored":
                s = e.stored
                blocks += len(s.block_hashes)
                hf = f"{f}.stored.block_hashes"
                salt_ok = len(s.cache_salt) <= 256 and "\0" not in s.cache_salt
                own = self.hashers[model].root(s.cache_salt) if model and salt_ok else None
                if not s.block_hashes:
                    v.bad(INVALID, hf)
                for j, h in enumerate(s.block_hashes):
                    if len(h) != 16:
                        v.bad(INVALID, f"{hf}[{j}]")
                if len(s.token_ids) != BS * len(s.block_hashes):
                    v.bad(INVALID, f"{f}.stored.token_ids")
                if len(set(s.block_hashes)) != len(s.block_hashes):
                    v.bad(INVALID, hf)
                if not s.parent_hash and own in s.block_hashes:
                    v.bad(INVALID, hf)  # its own chain's root key (h_0) as one of its blocks
                elif set(s.block_hashes) & (roots | {own}):
                    soft.bad(INVALID, hf)
                if s.parent_hash:
                    if len(s.parent_hash) != 16 or s.parent_hash == own:
                        v.bad(INVALID, f"{f}.stored.parent_hash")
                    elif s.parent_hash in roots:
                        soft.bad(INVALID, f"{f}.stored.parent_hash")
                else:
                    if s.start_block:
                        v.bad(INVALID, f"{f}.stored.start_block")
                    if s.first_block_hash and s.block_hashes and \
                            s.first_block_hash != s.block_hashes[0]:
                        v.bad(INVALID, f"{f}.stored.first_block_hash")
                    if not salt_ok:
                        v.bad(INVALID, f"{f}.stored.cache_salt")
        if blocks > self.index.max_blocks:
            v.bad(EXHAUSTED, "events")

    def apply(self, rpc: str, r, resp) -> None:
        if rpc == "Register":
            rep = self.replicas.get(r.replica_id)
            if rep and rep["inc"] == r.incarnation and rep["model"] == r.model_id:
                assert resp.next_seq == rep["next"], (resp, rep)
            else:
                if rep and rep["inc"] != r.incarnation:
                    self.replaced.add((r.replica_id, rep["inc"]))
                for k in [k for k in self.chains if k[0] == r.replica_id]:
                    del self.chains[k]
                assert resp.next_seq == 1, resp
                self.replicas[r.replica_id] = {"inc": r.incarnation, "model": r.model_id,
                                               "next": 1}
            assert resp.lease_seconds == 3600 and resp.max_events == self.index.max_events
        elif rpc == "Heartbeat":
            rep = self.replicas.get(r.replica_id)
            assert resp.known == (rep is not None and rep["inc"] == r.incarnation), resp
        elif rpc == "PublishEvents":
            rep = self.replicas[r.replica_id]
            if r.seq < rep["next"]:
                assert resp.status == prefix_pb2.PUBLISH_STATUS_OK, resp
            elif r.seq > rep["next"] and not r.resync:
                assert resp.status == prefix_pb2.PUBLISH_STATUS_RESYNC, resp
            else:
                assert resp.status == prefix_pb2.PUBLISH_STATUS_OK, resp
                rep["next"] = r.seq + 1
                self.record_chains(r, rep)
            assert resp.next_seq == rep["next"], (resp, rep)
        elif rpc == "Match":
            live = {k for k, rp in self.replicas.items() if rp["model"] == r.model_id}
            assert {m.replica_id for m in resp.matches} == live, (resp, live)
            n = len(r.block_hashes) if r.block_hashes else len(r.token_ids) // BS
            assert resp.request_blocks == n and resp.block_size == BS, resp
        elif rpc == "TopPrefixes":
            assert len(resp.prefixes) <= r.k
        else:
            assert sorted(x.replica_id for x in resp.replicas) == sorted(self.replicas), resp
        self.index.check_integrity()

    def record_chains(self, r, rep) -> None:
        """Chains stored from the root are remembered (for continuations and Match); any
        removal or clear forgets the replica's chains (the model keeps no finer view)."""
        key = (r.replica_id, rep["model"])
        for e in r.events:
            which = e.WhichOneof("event")
            if which == "stored" and not e.stored.parent_hash:
                s = e.stored
                self.chains.setdefault((*key, s.cache_salt), []).append(
                    (list(s.token_ids), list(s.block_hashes)))
            elif which in ("removed", "cleared"):
                for k in [k for k in self.chains if k[:2] == key]:
                    del self.chains[k]

    RPCS = ("Register", "Heartbeat", "PublishEvents", "PublishEvents", "Match", "TopPrefixes",
            "Stats")


class _Hashers(dict):
    """model id -> BlockHasher of the index's block size and key, made when first asked."""

    def __init__(self, key) -> None:
        super().__init__()
        self.key = key

    def __missing__(self, model: str) -> BlockHasher:
        self[model] = BlockHasher(model, BS, self.key)
        return self[model]


def _host_port(a: str) -> bool:
    """host:port as prefix.proto's RegisterRequest.address reads (a port 1..65535, a host
    without spaces, commas or slashes; a bare IPv6 address allowed)."""
    host, sep, port = a.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        return False
    return not any(c.isspace() or c in ",;/" for c in host) and not blank(host)


# ==== kvpool =====================================================================================


class KvWorld:
    """The tiny model's replica behind KvPoolServicer (as tests/kvpool/test_kvpool_server.py
    starts it), with pins long enough to outlive a run."""

    def __init__(self, tmp: str, model) -> None:
        from services.common.bootstrap import create_server
        from services.kvpool.app import build_replica
        from services.kvpool.config import KvPoolConfig
        from services.kvpool.server import KvPoolServicer
        from tests.kvpool.conftest import TINY_ID

        self.cfg = KvPoolConfig(address=f"127.0.0.1:{free_port()}", metrics_port=-1, num_blocks=24,
                                block_size=4, max_batch_size=4, max_prefill_chunk=16,
                                max_new_tokens_limit=12, replica_id="kv-diff",
                                pin_ttl_max_seconds=3600, max_context=120,
                                draft_ladder="2,4,8")  # not timed at start
        self.servicer = KvPoolServicer(self.cfg)
        self.handle = create_server(
            service="kvpool", address=self.cfg.address,
            services=[(kvpool_pb2_grpc.add_KvPoolServicer_to_server, self.servicer,
                       "tiercache.v1.KvPool")])
        self.replica = build_replica(self.cfg, model=model, model_id=TINY_ID, metrics=False)
        self.servicer.attach(self.replica.engine, self.replica.info)
        self.handle.set_serving()
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.handle.port}")
        self.stub = kvpool_pb2_grpc.KvPoolStub(self.channel)
        self.info = self.replica.info
        self.pool = self.replica.engine.pool
        self.model_id = TINY_ID

    def close(self) -> None:
        self.channel.close()
        self.handle.stop(0)
        self.replica.engine.stop()

    def idle(self) -> None:
        from tests.kvpool.conftest import assert_idle

        assert_idle(self.replica.engine)

    def picture(self):
        self.idle()
        eng = self.replica.engine
        st = self.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=10)
        st.stalled_for_s = 0  # time, not state
        pool = eng.call(lambda: dump(self.pool, frozenset({"hasher", "policy", "clock"})))
        return {"stats": str(st).splitlines(), "pool": pool.result(10), "queued": eng._queued,
                "engine_stats": repr(eng.stats()), "metrics": metrics_picture()}

    # -- requests --

    def tokens(self, rng, lo: int = 1, hi: int = 20) -> list[int]:
        base = [5, 9, 17, 33, 2, 8, 44, 61, 70, 3, 12, 99, 100, 7, 1, 2, 3, 4, 5, 6]
        n = rng.randrange(lo, hi + 1)
        return base[:n] if rng.random() < 0.5 else [rng.randrange(self.info.vocab_size - 1)
                                                    for _ in range(n)]

    def valid(self, rng, rpc: str):
        if rpc == "Generate":
            sp = common_pb2.SamplingParams(
                max_tokens=rng.randrange(1, 5), temperature=pick(rng, (0.0, 0.0, 0.7, 5.0)),
                top_p=pick(rng, (0.0, 1.0, 0.5, 1e-6)), seed=pick(rng, (0, 1, 2**64 - 1)),
                stop_token_ids=rng.sample(range(self.info.vocab_size), rng.randrange(3)),
                ignore_eos=rng.random() < 0.2)
            return kvpool_pb2.KvGenerateRequest(
                request_id=pick(rng, ("", "r-1", "x y", "z" * 200)), token_ids=self.tokens(rng),
                sampling=sp, cache_salt=pick(rng, ("", "t1", "s" * 256)),
                skip_prefix_cache=rng.random() < 0.2,
                draft_token_ids=self.tokens(rng, 0, 6),
                model_id=pick(rng, ("", self.model_id)), seed_offset=rng.randrange(2**32))
        if rpc == "Prefill":
            pin = rng.random() < 0.4
            return kvpool_pb2.PrefillRequest(
                token_ids=self.tokens(rng, 4 if pin else 1), cache_salt=pick(rng, ("", "t1")),
                pin=pin, ttl_seconds=rng.randrange(1, 5000) if pin else 0,
                model_id=pick(rng, ("", self.model_id)))
        return kvpool_pb2.KvStatsRequest()

    def corruptions(self, rpc: str) -> list[Corruption]:
        vocab = self.info.vocab_size

        def model_other(rng, r):
            r.model_id = pick(rng, ("other", self.model_id + " ", "x" * 5000))

        def tokens_empty(rng, r):
            del r.token_ids[:]

        def tokens_vocab(rng, r):
            r.token_ids.insert(rng.randrange(len(r.token_ids) + 1),
                               pick(rng, (vocab, vocab + 1, 2**32 - 1, vocab - 1)))

        def tokens_long(rng, r):
            r.token_ids.extend([3] * pick(rng, (60, 76, 92, 96, 97, 100, 119, 120, 121, 200)))

        def salt_bad(rng, r):
            r.cache_salt = pick(rng, ("a\0b", "s" * 257, "s" * 256))

        def max_tokens_bad(rng, r):
            r.sampling.max_tokens = pick(rng, (0, -1, -2**31, 13, 2**31 - 1, 12))

        def temperature_bad(rng, r):
            r.sampling.temperature = pick(rng, (-0.5, math.nan, math.inf, -math.inf, -0.0,
                                                1e-30))

        def top_p_bad(rng, r):
            r.sampling.top_p = pick(rng, (-0.1, 1.5, math.nan, math.inf, -math.inf, 1.0000001,
                                          1e-30))

        def stops_bad(rng, r):
            del r.sampling.stop_token_ids[:]
            r.sampling.stop_token_ids.extend(pick(rng, (
                [vocab], [2**32 - 1], list(range(257)), [1] * 256, [vocab - 1])))

        def draft_bad(rng, r):
            at = rng.randrange(len(r.draft_token_ids) + 1)
            r.draft_token_ids.insert(at, pick(rng, (vocab, 2**32 - 1)))

        def no_sampling(rng, r):
            r.ClearField("sampling")

        def ttl_bad(rng, r):
            r.pin = True
            r.ttl_seconds = pick(rng, (0, 0, 2**32 - 1))

        def ttl_without_pin(rng, r):  # a pin's lifetime, no pin: not ignored
            r.pin, r.ttl_seconds = False, pick(rng, (1, 60, 2**32 - 1))

        def short_pin(rng, r):
            r.pin, r.ttl_seconds = True, 60
            del r.token_ids[self.pool.block_size - 1:]

        if rpc == "Generate":
            return [model_other, tokens_empty, tokens_vocab, tokens_long, salt_bad,
                    max_tokens_bad, temperature_bad, top_p_bad, stops_bad, draft_bad,
                    no_sampling]
        if rpc == "Prefill":
            return [model_other, tokens_empty, tokens_vocab, tokens_long, salt_bad, ttl_bad,
                    ttl_without_pin, short_pin]
        return []

    # -- the model of the docs --

    def expect(self, rpc: str, r) -> Verdict:
        v = Verdict()
        info, vocab = self.info, self.info.vocab_size
        if rpc == "Stats":
            return v
        if r.model_id and r.model_id != self.model_id:
            v.bad(FAILED, "model_id")
        if not r.token_ids or any(t >= vocab for t in r.token_ids):
            v.bad(INVALID, "token_ids")
        if len(r.cache_salt) > 256 or "\0" in r.cache_salt:
            v.bad(INVALID, "cache_salt")
        if rpc == "Generate":
            sp = r.sampling
            if not 0 < sp.max_tokens <= self.cfg.max_new_tokens_limit:
                v.bad(INVALID, "sampling.max_tokens")
            if not math.isfinite(sp.temperature) or sp.temperature < 0:
                v.bad(INVALID, "sampling.temperature")
            if sp.top_p != 0 and not 0 < sp.top_p <= 1:  # NaN fails it too
                v.bad(INVALID, "sampling.top_p")
            if len(sp.stop_token_ids) > 256 or any(t >= vocab for t in sp.stop_token_ids):
                v.bad(INVALID, "sampling.stop_token_ids")
            # Draft tokens past max_tokens are dropped unread (test_kvpool_server.py).
            if any(t >= vocab for t in r.draft_token_ids[:max(sp.max_tokens, 0)]):
                v.bad(INVALID, "draft_token_ids")
            if sp.max_tokens > 0 and len(r.token_ids) + sp.max_tokens > info.max_context:
                v.bad(INVALID, "token_ids")
            if sp.max_tokens > 0 and self.pool.blocks_needed(
                    len(r.token_ids) + sp.max_tokens - 1) > self.pool.num_blocks:
                v.bad(EXHAUSTED, "token_ids")
        else:
            if len(r.token_ids) > info.max_context:
                v.bad(INVALID, "token_ids")
            if self.pool.blocks_needed(len(r.token_ids)) > self.pool.num_blocks:
                v.bad(EXHAUSTED, "token_ids")
            if r.pin and r.ttl_seconds <= 0 or not r.pin and r.ttl_seconds:
                v.bad(INVALID, "ttl_seconds")
            if r.pin and len(r.token_ids) < self.pool.block_size:
                v.bad(INVALID, "token_ids")
        return v

    def apply(self, rpc: str, r, resp) -> None:
        if rpc == "Generate":
            toks = [t for m in resp for t in m.token_ids]
            finals = [m.final for m in resp if m.HasField("final")]
            assert len(finals) == 1 and resp[-1].HasField("final"), resp
            f = finals[0]
            assert f.usage.prompt_tokens == len(r.token_ids), f
            assert f.usage.completion_tokens == len(toks) <= r.sampling.max_tokens, (f, toks)
        elif rpc == "Prefill":
            assert resp.prompt_tokens == len(r.token_ids), resp
            assert resp.cached_tokens + resp.computed_tokens == resp.prompt_tokens, resp
            if not r.pin:
                assert resp.pinned_blocks == 0, resp
        else:
            assert resp.blocks_free + resp.blocks_cached + resp.blocks_pinned + \
                resp.blocks_in_use == resp.blocks_total, resp

    RPCS = ("Generate", "Generate", "Prefill", "Stats")


# ---- one seed ---------------------------------------------------------------------------------


def run_seed(world, seed: int, steps: int, corrupt_p: float = 0.7,
             log: list | None = None) -> None:
    """`steps` random calls to `world`, most of them corrupted; every answer compared with
    the model (a Divergence or an AssertionError says where)."""
    rng = random.Random(seed)
    for step in range(steps):
        rpc = pick(rng, world.RPCS)
        req = world.valid(rng, rpc)
        done = corrupt(rng, req, world.corruptions(rpc)) if (
            world.corruptions(rpc) and rng.random() < corrupt_p) else []
        verdict = world.expect(rpc, req)
        what = f"seed {seed} step {step} {rpc}{done}"
        before = world.picture() if not verdict.ok else None
        resp, err = call(getattr(world.stub, rpc), req)
        if log is not None:
            log.append((what, verdict.refusals, err and err.code(), err and err.details()))
        if verdict.ok or (verdict.may_pass and err is None):
            if err is not None:
                if rpc == "Prefill" and req.pin and err.code() == EXHAUSTED and \
                        "pin" in (err.details() or ""):
                    continue  # the pool's pin limits (documented; the work stays cached)
                raise Divergence(f"{what}: refused {err.code().name} {err.details()!r}; the "
                                 f"docs allow it: {str(req)[:400]}")
            try:
                world.apply(rpc, req, resp)
            except AssertionError as e:
                raise Divergence(f"{what}: answer differs from the model: {e}") from e
        else:
            check_refusal(what, verdict, err, before, world.picture())


# ---- the bounded tests --------------------------------------------------------------------------

STEPS = 30


@pytest.fixture(scope="module")
def semantic_world(tmp_path_factory):
    w = SemanticWorld(str(tmp_path_factory.mktemp("semantic")))
    yield w
    w.close()


@pytest.fixture(scope="module")
def prefix_world(tmp_path_factory):
    w = PrefixWorld(str(tmp_path_factory.mktemp("prefix")))
    yield w
    w.close()


@pytest.fixture(scope="module")
def kv_world(tmp_path_factory):
    from tests.kvpool.conftest import make_tiny_model

    w = KvWorld(str(tmp_path_factory.mktemp("kvpool")), make_tiny_model())
    yield w
    w.close()


@pytest.mark.parametrize("seed", range(SEEDS or 5))
def test_semantic_bad_input_is_named_and_leaves_no_state(semantic_world, seed):
    run_seed(semantic_world, seed, STEPS)


@pytest.mark.parametrize("seed", range(SEEDS or 6))
def test_prefix_bad_input_is_named_and_leaves_no_state(prefix_world, seed):
    run_seed(prefix_world, seed, STEPS)


@pytest.mark.parametrize("seed", range(SEEDS or 8))
def test_kvpool_bad_input_is_named_and_leaves_no_state(kv_world, seed):
    run_seed(kv_world, seed, STEPS)
