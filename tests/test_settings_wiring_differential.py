"""A differential review of the settings wiring: from each documented setting (docs/settings.md)
to the running object it names, through the real construction code.

The model is a table written from docs/settings.md and the config classes' comments and
refusals (each setting's documented range: both bounds, values just inside them, and the
cross-field rules), and for each setting the observable effect its meaning promises on the
object built from it, in the documented unit: kvpool NUM_BLOCKS / KV_CACHE_BYTES -> the block
pool's capacity (as many whole blocks as the bytes hold, each block 2 x layers x kv heads x
head dim x block_size x the dtype's bytes, counted here from the model's own config), the
engine's batch, prefill chunk, waiting room, draft knobs, threads (a forward of fewer than
one_thread_below tokens on one thread), the pins' share of the pool, the served context; the
__main__'s server (worker threads max_batch_size + max_waiting + 16, metrics port -1 = off),
publisher (heartbeat, publish interval, the advertised address or else the listening one) and
watchdog; semantic tiers -> the policy's thresholds (the default tier's, an explicit threshold
under the floor refused), the guard and verifier tiers, the index parameters, SQLite's
`PRAGMA synchronous`, the housekeeper's periods, the embedder (its model folder, name, threads,
spinning, exporter; the micro-batch size and the wait in milliseconds -> seconds), the
refusal points of the text, answer, tenant and TTL limits, the TTL an entry gets by default,
the entry caps (a namespace / tenant / shard holds at most its cap); orchestrator timeouts ->
the backends' timeouts (seconds), the replica set's polling, the routing policy and its
parameters, dispatch memory (0 = none), the tenants' default limits (automatic concurrency:
16 with tokens but within the stream slots, every slot without), the tokens watcher (0 = read
once), the warm loop (runs only with an interval, a top_k and an index), the sampling
defaults and refusal points, the renderer's character limit, and the __main__'s server
(workers, the concurrent-call cap, 0 = gRPC's own default; message size; connection age,
its grace covering a whole request); prefix -> the index's parameters (max_blocks within one
gRPC message: `batch_blocks`) and its server. Random invalid values (one past each bound,
a number that is no number, an empty value) must be refused by `load_config` naming the
variable. Where the docs are silent the model asserts invariants only: the pin shares are
floored to whole blocks but at least one; a max_context past the model's serves the model's.

Heavy parts replaced at the code's own seams: kvpool builds on make_tiny_model (given to
`build_replica`, or saved as a local model folder for `load_model`, the documented "path of a
local HF model folder"), draft-ladder timings on a fixed cost table; the orchestrator's
tokenizer is a byte-level stand-in behind `load_resolved`; semantic's ONNX embedder is a
hashing stand-in behind `OnnxEmbedder`; every __main__ runs with `create_server` /
`run_until_signal` recorded (no port, no signal).

Run by hand: WIRING_SEEDS=400 (kvpool 400 builds, a third through a model folder; the
orchestrator 400; prefix 2,000; each __main__ 133) and WIRING_SEEDS=200 for semantic (200
services on SQLite); every numeric setting's bounds and one past each (deterministic). Found:
semantic `max_ttl_seconds` said "a longer one is cut to it", but a Store asking for more is
refused (INVALID_ARGUMENT, as tests/semantic/test_grpc.py pins): the docs were fixed; prefix
`max_blocks` is lowered (logged) to what one gRPC message carries at large block sizes, which
docs/settings.md did not say: now it does. Reported, asserted only as invariants: kvpool
`max_context` past the model's positions serves the model's without a word; preallocated rows
are whole blocks per row (up to a block more than max_batch_size x max_context tokens); the
orchestrator's connection-age grace is max(request_timeout_s, 120 s) (a Warm's deadline),
where the docs say request_timeout_s.
Teeth (seeds failing): kvpool per-tenant pin share taken from max_pinned_fraction 13 of 100;
the pool recording events without a prefix index 38 of 60; the semantic backend given the
prefix timeout 99 of 100; the embedder's wait given in seconds as milliseconds 15 of 40; the
prefix half-life taken from lease_seconds 426 of 500; kvpool __main__ workers without the 16
spare and orchestrator max_concurrent_rpcs 0 passed on as 0: the first seeds.

More seeds: WIRING_SEEDS=400 pytest tests/test_settings_wiring_differential.py
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import random
import string
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from services.common.config import MAX_FLOAT_SETTING, ConfigError, env_name, load_config
from services.kvpool.config import MAX_BLOCKS, KvPoolConfig
from services.kvpool.drafting import choose_ladder
from services.orchestrator.config import STREAM_HEADROOM, OrchestratorConfig
from services.prefix.config import PrefixConfig
from services.semantic.config import SemanticConfig

SEEDS = int(os.environ.get("WIRING_SEEDS", "6"))

# ---- the documented ranges --------------------------------------------------------------
# kind, lo, hi (inclusive; None = no upper bound but MAX_FLOAT_SETTING for floats), and the
# values that are also taken outside them (an "off" value). Written from docs/settings.md and
# the refusals' wording in the config classes.
INF = None


def R(kind: str, lo=None, hi=None, off=(), lo_open=False, hi_open=False):
    return types.SimpleNamespace(kind=kind, lo=lo, hi=hi, off=tuple(off), lo_open=lo_open,
                                 hi_open=hi_open)


KV_RANGES = {
    "num_blocks": R("int", 0, MAX_BLOCKS), "kv_cache_bytes": R("int", 1, None),
    "block_size": R("int", 1, 1024), "max_batch_size": R("int", 1, 256),
    "max_prefill_chunk": R("int", 1, None), "max_new_tokens_limit": R("int", 1, None),
    "max_waiting": R("int", 1, None), "metrics_port": R("int", -1, 65535),
    "heartbeat_seconds": R("float", 0.1, None), "publish_interval_seconds": R("float", 0.01, None),
    "max_draft_tokens": R("int", 1, 64), "draft_branches": R("int", 1, 16),
    "shallow_tokens": R("int", 0, None), "pin_ttl_max_seconds": R("int", 1, None),
    "max_pinned_fraction": R("float", 0, 1, lo_open=True),
    "torch_threads": R("int", 0, 1024), "one_thread_below": R("int", 0, None),
    "max_context": R("int", 2, None, off=(0,)), "grace_seconds": R("float", 0, None),
    "engine_stall_seconds": R("float", 5, None, off=(0,)),
    "send_stall_seconds": R("float", 1, None, off=(0,)),
}
ORCH_RANGES = {
    "metrics_port": R("int", -1, 65535), "block_size": R("int", 1, 1024),
    "tokens_reload_s": R("float", 0.5, None, off=(0,)),
    "max_tokens_limit": R("int", 1, 2**31 - 1), "max_prompt_tokens": R("int", 1, None),
    "max_message_chars": R("int", 1, None), "max_request_bytes": R("int", 65536, 2**31 - 1),
    "max_concurrent_per_tenant": R("int", 0, None),
    "request_timeout_s": R("float", 0, None, lo_open=True),
    "semantic_timeout_s": R("float", 0, None, lo_open=True),
    "prefix_timeout_s": R("float", 0, None, lo_open=True),
    "routing_epsilon": R("float", 0, None, lo_open=True),
    "routing_load_window_s": R("float", 0, None, lo_open=True),
    "routing_load_floor": R("int", 0, 1024), "min_prefix_tokens": R("int", 1, None),
    "dispatch_memory_s": R("float", 0, None), "replica_poll_s": R("float", 0.01, None),
    "replica_stats_timeout_s": R("float", 0, None, lo_open=True),
    "replica_hung_polls": R("int", 1, 100), "replica_stall_s": R("float", 0, None),
    "warm_top_k": R("int", 0, None), "warm_max_load": R("float", 0, None),
    "warm_max_prompts_per_cycle": R("int", 0, None), "warm_min_hits": R("int", 1, 2**63),
    "warm_pin_ttl_s": R("int", 1, None), "warm_max_prefills_per_call": R("int", 1, 4096),
    "max_attempts": R("int", 1, None), "max_workers": R("int", STREAM_HEADROOM + 1, None),
    "grace_s": R("float", 0, None), "max_connection_age_s": R("float", 0, None),
}
SEM_RANGES = {
    "metrics_port": R("int", -1, 65535), "onnx_threads": R("int", 0, 1024),
    "max_batch": R("int", 1, 1024), "batch_wait_ms": R("float", 0, 100),
    "snapshot_interval_s": R("float", 1, None, off=(0,)), "hnsw_min_entries": R("int", 1, None),
    "hnsw_m": R("int", 4, 128), "hnsw_ef_construction": R("int", 8, 32768),
    "hnsw_ef_search": R("int", 8, 32768), "faiss_threads": R("int", 1, 1024),
    "delta_capacity": R("int", 1, None), "threshold_floor": R("float", 0, 1, lo_open=True),
    "verified_bonus": R("float", 0, 0.2, hi_open=True),
    "default_ttl_seconds": R("int", 0, None), "max_ttl_seconds": R("int", 1, 2**32 - 1),
    "max_entries_per_namespace": R("int", 1, None), "max_entries_total": R("int", 1, None),
    "max_entries_per_tenant": R("int", 0, None), "max_text_chars": R("int", 1, None),
    "max_answer_chars": R("int", 1, None), "max_tenant_chars": R("int", 64, None),
    "grace_seconds": R("float", 0, None), "index_close_seconds": R("float", 0, None),
    "expiry_interval_s": R("float", 0.1, None),
}
PREFIX_RANGES = {
    "metrics_port": R("int", -1, 65535), "block_size": R("int", 1, 1024),
    "lease_seconds": R("float", 0.1, None), "max_nodes": R("int", 1, 2**64 - 1),
    "prune_to": R("float", 0, 0.99, lo_open=True), "prune_step": R("int", 1, None),
    "shallow_tokens": R("int", 0, None), "min_deep_hits": R("int", 0, None),
    "cold_after_ticks": R("int", 0, None),
    "hit_half_life_seconds": R("float", 0.1, None, off=(0,)),
    "max_events": R("int", 1, 2**32 - 1), "max_blocks": R("int", 1, 2**32 - 1),
    "grace_seconds": R("float", 0, None),
}
RANGES = {"kvpool": KV_RANGES, "orchestrator": ORCH_RANGES, "semantic": SEM_RANGES,
          "prefix": PREFIX_RANGES}
CLASSES = {"kvpool": KvPoolConfig, "orchestrator": OrchestratorConfig,
           "semantic": SemanticConfig, "prefix": PrefixConfig}


def draw(rng: random.Random, r, lo=None, hi=None):
    """A value in the documented range (narrowed to [lo, hi] where a build must stay small):
    a bound, a value just inside one, the off value, or anything between."""
    lo = r.lo if lo is None else lo
    hi = r.hi if hi is None else hi
    if r.kind == "int":
        top = hi if hi is not None else max(lo, 1) * rng.choice((2, 10, 1000, 10**6))
        pick = rng.choice(("lo", "lo+", "hi", "hi-", "mid", "mid", "off"))
        if pick == "off" and r.off:
            return rng.choice(r.off)
        lo_v = lo + (1 if r.lo_open else 0)
        hi_v = top - (1 if r.hi_open else 0)
        v = {"lo": lo_v, "lo+": lo_v + 1, "hi": hi_v, "hi-": hi_v - 1}.get(pick)
        if v is None:
            v = rng.randint(lo_v, max(lo_v, hi_v))
        return min(max(v, lo_v), max(lo_v, hi_v))
    top = hi if hi is not None else (MAX_FLOAT_SETTING if rng.random() < 0.1
                                     else max(lo, 1.0) * rng.choice((2, 10, 100)))
    eps = 1e-6 * max(1.0, abs(top))
    pick = rng.choice(("lo", "lo+", "hi", "hi-", "mid", "mid", "off"))
    if pick == "off" and r.off:
        return float(rng.choice(r.off))
    lo_v = lo + (eps if r.lo_open else 0.0)
    hi_v = top - (eps if r.hi_open else 0.0)
    v = {"lo": lo_v, "lo+": lo_v + eps, "hi": hi_v, "hi-": hi_v - eps}.get(pick)
    if v is None:
        v = rng.uniform(lo_v, hi_v)
    return min(max(v, lo_v), hi_v)


def env_of(service: str, values: dict) -> dict[str, str]:
    """The variables that set `values` (as a manifest would write them)."""
    out = {}
    for k, v in values.items():
        if isinstance(v, bool):
            s = random.Random(k).choice(("true", "1", "yes", "on")) if v else "false"
        elif isinstance(v, tuple):
            s = ",".join(v)
        elif isinstance(v, float):
            s = repr(v)
        else:
            s = str(v)
        out[env_name(service, k)] = s
    return out


def loaded(service: str, values: dict):
    """The config as `load_config` reads it from the variables of `values`."""
    cfg = load_config(CLASSES[service], service, [], env_of(service, values))
    for k, v in values.items():  # the loader itself is the config differential's subject
        got = getattr(cfg, k)
        assert got == v or (isinstance(v, float) and math.isclose(got, v)), (k, got, v)
    return cfg


def token(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_letters + string.digits + "-_.~!")
                   for _ in range(rng.randint(16, 40)))


def addresses(rng: random.Random, n: int) -> tuple[str, ...]:
    ports = rng.sample(range(1, 65536), n)
    return tuple(rng.choice(("127.0.0.1", "localhost", "[::1]")) + f":{p}" for p in ports)


@contextlib.contextmanager
def attr(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


class Calls:
    """A stand-in that records how it was called (and returns `result(...)`)."""

    def __init__(self, result=None) -> None:
        self.calls: list[tuple[tuple, dict]] = []
        self.result = result

    def __call__(self, *a, **kw):
        self.calls.append((a, kw))
        return self.result(*a, **kw) if self.result else None

    @property
    def kw(self) -> dict:
        assert len(self.calls) == 1, self.calls
        return self.calls[0][1]


class FakeHandle:
    port = 1
    address = "127.0.0.1:1"

    def __init__(self) -> None:
        self.stopped = threading.Event()
        self.draining = threading.Event()  # ServerHandle's: kvpool's Stats reads it
        self.serving = False

    def set_serving(self) -> None:
        self.serving = True

    def stop(self, grace=None) -> None:
        self.stopped.set()


# ---- kvpool --------------------------------------------------------------------------------

def kv_values(rng: random.Random, folder: str | None) -> dict:
    """A random valid kvpool config, the pool and rows kept small enough to build."""
    v: dict = {}
    g = KV_RANGES
    v["block_size"] = draw(rng, g["block_size"], hi=rng.choice((4, 16, 64, 1024)))
    if rng.random() < 0.5:
        v["num_blocks"] = draw(rng, g["num_blocks"], lo=1, hi=rng.choice((1, 8, 300)))
    else:
        v["num_blocks"] = 0
        per = 2 * 2 * 2 * 16 * v["block_size"] * 4  # at most the float32 block of the tiny model
        v["kv_cache_bytes"] = rng.choice((per, per + 1, 2 * per - 1, per * rng.randint(1, 200)
                                          + rng.randint(0, per - 1)))
    v["max_batch_size"] = draw(rng, g["max_batch_size"], hi=rng.choice((2, 16, 256)))
    for k in ("max_prefill_chunk", "max_new_tokens_limit", "max_waiting", "metrics_port",
              "heartbeat_seconds", "publish_interval_seconds", "shallow_tokens",
              "pin_ttl_max_seconds", "one_thread_below", "grace_seconds",
              "engine_stall_seconds", "send_stall_seconds", "max_draft_tokens",
              "draft_branches"):
        if rng.random() < 0.7:
            v[k] = draw(rng, g[k])
    v["torch_threads"] = draw(rng, g["torch_threads"], hi=rng.choice((2, 1024)))
    v["max_pinned_fraction"] = draw(rng, g["max_pinned_fraction"])
    v["max_pinned_per_tenant_fraction"] = draw(rng, R("float", 0, v["max_pinned_fraction"],
                                                      lo_open=True))
    for k in ("prefix_caching", "drafts", "draft_batch_gate", "draft_costs_learned",
              "prompt_lookup", "preallocate_rows"):
        v[k] = rng.random() < 0.5
    if v["preallocate_rows"] or rng.random() < 0.5:
        # Rows of max_batch_size x max_context tokens are allocated: kept to a few MiB.
        v["max_context"] = rng.choice((2, 3, 64, 200))
    elif rng.random() < 0.5:
        v["max_context"] = rng.choice((0, 1024, 1025, 10**6))
    m = v.get("max_draft_tokens", 16)
    if rng.random() < 0.6:
        a = rng.randint(1, m)
        b = rng.randint(a, m)
        v["draft_ladder"] = f"{a},{b},{rng.randint(b, m)}"
    elif rng.random() < 0.5:  # a timing taken elsewhere: 1, then m plausible costs
        v["draft_costs"] = ",".join(["1"] + [f"{rng.uniform(0.7, 3):.3f}" for _ in range(m)])
    v["eviction_policy"] = rng.choice(("hybrid", "lru"))
    v["replica_id"] = rng.choice(("kvpool-7", "r" * 256, "é-1"))
    v["address"] = rng.choice(("127.0.0.1:0", "0.0.0.0:65535", "[::1]:50054"))
    if rng.random() < 0.5:
        v["advertise_address"] = rng.choice(("10.0.0.5:50054", "fd00::5:50054", "kv-0.svc:1"))
    if rng.random() < 0.5:
        v["prefix_address"] = ",".join(addresses(rng, rng.randint(1, 3)))
    if rng.random() < 0.5:
        v["internal_token"] = token(rng)
    if folder is not None:
        v["model"] = folder
        v["dtype"] = rng.choice(("float32", "float16", "bfloat16"))
        v["linear_kernels"] = rng.choice(("onednn", "torch"))
        if rng.random() < 0.5:
            v["model_id"] = rng.choice(("m", "x" * 256, "org/Model-1"))
        if rng.random() < 0.5:
            v["cache_dir"] = "/nonexistent/cache"
    return v


def block_bytes(model, block_size: int, dtype: torch.dtype) -> int:
    """One KV block from the model's own config: K and V, every layer, every KV head."""
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    return (2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * block_size
            * torch.tensor([], dtype=dtype).element_size())


COSTS = {q: 1.0 + 0.02 * (q - 1) for q in range(1, 70)}  # draft forwards, as if timed


def fixed_costs(model, n, threads_for=None):
    return {q: COSTS[q] for q in range(1, n + 1)}


def check_replica(v: dict, cfg: KvPoolConfig, replica, model) -> None:
    """Every kvpool setting build_replica reads, against its documented effect."""
    eng, pool, info = replica.engine, replica.engine.pool, replica.info
    dtype = next(model.parameters()).dtype
    per = block_bytes(model, v["block_size"], dtype)
    if v["num_blocks"] > 0:
        want_n = v["num_blocks"]
    else:  # as many whole blocks as the bytes hold
        want_n = v["kv_cache_bytes"] // per
    assert pool.num_blocks == want_n and pool.block_size == v["block_size"]
    pool_b, _ = eng.store.nbytes()
    assert pool_b == want_n * per  # bytes, not MiB
    if v["num_blocks"] == 0:
        assert pool_b <= v["kv_cache_bytes"] < pool_b + per
    # Eviction: hybrid ranks blocks under shallow_tokens by use (deep ones go first), lru by
    # time alone.
    from services.common.policy import BlockUsage
    pol = pool.policy
    shallow = v.get("shallow_tokens", 128)
    deep_key = pol.key(BlockUsage(shallow, hits=9, last_access=9.0))
    old_shallow = pol.key(BlockUsage(max(0, shallow - 1), hits=0, last_access=1.0))
    if v["eviction_policy"] == "lru" or shallow == 0:
        assert old_shallow < deep_key  # older first (shallow 0: every block is deep)
    else:
        assert deep_key < old_shallow
    assert pool.record_events == bool(v.get("prefix_address"))
    # Pins: a share of the pool, floored to whole blocks, never under one (docs silent).
    for got, frac in ((pool.max_pinned, v["max_pinned_fraction"]),
                      (pool.max_pinned_per_salt, v["max_pinned_per_tenant_fraction"])):
        assert 1 <= got <= max(1, want_n * frac) + 1e-9 and got >= math.floor(want_n * frac)
    assert pool.max_pinned_per_salt <= pool.max_pinned
    assert eng.max_batch_size == v["max_batch_size"]
    assert eng.max_prefill_chunk == v.get("max_prefill_chunk", 512)
    assert eng.max_waiting == v.get("max_waiting", 256)
    assert eng.prefix_caching == v["prefix_caching"]
    assert eng.drafts == v["drafts"]
    m = v.get("max_draft_tokens", 16)
    assert eng.max_draft_tokens == m
    assert eng.draft_branches == v.get("draft_branches", 4)
    assert eng.prompt_lookup == v["prompt_lookup"]
    assert eng.batch_gate == v["draft_batch_gate"]
    assert eng.learn_costs == v["draft_costs_learned"]
    if not v["drafts"]:
        assert eng.ladder() == ()
    elif "draft_ladder" in v:
        assert eng.ladder() == tuple(int(x) for x in v["draft_ladder"].split(","))
        assert eng.draft_ladder.source == "configured"
    elif "draft_costs" in v:  # chosen from the costs given, untimed
        given = tuple(float(x) for x in v["draft_costs"].split(","))
        assert eng.draft_ladder.source == "given" and eng.costs() == given
        assert eng.ladder() == choose_ladder(dict(enumerate(given, start=1)), m)
    else:  # measured on this device (here: the cost table), within 1..max_draft_tokens
        lad = eng.ladder()
        assert eng.draft_ladder.source == "measured" and len(lad) == 3
        assert 1 <= lad[0] <= lad[1] <= lad[2] <= m
    eng.call(lambda: None).result()  # the engine thread has set its threads
    one = v.get("one_thread_below", 256)
    want_threads = v["torch_threads"] or eng.threads
    assert v["torch_threads"] == 0 or eng.threads == v["torch_threads"]
    if one > 0:
        assert eng.threads_for(one - 1) == 1
    assert eng.threads_for(one) == want_threads
    mp = model.config.max_position_embeddings
    mc = v.get("max_context", 0)
    assert info.max_context == (mp if mc == 0 else min(mc, mp))  # past the model's: the model's
    _, rows_b = eng.store.nbytes()
    row_tokens = v["max_batch_size"] * info.max_context
    whole = v["max_batch_size"] * -(-info.max_context // v["block_size"]) * per  # in blocks
    if v["preallocate_rows"]:  # the whole context of every row, in whole blocks
        assert row_tokens * per // v["block_size"] <= rows_b == whole
    else:
        assert rows_b <= whole


class Ctx:
    """A servicer context for a call refused before anything is submitted."""

    def time_remaining(self):
        return None

    def is_active(self):
        return True

    def add_callback(self, fn):
        return True


def check_servicer(v: dict, cfg: KvPoolConfig, replica) -> None:
    """max_new_tokens_limit: the refusal point of a request's max_tokens."""
    from tiercache.v1 import common_pb2, kvpool_pb2

    from services.common.errors import InvalidArgument
    from services.kvpool.server import KvPoolServicer

    s = KvPoolServicer(cfg)
    s.attach(replica.engine, replica.info)
    limit = v.get("max_new_tokens_limit", 2048)
    n = replica.info.max_context  # with any max_tokens past 0 this prompt does not fit
    for max_tokens, field in ((limit, "token_ids"), (limit + 1, "sampling.max_tokens")):
        if max_tokens > 2**31 - 1:
            continue
        req = kvpool_pb2.KvGenerateRequest(
            token_ids=[1] * n, sampling=common_pb2.SamplingParams(max_tokens=max_tokens))
        with pytest.raises(InvalidArgument) as exc:
            next(s._generate(req, Ctx()))
        assert exc.value.field == field, (max_tokens, limit, str(exc.value))
    assert s.cfg is cfg  # replica_id, pin_ttl_max_seconds, send_stall_seconds: read from it


@pytest.fixture(scope="module")
def tiny():
    from tests.kvpool.conftest import make_tiny_model

    return make_tiny_model()


@pytest.fixture(scope="module")
def tiny_folder(tiny, tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "tiny-folder"
    tiny.save_pretrained(folder)
    return str(folder)


def kv_case(seed: int, tiny, folder: str | None) -> None:
    from services.kvpool import app

    rng = random.Random(seed)
    v = kv_values(rng, folder)
    cfg = loaded("kvpool", v)
    threads = torch.get_num_threads()
    replica = None
    try:
        with attr(app, "forward_costs", fixed_costs):
            if folder is None:
                model = tiny
                replica = app.build_replica(cfg, model=tiny, model_id="tiny", metrics=False)
                assert replica.info.model_id == "tiny"
            else:
                replica = app.build_replica(cfg, metrics=False)
                model = replica.engine.model
                want_dtype = {"float32": torch.float32, "float16": torch.float16,
                              "bfloat16": torch.bfloat16}[v["dtype"]]
                assert all(p.dtype == want_dtype for p in model.parameters())
                assert replica.info.model_id == (v.get("model_id") or Path(folder).name)
                if v["linear_kernels"] == "torch":
                    assert replica.engine.packing.kernels == "torch"
                elif v["dtype"] == "float32":
                    assert replica.engine.packing.kernels in ("onednn", "torch")
        check_replica(v, cfg, replica, model)
        check_servicer(v, cfg, replica)
    except ValueError as exc:  # the bytes hold no block: refused at start, naming the setting
        assert v["num_blocks"] == 0 and "TIERCACHE_KVPOOL_KV_CACHE_BYTES" in str(exc), exc
        per = block_bytes(tiny if folder is None else tiny, v["block_size"], {
            "float16": torch.float16, "bfloat16": torch.bfloat16}.get(v.get("dtype"),
                                                                       torch.float32))
        assert v["kv_cache_bytes"] < per or v["kv_cache_bytes"] // per > MAX_BLOCKS
    finally:
        if replica is not None:
            replica.engine.stop()
        torch.set_num_threads(threads)


def test_kvpool_settings_reach_the_replica(tiny, tiny_folder):
    for seed in range(SEEDS):
        kv_case(seed, tiny, tiny_folder if seed % 3 == 2 else None)


# ---- orchestrator ------------------------------------------------------------------------------

class Tok:
    """A byte-level tokenizer: id i is byte i, 0 ends a sequence."""

    eos_token_id = 0
    all_special_ids = [0]
    chat_template = None

    def __len__(self) -> int:
        return 256

    def encode(self, text: str, add_special_tokens=False) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(i for i in ids if i).decode("utf-8", "replace")


def orch_values(rng: random.Random, tmp: Path) -> dict:
    g = ORCH_RANGES
    v: dict = {}
    for k in g:
        if rng.random() < 0.6:
            v[k] = draw(rng, g[k])
    lim = v.get("max_tokens_limit", 2048)
    if rng.random() < 0.6:
        v["default_max_tokens"] = draw(rng, R("int", 1, lim))
    elif lim < 256:
        v["default_max_tokens"] = lim
    if "warm_pin_ttl_s" in v or rng.random() < 0.3:
        pin = v.setdefault("warm_pin_ttl_s", 600)
        v["warm_pin_ttl_max_s"] = draw(rng, R("int", pin, 2**32 - 1))
    w = v.get("max_workers", 64)
    if rng.random() < 0.5:
        v["max_concurrent_rpcs"] = rng.choice((0, w + 1, w + rng.randint(1, 10**6)))
    if rng.random() < 0.5:
        v["warm_interval_s"] = rng.choice((0.0, -1.0, 1.0, 2.5, 1e9))
    v["kvpool_addresses"] = addresses(rng, rng.randint(1, 3))
    if rng.random() < 0.5:
        v["semantic_address"] = ",".join(addresses(rng, rng.randint(1, 3)))
    if rng.random() < 0.5:
        v["prefix_addresses"] = addresses(rng, rng.randint(1, 3))
    if rng.random() < 0.5:
        v["internal_token"] = token(rng)
    if rng.random() < 0.4:
        v["tokens"] = f"{token(rng)}=alpha,{token(rng)}=beta"
    if rng.random() < 0.3:
        f = tmp / f"tokens-{rng.random()}.json"
        f.write_text(json.dumps({token(rng): {"tenant": "gamma"}}))
        v["tokens_file"] = str(f)
    if rng.random() < 0.5:
        v["model_id"] = rng.choice(("m-1", "org/other"))
    if rng.random() < 0.5:
        v["cache_dir"] = str(tmp / "cache")
    for k in ("enable_drafts", "store_sampled", "serve_sampled"):
        if rng.random() < 0.7:
            v[k] = rng.random() < 0.5
    v["semantic_tier"] = rng.choice(("strict", "standard", "relaxed"))
    v["routing_policy"] = rng.choice(("prefix", "round_robin"))
    v["address"] = rng.choice(("127.0.0.1:0", "0.0.0.0:50051", "[::]:65535"))
    return v


def fake_load_resolved(record: list):
    from services.common.model_store import ResolvedModel

    def load_resolved(spec, cache_dir, model_id, load):
        record.append((spec, cache_dir, model_id))
        # As resolve_model: the id given, else the model's own.
        return ResolvedModel("/nonexistent/model-folder", model_id or "resolved-id"), Tok()

    return load_resolved


@contextlib.contextmanager
def orch_seams(watch: Calls, loops: list, resolved: list):
    from services.orchestrator import app as oapp
    from services.orchestrator.server import Warmer

    with attr(oapp, "load_resolved", fake_load_resolved(resolved)), \
            attr(oapp, "watch_tokens_file", watch), \
            attr(Warmer, "_loop", lambda self: loops.append(self)):
        yield


def check_orchestrator(v: dict, cfg: OrchestratorConfig, a, watch: Calls, loops: list,
                       resolved: list) -> None:
    from services.common.errors import InvalidArgument
    from services.orchestrator.routing import PrefixAwarePolicy, RoundRobinPolicy
    from services.orchestrator.server import parse_sampling

    o = a.orch
    assert resolved == [(v.get("model", "smollm2"), v.get("cache_dir") or None,
                         v.get("model_id") or None)]
    model_id = v.get("model_id") or "resolved-id"
    token_ = v.get("internal_token", "")
    bs = v.get("block_size", 16)
    assert o.model_id == model_id and o.hasher.model_id == model_id
    assert o.hasher.block_size == bs
    rs = o.replicas
    assert tuple(rs.addresses) == v["kvpool_addresses"]
    assert (rs.internal_token, rs.model_id, rs.block_size) == (token_, model_id, bs)
    assert rs.poll_s == v.get("replica_poll_s", 1.0)
    assert rs.stats_timeout_s == v.get("replica_stats_timeout_s", 2.0)  # seconds
    assert rs.hung_polls == v.get("replica_hung_polls", 3)
    assert rs.stall_s == v.get("replica_stall_s", 60.0)
    sem = o.semantic
    want_sem = [s for s in v.get("semantic_address", "").split(",") if s]
    assert sem.addresses == want_sem and sem.enabled == bool(want_sem)
    assert sem.timeout_s == v.get("semantic_timeout_s", 2.0) and sem.internal_token == token_
    if v.get("prefix_addresses"):
        p = o.prefix
        assert tuple(p.client.addresses) == v["prefix_addresses"]
        assert p.timeout_s == v.get("prefix_timeout_s", 0.5)
        assert p.client.internal_token == token_
        assert p.client.block_size == bs
    else:
        assert o.prefix is None
    assert o.internal_token == token_
    assert o.default_tier == v["semantic_tier"]
    assert o.enable_drafts == v.get("enable_drafts", True)
    assert o.store_sampled == v.get("store_sampled", False)
    assert o.serve_sampled == v.get("serve_sampled", False)
    assert o.max_attempts == v.get("max_attempts", 3)
    mpt = v.get("min_prefix_tokens", 32)
    assert o.min_prefix_tokens == mpt
    r = o.routing
    if v["routing_policy"] == "round_robin":
        assert isinstance(r, RoundRobinPolicy)
    else:
        assert isinstance(r, PrefixAwarePolicy)
        assert r.epsilon == v.get("routing_epsilon", 0.25)
        assert r.min_prefix_tokens == mpt
        assert r.window_s == v.get("routing_load_window_s", 30.0)
        assert r.load_floor == v.get("routing_load_floor", 2)
    dm = v.get("dispatch_memory_s", 10.0)
    if dm == 0:
        assert o.dispatched is None
    else:
        assert o.dispatched.ttl_s == dm and o.dispatched.block_size == bs
        assert o.dispatched.forget in rs.on_lost
    # The renderer: its character limit is where a raw prompt is refused.
    mc = v.get("max_message_chars", 100_000)
    assert o.renderer.max_prompt_tokens == v.get("max_prompt_tokens", 8192)
    if mc <= 200_000:
        o.renderer.render_raw("x" * mc)
        with pytest.raises(InvalidArgument):
            o.renderer.render_raw("x" * (mc + 1))
    else:
        assert o.renderer.max_chars == mc
    # Tenants: the server's limits are every tenant's defaults.
    with_tokens = bool(v.get("tokens") or v.get("tokens_file"))
    streams = v.get("max_workers", 64) - STREAM_HEADROOM
    auto = min(16, streams) if with_tokens else streams
    conc = v.get("max_concurrent_per_tenant", 0) or auto
    reg = a.tenants
    tenants = [reg.default] if reg.default is not None else list(reg.by_token.values())
    assert (reg.default is None) == with_tokens and tenants
    for t in tenants:
        assert (t.max_prompt_tokens, t.max_tokens, t.max_concurrent) == (
            v.get("max_prompt_tokens", 8192), v.get("max_tokens_limit", 2048), conc), t
    # The tokens file is read again every tokens_reload_s; 0 = once.
    reload = v.get("tokens_reload_s", 5.0)
    if v.get("tokens_file") and reload > 0:
        (args, _kw), = watch.calls
        assert args[2] == v["tokens_file"] and args[3] == reload
    else:
        assert watch.calls == []
    # The warm loop runs only with an interval, a top_k and an index.
    runs = (v.get("warm_interval_s", 30.0) > 0 and v.get("warm_top_k", 8) > 0
            and bool(v.get("prefix_addresses")))
    assert len(loops) == int(runs)
    assert a.warmer.cfg is cfg
    # Sampling: unset max_tokens is the default; the limit is taken, one more refused.
    from tiercache.v1 import common_pb2

    lim = v.get("max_tokens_limit", 2048)
    assert parse_sampling(common_pb2.SamplingParams(), cfg).max_tokens == v.get(
        "default_max_tokens", 256)
    assert parse_sampling(common_pb2.SamplingParams(max_tokens=lim), cfg).max_tokens == lim
    if lim < 2**31 - 1:
        with pytest.raises(InvalidArgument):
            parse_sampling(common_pb2.SamplingParams(max_tokens=lim + 1), cfg)


def orch_case(seed: int, tmp: Path) -> None:
    from services.orchestrator.app import build

    rng = random.Random(10_000 + seed)
    v = orch_values(rng, tmp)
    cfg = loaded("orchestrator", v)
    watch, loops, resolved = Calls(), [], []
    with orch_seams(watch, loops, resolved):
        a = build(cfg)
    try:
        check_orchestrator(v, cfg, a, watch, loops, resolved)
    finally:
        a.close()


def test_orchestrator_settings_reach_the_pipeline(tmp_path):
    for seed in range(SEEDS):
        orch_case(seed, tmp_path)


# ---- semantic ------------------------------------------------------------------------------

DIM = 16


class HashOnnx:
    """Stands in for OnnxEmbedder: records its arguments; a prompt -> a fixed random unit
    vector (cosine well under every tier to any other prompt)."""

    made: list = []

    def __init__(self, model_dir, cache_dir, name, threads=0, *, spinning=True,
                 exporter="torchscript") -> None:
        HashOnnx.made.append(dict(model_dir=model_dir, cache_dir=cache_dir, name=name,
                                  threads=threads, spinning=spinning, exporter=exporter))
        self.dim = DIM
        self.name = name
        self.identity = f"{name}@wiring"

    def exceeds_window(self, text: str) -> bool:
        return False

    def unseen(self, text: str) -> str:
        return ""

    def embed(self, texts):
        out = np.zeros((len(texts), DIM), np.float32)
        for i, t in enumerate(texts):
            r = np.random.default_rng(abs(hash(t)) % 2**32)
            x = r.standard_normal(DIM).astype(np.float32)
            out[i] = x / np.linalg.norm(x)
        return out

    def embed_checked(self, texts):
        return self.embed(texts), [False] * len(texts)

    def embed_one(self, text):
        return self.embed([text])[0]

    def close(self) -> None:
        pass


TIERS = ("strict", "standard", "relaxed")


def sem_values(rng: random.Random, tmp: Path) -> dict:
    g = SEM_RANGES
    v: dict = {}
    for k in ("onnx_threads", "max_batch", "batch_wait_ms", "snapshot_interval_s",
              "hnsw_min_entries", "hnsw_m", "hnsw_ef_construction", "hnsw_ef_search",
              "faiss_threads", "delta_capacity", "grace_seconds", "index_close_seconds",
              "expiry_interval_s", "metrics_port"):
        if rng.random() < 0.6:
            v[k] = draw(rng, g[k])
    floor = v["threshold_floor"] = draw(rng, g["threshold_floor"])
    ts = sorted(draw(rng, R("float", floor, 1.0)) for _ in range(3))
    v["tier_relaxed"], v["tier_standard"], v["tier_strict"] = ts
    v["draft_floor"] = draw(rng, R("float", 0, floor, lo_open=True))
    v["verified_bonus"] = draw(rng, g["verified_bonus"])
    v["default_tier"] = rng.choice(TIERS)
    guard = tuple(t for t in TIERS if rng.random() < 0.5)
    v["guard_tiers"] = guard
    v["verifier_tiers"] = tuple(t for t in guard if rng.random() < 0.5)
    v["max_ttl_seconds"] = draw(rng, g["max_ttl_seconds"])
    v["default_ttl_seconds"] = draw(rng, R("int", 0, v["max_ttl_seconds"]))
    for k in ("max_entries_per_namespace", "max_entries_total", "max_entries_per_tenant"):
        v[k] = rng.choice((0, 1, 2, 3, 10**6)) if k.endswith("tenant") else rng.choice(
            (1, 2, 3, 10**6))
    v["max_text_chars"] = rng.choice((1, 2, 40, 8192, draw(rng, g["max_text_chars"], hi=10**5)))
    v["max_answer_chars"] = rng.choice((1, 3, 65536, draw(rng, g["max_answer_chars"],
                                                          hi=600_000)))
    v["max_tenant_chars"] = rng.choice((64, 65, 256, 100_000))
    v["sqlite_synchronous"] = rng.choice(("FULL", "NORMAL", "EXTRA", "normal"))
    v["snapshot_on_stop"] = rng.random() < 0.5
    v["onnx_spinning"] = rng.random() < 0.5
    v["onnx_exporter"] = rng.choice(("torchscript", "dynamo"))
    v["db_path"] = str(tmp / f"db-{rng.random()}" / "s.db")
    if rng.random() < 0.5:
        v["snapshot_path"] = str(tmp / f"snap-{rng.random()}")
    if rng.random() < 0.5:
        v["cache_dir"] = str(tmp / "cache")
    if rng.random() < 0.5:
        v["model_name"] = rng.choice(("mini", "all-MiniLM-L6-v2", "x.y"))
    if rng.random() < 0.5:
        v["internal_token"] = token(rng)
    v["address"] = "127.0.0.1:0"
    return v


def check_semantic(v: dict, cfg: SemanticConfig, svc, server_kw: dict) -> None:
    from services.common.errors import InvalidArgument
    from services.semantic import index as sindex
    from services.semantic.cache import Namespace
    from services.semantic.config import DEFAULT_MODEL_NAME, default_model_dir

    cache, emb = svc.cache, svc.embedder
    assert server_kw["internal_token"] == (v.get("internal_token") or None)
    mp = v.get("metrics_port", 9102)
    assert server_kw["metrics_port"] == (None if mp < 0 else mp)
    assert server_kw["address"] == v["address"]
    # The embedder: the folder, its name, the cache, threads, spinning, exporter; the batcher.
    made = HashOnnx.made[-1]
    assert made["model_dir"] == default_model_dir()
    assert made["name"] == (v.get("model_name") or DEFAULT_MODEL_NAME)
    assert made["cache_dir"] == v.get("cache_dir", made["cache_dir"])
    assert made["threads"] == v.get("onnx_threads", 0)
    assert made["spinning"] == v["onnx_spinning"] and made["exporter"] == v["onnx_exporter"]
    assert emb.max_batch == v.get("max_batch", 32)
    assert emb.wait_s == pytest.approx(v.get("batch_wait_ms", 0.0) / 1000)  # ms -> s
    # SQLite: the database where it was put, synchronous as set.
    assert os.path.isfile(v["db_path"])
    sync = cache.store._db.execute("PRAGMA synchronous").fetchone()[0]
    assert sync == {"NORMAL": 1, "FULL": 2, "EXTRA": 3}[v["sqlite_synchronous"].upper()]
    snap = (v.get("snapshot_path") or v["db_path"] + ".hnsw") if v["snapshot_on_stop"] else ""
    assert svc.snapshot_path == snap and svc.housekeeper.snapshot_path == snap
    assert svc.housekeeper.snapshot_interval_s == v.get("snapshot_interval_s", 600.0)
    assert svc.housekeeper.interval_s == v.get("expiry_interval_s", 30.0)
    assert cache._params[1:] == (v.get("hnsw_min_entries", 20000), v.get("hnsw_m", 32),
                                 v.get("hnsw_ef_construction", 80), v.get("hnsw_ef_search", 32),
                                 v.get("delta_capacity", 2048))
    assert sindex._search_threads == v.get("faiss_threads", 1)
    # The policy: each tier's threshold, the default tier, the floor's refusal point.
    pol = cache.policy
    for t in TIERS:
        assert pol.resolve(t).threshold == v[f"tier_{t}"]
    d = pol.resolve()
    assert (d.tier, d.threshold) == (v["default_tier"], v[f"tier_{v['default_tier']}"])
    floor = v["threshold_floor"]
    assert pol.resolve("", floor).threshold == pytest.approx(floor)
    if floor - 1e-5 > 0:
        with pytest.raises(InvalidArgument):
            pol.resolve("", floor - 1e-5)
    strict = pol.resolve("strict")
    assert pol.threshold_for(strict, True) == pytest.approx(
        max(floor, v["tier_strict"] - v["verified_bonus"]))
    assert pol.draft_floor == v["draft_floor"]
    assert cache.guard_tiers == frozenset(v["guard_tiers"])
    assert cache.verifier_tiers == frozenset(v["verifier_tiers"])
    if not v["verifier_tiers"]:  # (with them: off too when fitted for another embedder)
        assert cache.verifier is None
    # Limits: the refusal points.
    ns = Namespace("t", "m")
    tc, ac = v["max_text_chars"], v["max_answer_chars"]
    with pytest.raises(InvalidArgument) as exc:
        cache.lookup(ns, "q" * (tc + 1))
    assert exc.value.field == "text"
    with pytest.raises(InvalidArgument) as exc:
        cache.store_entry(ns, "q", "a" * (ac + 1))
    assert exc.value.field == "answer"
    mt = v["max_tenant_chars"]
    with pytest.raises(InvalidArgument):
        cache.lookup(Namespace("t" * (mt + 1), "m"), "q")
    cache.lookup(Namespace("t" * mt, "m"), "q")
    mx = v["max_ttl_seconds"]
    if mx < 2**32 - 1:
        with pytest.raises(InvalidArgument) as exc:  # refused, not cut (the docs said cut)
            cache.store_entry(ns, "q", "a", ttl_seconds=mx + 1)
        assert exc.value.field == "ttl_seconds"
    e = cache.store_entry(ns, "q", "a", ttl_seconds=mx)
    assert e.ttl_seconds == mx
    e = cache.store_entry(ns, "r", "a")
    assert e.ttl_seconds == v["default_ttl_seconds"]
    # Caps: after more stores than a cap, the namespace / tenant / shard holds at most it.
    cap_ns, cap_total, cap_t = (v["max_entries_per_namespace"], v["max_entries_total"],
                                v["max_entries_per_tenant"])
    for i in range(4):
        cache.store_entry(Namespace("u", "m"), "abcd"[i], "a")  # within max_text_chars 1
        cache.store_entry(Namespace("u", "m2"), "abcd"[i], "a")
    per_ns = {}
    for x in cache._entries.values():
        per_ns[x.namespace] = per_ns.get(x.namespace, 0) + 1
    n = cache.store.count()
    assert n <= cap_total
    assert all(c <= cap_ns for c in per_ns.values()), per_ns
    if cap_t:
        u = sum(c for k, c in per_ns.items() if k.tenant == "u")
        assert u <= cap_t
    if cap_ns >= 4 and cap_total >= 10 and cap_t in (0, 10**6):
        assert n == 10  # nothing evicted under the caps


def sem_case(seed: int, tmp: Path) -> None:
    from services.common import bootstrap
    from services.semantic import embedder as semb
    from services.semantic import server as sserver

    rng = random.Random(20_000 + seed)
    v = sem_values(rng, tmp)
    cfg = loaded("semantic", v)
    real = bootstrap.create_server
    kws: list = []

    def create_server(**kw):
        kws.append(dict(kw))
        return real(**{**kw, "metrics_port": None})

    with attr(semb, "OnnxEmbedder", HashOnnx), attr(sserver, "create_server", create_server):
        svc = sserver.serve(cfg)
    try:
        check_semantic(v, cfg, svc, kws[-1])
    finally:
        svc.stop(0, 5)


def test_semantic_settings_reach_the_cache(tmp_path):
    for seed in range(SEEDS):
        sem_case(seed, tmp_path)


# ---- prefix ------------------------------------------------------------------------------

def prefix_values(rng: random.Random) -> dict:
    v: dict = {}
    for k, r in PREFIX_RANGES.items():
        if rng.random() < 0.7:
            v[k] = draw(rng, r)
    lease = v.get("lease_seconds", 10.0)
    hl = v.get("hit_half_life_seconds", 3600.0)
    if hl and hl < lease:
        v["hit_half_life_seconds"] = rng.choice((0.0, lease, min(lease * 2, MAX_FLOAT_SETTING)))
    v["eviction_policy"] = rng.choice(("hybrid", "lru"))
    v["verify_hashes"] = rng.random() < 0.5
    if rng.random() < 0.5:
        v["internal_token"] = token(rng)
    v["address"] = "127.0.0.1:0"
    return v


def check_index(v: dict, idx) -> None:
    from services.common.bootstrap import DEFAULT_MAX_MESSAGE_BYTES
    from services.common.policy import HybridPolicy, LRUPolicy
    from services.common.prefix_client import BATCH_HEADROOM, BLOCK_FRAMING

    bs = v.get("block_size", 16)
    assert idx.block_size == bs
    assert idx.lease_seconds == v.get("lease_seconds", 10.0)
    mn = v.get("max_nodes", 1_000_000)
    assert idx.max_nodes == mn
    assert idx.prune_target == int(mn * v.get("prune_to", 0.9))  # a fraction of max_nodes
    assert idx.prune_step == v.get("prune_step", 8000)
    st = v.get("shallow_tokens", 128)
    if v["eviction_policy"] == "lru":
        assert isinstance(idx.policy, LRUPolicy)
    else:
        assert isinstance(idx.policy, HybridPolicy) and idx.policy.shallow_tokens == st
    assert idx.shallow_tokens == st
    assert idx.min_deep_hits == v.get("min_deep_hits", 1)
    assert idx.cold_after_ticks == v.get("cold_after_ticks", 20000)
    assert idx.hit_half_life_seconds == v.get("hit_half_life_seconds", 3600.0)
    assert idx.max_events == v.get("max_events", 65536)
    mb = v.get("max_blocks", 65536)
    fits = (DEFAULT_MAX_MESSAGE_BYTES - BATCH_HEADROOM) // (5 * bs + BLOCK_FRAMING)
    # Lowered to one message's worth only (logged; docs/settings.md does not say it).
    assert idx.max_blocks == min(mb, max(1, fits))
    assert idx.verify_hashes == v["verify_hashes"]


def test_prefix_settings_reach_the_index():
    from services.prefix.server import build_index

    for seed in range(SEEDS * 5):
        rng = random.Random(30_000 + seed)
        v = prefix_values(rng)
        check_index(v, build_index(loaded("prefix", v)))


# ---- the __main__ of each service ------------------------------------------------------------

@contextlib.contextmanager
def main_env(service: str, values: dict, extra: dict | None = None):
    """The process environment of a start: exactly these variables."""
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("TIERCACHE_")}
    os.environ.update(env_of(service, values))
    os.environ.update(extra or {})
    try:
        yield
    finally:
        for k in [k for k in os.environ if k.startswith("TIERCACHE_")]:
            del os.environ[k]
        os.environ.update(saved)


@contextlib.contextmanager
def quiet_logging():
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        yield
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_kvpool_main_wires_the_server_publisher_and_watchdog(tiny):
    omp = os.environ.get("OMP_WAIT_POLICY")
    onednn = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY")
    import services.kvpool.__main__ as kmain

    if omp is None:
        os.environ.pop("OMP_WAIT_POLICY", None)
    if onednn is None:
        os.environ.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    from services.kvpool import app

    def one(seed: int) -> None:
        rng = random.Random(40_000 + seed)
        v = kv_values(rng, None)
        if "draft_costs" not in v:  # nothing timed: lengths given, or chosen from costs given
            v.setdefault("draft_ladder", "1,1,1")
        handle = FakeHandle()
        server, pub, watch, run = Calls(lambda **kw: handle), Calls(), Calls(), Calls()
        built: list = []

        class Pub:
            def __init__(self, engine, **kw) -> None:
                pub(engine, **kw)

            def start(self):
                return self

            def stop(self) -> None:
                pass

        def build(cfg):
            built.append(cfg)
            return app.build_replica(cfg, model=tiny, model_id="tiny", metrics=False)

        def run_until(h, grace, on_stop=None):
            run(h, grace, on_stop=on_stop)
            on_stop()

        threads = torch.get_num_threads()
        try:
            with main_env("kvpool", v), quiet_logging(), \
                    attr(kmain, "create_server", server), attr(kmain, "build_replica", build), \
                    attr(kmain, "Publisher", Pub), attr(kmain, "watch_engine", watch), \
                    attr(kmain, "run_until_signal", run_until):
                assert kmain._main([]) == 0
        finally:
            torch.set_num_threads(threads)
        kw = server.kw
        assert kw["address"] == v["address"]
        assert kw["internal_token"] == (v.get("internal_token") or None)
        mp = v.get("metrics_port", 9104)
        assert kw["metrics_port"] == (None if mp < 0 else mp)
        assert kw["max_workers"] == v["max_batch_size"] + v.get("max_waiting", 256) + 16
        assert handle.serving
        # torch_threads 0 = torch's default count, given to the engine thread.
        assert built[0].torch_threads == (v["torch_threads"] or threads)
        if v.get("prefix_address"):
            (_e,), pkw = pub.calls[0]
            assert pkw["address"] == v["prefix_address"]
            assert pkw["replica_id"] == v["replica_id"]
            assert pkw["public_address"] == (v.get("advertise_address") or v["address"])
            assert pkw["heartbeat_seconds"] == v.get("heartbeat_seconds", 2.0)
            assert pkw["publish_interval_seconds"] == v.get("publish_interval_seconds", 0.2)
            assert pkw["internal_token"] == v.get("internal_token", "")
            assert pkw["model_id"] == "tiny"
        else:
            assert pub.calls == []
        (_eng, h), wkw = watch.calls[0]
        assert h is handle and wkw["stall_seconds"] == v.get("engine_stall_seconds", 300.0)
        (h, grace), _ = run.calls[0]
        assert grace == v.get("grace_seconds", 10.0)

    for seed in range(max(2, SEEDS // 3)):
        one(seed)


def test_orchestrator_main_wires_the_server(tmp_path):
    import services.orchestrator.__main__ as omain

    def one(seed: int) -> None:
        rng = random.Random(50_000 + seed)
        v = orch_values(rng, tmp_path)
        handle = FakeHandle()
        server, run = Calls(lambda **kw: handle), Calls()
        watch, loops, resolved = Calls(), [], []
        apps: list = []

        def run_until(h, grace, on_stop=None):
            run(h, grace)
            on_stop()

        real_build = omain.build

        def build(cfg):
            apps.append((cfg, real_build(cfg)))
            return apps[-1][1]

        with main_env("orchestrator", v, {"TIERCACHE_HASH_KEY": "k" * 32}), quiet_logging(), \
                orch_seams(watch, loops, resolved), attr(omain, "create_server", server), \
                attr(omain, "build", build), attr(omain, "run_until_signal", run_until):
            assert omain._main([]) == 0
        kw = server.kw
        assert kw["address"] == v["address"]
        mp = v.get("metrics_port", 9101)
        assert kw["metrics_port"] == (None if mp < 0 else mp)
        w = v.get("max_workers", 64)
        assert kw["max_workers"] == w
        rpcs = v.get("max_concurrent_rpcs", 0)
        assert kw["max_concurrent_rpcs"] == (rpcs or None)  # None: create_server's 4 x workers
        assert kw["max_message_bytes"] == v.get("max_request_bytes", 4 * 1024 * 1024)
        assert kw["max_connection_age_s"] == v.get("max_connection_age_s", 300.0)
        # Streams under way finish: the grace covers a whole request (and a Warm's 120 s).
        assert kw["connection_age_grace_s"] >= v.get("request_timeout_s", 300.0)
        (_h, grace), _ = run.calls[0]
        assert grace == v.get("grace_s", 10.0)
        check_orchestrator(v, *apps[0], watch, loops, resolved)

    for seed in range(max(2, SEEDS // 3)):
        one(seed)


def test_semantic_and_prefix_mains_pass_their_drain_times(tmp_path):
    import services.prefix.__main__ as pmain
    import services.semantic.__main__ as smain
    from services.semantic import embedder as semb

    def one(seed: int) -> None:
        rng = random.Random(60_000 + seed)
        v = sem_values(rng, tmp_path)
        v["metrics_port"] = -1
        stops: list = []
        run = Calls()

        def run_until(h, grace, on_stop=None):
            run(h, grace)
            on_stop()

        real_serve = smain.serve

        def serve(cfg):
            svc = real_serve(cfg)
            real_stop = svc.stop
            svc.stop = lambda grace=2.0, index_close=20.0: (stops.append((grace, index_close)),
                                                              real_stop(grace, index_close))[1]
            return svc

        gc_stub = types.SimpleNamespace(collect=lambda: 0, freeze=lambda: None)
        with main_env("semantic", v), quiet_logging(), attr(semb, "OnnxEmbedder", HashOnnx), \
                attr(smain, "serve", serve), attr(smain, "gc", gc_stub), \
                attr(smain, "run_until_signal", run_until):
            assert smain._main([]) == 0
        assert run.calls[0][0][1] == v.get("grace_seconds", 5.0)
        assert stops == [(0, v.get("index_close_seconds", 10.0))]

        p = prefix_values(rng)
        p["metrics_port"] = -1
        run = Calls()
        with main_env("prefix", p), quiet_logging(), attr(pmain, "run_until_signal", run_until):
            assert pmain._main([]) == 0
        assert run.calls[0][0][1] == p.get("grace_seconds", 5.0)

    for seed in range(max(2, SEEDS // 3)):
        one(seed)


# ---- invalid values --------------------------------------------------------------------------

def past(r) -> list[str]:
    """One past each bound (an off value excepted: it is taken), a value of the wrong kind,
    and an empty value."""
    out = []
    if r.kind == "int":
        if r.lo is not None and (r.lo if r.lo_open else r.lo - 1) not in r.off:
            out.append(str(r.lo if r.lo_open else r.lo - 1))
        if r.hi is not None:
            out.append(str(r.hi if r.hi_open else r.hi + 1))
        out += ["1.5", "x"]
    else:
        below = r.lo if r.lo_open else r.lo - 1e-3 * max(1.0, abs(r.lo))
        if below not in r.off:
            out.append(repr(below))
        out.append(repr(r.hi if r.hi_open else r.hi + 1e-3 * max(1.0, r.hi))
                   if r.hi is not None else "1e10")
        out += ["nan", "inf", "x"]
    return out + [""]


@pytest.mark.parametrize("service", sorted(CLASSES))
def test_a_value_past_a_documented_bound_is_refused_naming_its_variable(service):
    for name, r in RANGES[service].items():
        var = env_name(service, name)
        for raw in past(r):
            if service == "semantic" and name == "threshold_floor" and 0 < _num(raw) <= 1:
                continue  # past 1: refused; under the tiers' defaults, the tiers' business
            with pytest.raises(ConfigError) as exc:
                load_config(CLASSES[service], service, [], {var: raw})
            assert var in str(exc.value), (var, raw, str(exc.value))


def _num(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        return math.nan


@pytest.mark.parametrize("service", sorted(CLASSES))
def test_every_documented_bound_is_taken_as_it_is(service):
    """Each bound (and a value just inside it) is taken, never clamped, alone."""
    for name, r in RANGES[service].items():
        if service == "semantic" and name == "threshold_floor":
            continue  # crossing the tiers' defaults: the random builds take it
        for raw in _edges(r):
            cfg = load_config(CLASSES[service], service, [],
                              {env_name(service, name): raw, **_companions(service, name, raw)})
            got = getattr(cfg, name)
            assert got == (int(raw) if r.kind == "int" else float(raw)), (name, raw, got)


def _edges(r) -> list[str]:
    out = []
    if r.kind == "int":
        lo = r.lo + (1 if r.lo_open else 0)
        out += [str(lo), str(lo + 1)]
        if r.hi is not None:
            hi = r.hi - (1 if r.hi_open else 0)
            out += [str(hi), str(hi - 1)]
        out += [str(o) for o in r.off]
    else:
        lo = r.lo + (1e-6 if r.lo_open else 0.0)
        out += [repr(lo), repr(lo + 1e-6)]
        hi = r.hi if r.hi is not None else MAX_FLOAT_SETTING
        hi = hi - (1e-6 if r.hi_open else 0.0)
        out += [repr(hi), repr(hi - 1e-6)]
        out += [repr(float(o)) for o in r.off]
    return out


def _companions(service: str, name: str, raw: str) -> dict[str, str]:
    """The other settings a cross-field rule needs for `name` = `raw` to be valid alone."""
    v = float(raw)
    e = lambda k, x: {env_name(service, k): str(x)}  # noqa: E731
    if service == "kvpool" and name == "max_pinned_fraction" and v < 0.25:
        return e("max_pinned_per_tenant_fraction", v)
    if service == "kvpool" and name == "max_draft_tokens":
        return {}
    if service == "orchestrator" and name == "max_tokens_limit" and v < 256:
        return e("default_max_tokens", int(v))
    if service == "orchestrator" and name == "warm_pin_ttl_s" and v > 3600:
        return e("warm_pin_ttl_max_s", int(v))
    if service == "orchestrator" and name == "max_workers":
        return {}
    if service == "semantic" and name == "max_ttl_seconds" and v < 604800:
        return e("default_ttl_seconds", int(v))
    if service == "semantic" and name in ("max_text_chars", "max_answer_chars") and v > 1e5:
        other = "max_answer_chars" if name == "max_text_chars" else "max_text_chars"
        return e(other, 1)
    if service == "prefix" and name == "lease_seconds" and v > 3600:
        return e("hit_half_life_seconds", 0)
    if service == "prefix" and name == "hit_half_life_seconds" and 0 < v < 10:
        return e("lease_seconds", 0.1)
    return {}


def test_the_ranges_cover_every_numeric_setting():
    """The table is the docs' every number (those without a bound: ids, addresses, paths,
    choices and lists are drawn in the builders)."""
    for service, cls in CLASSES.items():
        nums = {f.name for f in dataclasses.fields(cls) if f.type in ("int", "float")}
        cross = {"kvpool": {"max_pinned_per_tenant_fraction"},
                 "orchestrator": {"default_max_tokens", "warm_pin_ttl_max_s",
                                  "max_concurrent_rpcs", "warm_interval_s"},
                 "semantic": {"tier_strict", "tier_standard", "tier_relaxed", "draft_floor"},
                 "prefix": set()}[service]
        assert nums - cross == set(RANGES[service]), (service, nums - cross
                                                      ^ set(RANGES[service]))
