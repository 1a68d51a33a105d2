"""Differential test of how a kvpool replica's settings become its pool and engine
(services/kvpool/config.py `KvPoolConfig.validate`, services/kvpool/app.py `build_replica`,
`pool_blocks`, `load_model`, `device_problem`).

The reference model below is written from the documentation alone: docs/settings.md (the kvpool
table), docs/capacity.md §1 (bytes per block), the settings' comments and the rules their
messages state ("must be in 1..256", ...), and the index's Register rules that the config's
comments say a replica must meet. For seeded random settings (defaults, boundary values on each
side, invalid values, unicode) and random model shapes (Llama-shaped, with or without explicit
head_dim and GQA, Mistral-shaped with a sliding window shorter or longer than the positions) it
predicts either which variable start-up names (load_config's ConfigError, `device_problem`,
`pool_problem` from the config.json before the load, which must refuse what `pool_blocks`'
ValueError refuses after it, in its words) or the pool and engine the replica runs with:
blocks, block size, served context, pin limits, eviction policy, batch and prefill limits,
threads, drafts, the KV tensor's shape, dtype and bytes, working rows when preallocated, and
the start-up warning of a pool holding less than one context. The real side is the code path
`__main__` takes (load_config, device_problem, pool_problem, build_replica) over a real
transformers model built on the meta device (shapes only: no weights, no memory, so a 4 GB pool
costs nothing); a tiny real model saved to a folder takes the whole `load_model` path (dtype of
weights and KV, model id from the folder). docs/capacity.md's per-block table and its 512 MiB =
728 blocks example, and docs/settings.md's 8 x 8,192-token working rows, are checked against
what the code computes.

Seeds: KVAPP_DIFFERENTIAL_SEEDS (default 300, ~3 s here); 20,000 were run offline. Bugs
injected one at a time into a scratch copy of app.py and config.py (boundaries of the pool
sizing, MAX_BLOCKS and every bound, the warning, the pin shares, values passed to the pool and
engine, the dtype of the load, the device and Register checks): 24 of 24 caught at the
default seed count (21 of 24 before the generator weighted the MAX_BLOCKS edges and the
fractions binary floating point misses).

Found (fixed; guarded in test_config_rules.py and test_app_rules.py, each seen failing first):
- a device "cuda:00", "cuda:01" or with non-ASCII digits ("cuda:\u0661") passed validation;
  torch refuses the string, and on a GPU host the replica failed with a traceback (exit 1)
  only after the model had loaded (`model.to`), not with a ConfigError naming
  TIERCACHE_KVPOOL_DEVICE;
- with a prefix index configured, the announced address (advertise_address, else address)
  was not held to the index's Register rules: port 0 ("any free port"), more than 256
  characters or a character that is not printable, and every Register was refused (the
  replica served, never indexed) - what the replica_id rules already guard against;
- the pin limits took `int(n * fraction)` in binary floating point: 100 blocks x 0.29 gave 28,
  not 29 (likewise 0.57 and 0.58 of 100, 0.58 of 50): a share's last block was refused.
Left as is: max(1, ...) lets the pins of a 1-block pool hold all of it (the code's floor; such
a pool serves nothing anyway); a malformed draft_ladder is refused even with drafts off ("only
read when drafts are on": failing fast on a typo is kept); torch keeps a device index in 8 bits
(cuda:300 is cuda:44 to it), which `device_problem` covers by refusing an index past the
devices visible; kv_cache_bytes that hold no block, or more than MAX_BLOCKS, are refused only
once the model has loaded (the bytes per block need the model), under __main__'s "the model
could not be loaded" wording, naming the variable.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
import re
import tempfile
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from services.common.config import ConfigError, is_host_port, load_config
from services.kvpool.app import build_replica, device_problem, pool_blocks, pool_problem
from services.kvpool.config import KvPoolConfig
from services.kvpool.engine import model_info
from tests.blank_text import blank

SEEDS = int(os.environ.get("KVAPP_DIFFERENTIAL_SEEDS", "300"))
K = "TIERCACHE_KVPOOL_"
ROOT = Path(__file__).resolve().parents[2]

# ---- the reference model (from the docs) ---------------------------------------------------

MAX_BLOCKS_DOC = 4_194_304  # "must be at most 4,194,304 (a pool that large fits no memory)"
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DEFAULTS = {"device": "cpu", "dtype": "float32", "num_blocks": 0, "kv_cache_bytes": 512 << 20,
            "block_size": 16, "max_batch_size": 8, "max_prefill_chunk": 512,
            "max_new_tokens_limit": 2048, "max_waiting": 256, "max_context": 0,
            "torch_threads": 0, "one_thread_below": 256, "shallow_tokens": 128,
            "eviction_policy": "hybrid", "max_draft_tokens": 16, "draft_branches": 4,
            "draft_ladder": "auto", "drafts": True, "prefix_caching": True,
            "prompt_lookup": False, "draft_batch_gate": True, "draft_costs_learned": True,
            "preallocate_rows": False, "max_pinned_fraction": "0.5",
            "max_pinned_per_tenant_fraction": "0.25", "model_id": "", "replica_id": "kvpool-0",
            "address": "127.0.0.1:50054", "advertise_address": "", "prefix_address": ""}


@dataclass(frozen=True)
class Arch:
    """A model's shape as its config.json states it."""

    layers: int
    heads: int
    kv_heads: int | None  # None: not in the config (= heads)
    hidden: int
    head_dim: int | None  # None: not in the config (= hidden / heads)
    max_pos: int
    window: int | None = None  # Mistral's sliding_window


def ladder_ok(text: str, top: int) -> bool:
    """'a,b,c': three ascending lengths in 1..top (digits, spaces around them allowed)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(re.fullmatch(r"[0-9]+", p) for p in parts):
        return False
    a, b, c = map(int, parts)
    return 1 <= a <= b <= c <= top


def device_ok(d: str) -> bool:
    """'cpu' or 'cuda[:N]', N a device index as torch writes it."""
    if d in ("cpu", "cuda"):
        return True
    return d.startswith("cuda:") and re.fullmatch(r"0|[1-9][0-9]*", d[5:]) is not None


def register_ok(value: str) -> bool:
    """The index's Register rules for a replica id or address."""
    return (0 < len(value) <= 256 and value.isprintable() and not blank(value)
            and not any(c.isspace() for c in value) and "\0" not in value)


def stripped(s: dict) -> dict:
    """Surrounding whitespace is never meant: values are read without it (services/common)."""
    return {k: v.strip() if isinstance(v, str) else v for k, v in s.items()}


def config_violations(s: dict) -> set[str]:
    """Every variable whose documented rule `s` breaks (start-up names one of them)."""
    s = stripped(s)
    bad = set()

    def rule(ok: bool, name: str) -> None:
        if not ok:
            bad.add(K + name.upper())

    rule(device_ok(s["device"]), "device")
    rule(s["dtype"] in DTYPE_BYTES, "dtype")
    rule(0 <= s["num_blocks"] <= MAX_BLOCKS_DOC, "num_blocks")
    rule(s["num_blocks"] > 0 or s["kv_cache_bytes"] > 0, "kv_cache_bytes")
    rule(1 <= s["block_size"] <= 1024, "block_size")
    rule(1 <= s["max_batch_size"] <= 256, "max_batch_size")
    for name in ("max_prefill_chunk", "max_new_tokens_limit", "max_waiting"):
        rule(s[name] >= 1, name)
    rule(s["max_context"] == 0 or s["max_context"] >= 2, "max_context")
    rule(0 <= s["torch_threads"] <= 1024, "torch_threads")
    rule(s["one_thread_below"] >= 0, "one_thread_below")
    rule(s["shallow_tokens"] >= 0, "shallow_tokens")
    rule(s["eviction_policy"] in ("hybrid", "lru"), "eviction_policy")
    rule(1 <= s["max_draft_tokens"] <= 64, "max_draft_tokens")
    rule(1 <= s["draft_branches"] <= 16, "draft_branches")
    rule(s["draft_ladder"] == "auto" or ladder_ok(s["draft_ladder"], s["max_draft_tokens"]),
         "draft_ladder")
    pinned, tenant = Fraction(s["max_pinned_fraction"]), Fraction(
        s["max_pinned_per_tenant_fraction"])
    rule(0 < pinned <= 1, "max_pinned_fraction")
    if not 0 < tenant <= pinned:
        # Of two settings in conflict, the one the user changed is named.
        set_by_user = tenant <= 0 or tenant != Fraction(DEFAULTS[
            "max_pinned_per_tenant_fraction"])
        rule(False, "max_pinned_per_tenant_fraction" if set_by_user else "max_pinned_fraction")
    rule(len(s["model_id"]) <= 256 and "\0" not in s["model_id"]
         and (not s["model_id"] or not blank(s["model_id"])), "model_id")
    rule(register_ok(s["replica_id"]), "replica_id")
    if s["advertise_address"]:
        rule(is_host_port(s["advertise_address"]), "advertise_address")
    announced = s["advertise_address"] or s["address"]
    if s["prefix_address"] and not (register_ok(announced) and is_host_port(announced)):
        # The index (and its server's host:port check, port 1..65535) would refuse every
        # Register: the replica served, never indexed.
        rule(False, "advertise_address" if s["advertise_address"] else "address")
    return bad


@dataclass
class Expected:
    blocks: int
    context: int
    block_bytes: int
    max_pinned: int
    max_pinned_per_salt: int
    warns: bool


def share(n: int, fraction: str) -> int:
    """The blocks a share of the pool holds (at least one)."""
    return max(1, int(n * Fraction(fraction)))


def expected_build(s: dict, arch: Arch) -> Expected | str:
    """What the replica runs with, or the variable start-up names."""
    kv = arch.kv_heads or arch.heads
    hd = arch.head_dim or arch.hidden // arch.heads
    context = arch.max_pos if arch.window is None else min(arch.max_pos, arch.window)
    if s["max_context"] > 0:
        context = min(context, s["max_context"])
    per = arch.layers * 2 * kv * hd * s["block_size"] * DTYPE_BYTES[s["dtype"]]
    if s["num_blocks"] > 0:
        n = s["num_blocks"]
    else:
        n = s["kv_cache_bytes"] // per
        if n == 0 or n > MAX_BLOCKS_DOC:
            return K + "KV_CACHE_BYTES"
    return Expected(n, context, per, share(n, s["max_pinned_fraction"]),
                    share(n, s["max_pinned_per_tenant_fraction"]),
                    n * s["block_size"] < context)


# ---- random settings and shapes ------------------------------------------------------------


def random_arch(rng: random.Random) -> Arch:
    heads = rng.choice([1, 2, 3, 4, 8, 9, 12])
    kv = rng.choice([None] + [k for k in (1, 2, 3, 4, 8) if heads % k == 0])
    head_dim = rng.choice([None, 8, 16, 64])
    hidden = heads * rng.choice([8, 16, 32])
    window = None
    max_pos = rng.choice([2, 16, 17, 100, 512, 1024, 8192, 32768])
    if rng.random() < 0.25:
        window = rng.choice([4, 16, 64, 4096, 65536])
    return Arch(rng.randint(1, 6), heads, kv, hidden, head_dim, max_pos, window)


def random_settings(rng: random.Random, arch: Arch) -> dict:
    """Settings for one start: each the default or another value its rule takes, and (in
    about half of the seeds) one to three of them a value its rule refuses."""
    dtype = rng.choice(["float32", "float16", "bfloat16"])
    block_size = rng.choice([16, 1, 2, 4, 7, 32, 1024])
    per = (arch.layers * 2 * (arch.kv_heads or arch.heads)
           * (arch.head_dim or arch.hidden // arch.heads) * block_size * DTYPE_BYTES[dtype])
    k = rng.choice([1, 2, 3, 50, 100, 999, 19_999])
    drafts = rng.random() < 0.6
    # name: (values the docs' rule takes, values it refuses)
    table = {
        "dtype": ([dtype], ["float64", "int8", "fp16", "Float32"]),
        "device": (["cpu", "cuda", "cuda:0", "cuda:1", "cuda:10", " cpu "],
                   ["cuda:00", "cuda:01", "cuda:\u0661", "tpu", "cuda:", "cuda:-1", "CPU",
                    "cuda:+1", "cpu:0"]),
        "block_size": ([block_size], [1025, 0, -3]),
        "num_blocks": ([0, 0, 0, 0, 1, 2, 3, 7, 50, 64, 100, 100, 1000, MAX_BLOCKS_DOC],
                       [-1, MAX_BLOCKS_DOC + 1]),
        "kv_cache_bytes": ([k * per, k * per + rng.randint(1, per - 1) if per > 1 else k * per,
                            k * per - 1, per, per - 1, 50 * per, 100 * per + per // 2,
                            MAX_BLOCKS_DOC * per, (MAX_BLOCKS_DOC + 1) * per - 1,
                            (MAX_BLOCKS_DOC + 1) * per, 512 << 20], [0, -per]),
        "max_batch_size": ([1, 2, 8, 256], [257, 0]),
        "max_prefill_chunk": ([512, 1, 3], [0, -1]),
        "max_new_tokens_limit": ([2048, 1], [0]),
        "max_waiting": ([256, 1], [0]),
        "max_context": ([0, 2, 3, 15, 16, 17, 100, arch.max_pos - 1, arch.max_pos,
                         arch.max_pos + 1, 10 ** 9], [1, -5]),
        "torch_threads": ([0, 1, 2, 1024], [1025, -1]),
        "one_thread_below": ([256, 0, 1], [-1]),
        "shallow_tokens": ([128, 0, 5], [-1]),
        "eviction_policy": (["hybrid", "lru"], ["fifo", "LRU"]),
        "max_draft_tokens": ([16, 4, 64], [65, 0]),
        "draft_branches": ([4, 1, 16], [17, 0]),
        "drafts": ([drafts], []),
        # "auto" with drafts on times forwards (seconds): a fixed ladder, or drafts off.
        "draft_ladder": (["1,1,1", "1,2,4", "2, 4,16", "4,8,16", "4 ,4, 4"]
                         + ([] if drafts else ["auto"]),
                         ["1,2,64", "3,2,4", "0,1,2", "1,2", "fast", "\u0661,2,3", "+1,2,3",
                          "1,2,3,4", "1,,2"]),
        "prefix_caching": ([True, False], []),
        "prompt_lookup": ([True, False], []),
        "draft_batch_gate": ([True, False], []),
        "draft_costs_learned": ([True, False], []),
        "preallocate_rows": ([True, False], []),
        # 0.29, 0.57, 0.58, 0.07, 0.14 of 50 or 100 blocks: binary floating point falls short
        "max_pinned_fraction": (["0.5", "1", "0.29", "0.57", "0.58", "0.58", "0.1", "0.01",
                                 "0.7", "0.25"], ["1.5", "0", "-0.5"]),
        "max_pinned_per_tenant_fraction": (["0.25", "0.29", "0.29", "0.07", "0.14", "0.01",
                                            "0.35"],
                                           ["0.6", "1", "0", "-1"]),
        "model_id": (["", "m", "\u00e9t\u00e9-7B", "m" * 256, "with space"],
                     ["m" * 257, "a\0b", "\u3164"]),
        "replica_id": (["kvpool-0", "r" * 256, "\u03c1\u03b5\u03c0-1"],
                       ["r" * 257, "r 1", "r\t1", "", "r\u200b1", "r\x7f", "\u3164"]),
        "prefix_address": (["", "127.0.0.1:50053", "127.0.0.1:50053,127.0.0.1:50055"], []),
        "address": (["127.0.0.1:50054", "0.0.0.0:0", "[::1]:50054", "h" * 251 + ":5005"],
                    ["h" * 252 + ":5005", "k\u200bv:1"]),
        "advertise_address": (["", "kvpool-0.kvpool:50054", "fd00:10:244::5:50054",
                               "a" * 250 + ":50054", "\u00e9t\u00e9:1"],
                              ["a" * 251 + ":50054", "a\u200bb:1", "a\x7fb:1"]),
    }
    s = dict(DEFAULTS)
    for name, (good, _) in table.items():
        if rng.random() < 0.5 or name in ("dtype", "block_size", "drafts"):
            s[name] = rng.choice(good)
    if s["drafts"] and s["draft_ladder"] == "auto":
        s["draft_ladder"] = "1,2,4"
    refusable = sorted(n for n, (_, bad) in table.items() if bad)
    for name in rng.sample(refusable, rng.choice([0, 0, 0, 1, 1, 2, 3])):
        s[name] = rng.choice(table[name][1])
    return s


def as_env(s: dict) -> dict[str, str]:
    """The settings as environment variables (only those that differ from the defaults)."""
    env = {}
    for name, value in s.items():
        if value == DEFAULTS[name]:
            continue
        if isinstance(value, bool):
            env[K + name.upper()] = "true" if value else "false"
        else:
            env[K + name.upper()] = str(value)
    return env


# ---- the real side -------------------------------------------------------------------------

def meta_model(arch: Arch, dtype: torch.dtype):
    """A transformers model of `arch`'s shape, built on the meta device (no weights)."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    kw = dict(vocab_size=64, hidden_size=arch.hidden, intermediate_size=32,
              num_hidden_layers=arch.layers, num_attention_heads=arch.heads,
              max_position_embeddings=arch.max_pos, attn_implementation="sdpa")
    # Left out, Llama's config takes the attention heads and hidden / heads (as it reads a
    # config.json without them); Mistral's own default is 8 KV heads: given.
    if arch.kv_heads is not None or arch.window is not None:
        kw["num_key_value_heads"] = arch.kv_heads or arch.heads
    if arch.head_dim is not None:
        kw["head_dim"] = arch.head_dim
    if arch.window is not None:
        config, cls = MistralConfig(sliding_window=arch.window, **kw), MistralForCausalLM
    else:
        config, cls = LlamaConfig(**kw), LlamaForCausalLM
    with torch.device("meta"):
        return cls(config).to(dtype).eval()


class Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture
def app_warnings():
    handler = Warnings()
    logger = logging.getLogger("services.kvpool.app")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def start(env: dict[str, str], arch: Arch, warnings: Warnings):
    """What `python -m services.kvpool` does up to serving, over a meta model of `arch`:
    (variable named, None) or (None, replica)."""
    try:
        cfg = load_config(KvPoolConfig, "kvpool", [], environ=env)
    except ConfigError as e:
        return str(e).split(":", 1)[0], None
    if device_problem(cfg.device):
        return K + "DEVICE", None
    model = meta_model(arch, TORCH_DTYPES[cfg.dtype])
    # `__main__` judges kv_cache_bytes from the model's config.json before it loads: it must
    # refuse exactly what the pool's sizing after the load refuses, in the same words.
    with tempfile.TemporaryDirectory() as folder:
        model.config.save_pretrained(folder)
        early = pool_problem(dataclasses.replace(cfg, model=folder))
    if early:
        with pytest.raises(ValueError) as late:
            pool_blocks(cfg, model_info(model, "m"), TORCH_DTYPES[cfg.dtype])
        assert str(late.value) == early
        return early.split(":", 1)[0], None
    warnings.messages.clear()
    try:
        if cfg.num_blocks > 20_000 or (cfg.num_blocks == 0 and cfg.kv_cache_bytes
                                       > 20_000 * _block_bytes(arch, cfg)):
            # A pool of millions of blocks: the pool's own bookkeeping takes seconds; the
            # sizing is what is compared (`pool_blocks`, as build_replica calls it).
            return None, pool_blocks(cfg, model_info(model, "m"), TORCH_DTYPES[cfg.dtype])
        return None, build_replica(cfg, model=model, metrics=False)
    except ValueError as e:
        assert not str(e).startswith(K + "KV_CACHE_BYTES"), f"passed before the load: {e}"
        return str(e).split(":", 1)[0], None


def _block_bytes(arch: Arch, cfg: KvPoolConfig) -> int:
    return (arch.layers * 2 * (arch.kv_heads or arch.heads)
            * (arch.head_dim or arch.hidden // arch.heads) * cfg.block_size
            * DTYPE_BYTES[cfg.dtype])


def check_replica(s: dict, want: Expected, replica, warnings: Warnings, where: str,
                  threads_before: int) -> None:
    eng, pool, store = replica.engine, replica.engine.pool, replica.engine.store
    eng.call(lambda: None).result(10)  # the engine thread has started (it sets `threads`)
    bs = s["block_size"]
    assert replica.info.max_context == want.context, where
    assert (pool.num_blocks, pool.block_size) == (want.blocks, bs), where
    assert (pool.max_pinned, pool.max_pinned_per_salt) == (want.max_pinned,
                                                          want.max_pinned_per_salt), where
    assert pool.record_events == bool(s["prefix_address"]), where
    policy = type(pool.policy).__name__
    assert policy == {"hybrid": "HybridPolicy", "lru": "LRUPolicy"}[s["eviction_policy"]], where
    if s["eviction_policy"] == "hybrid":
        assert pool.policy.shallow_tokens == s["shallow_tokens"], where
    assert pool.hasher.block_size == bs, where
    for name, attr in (("max_batch_size", "max_batch_size"),
                       ("max_prefill_chunk", "max_prefill_chunk"),
                       ("max_waiting", "max_waiting"), ("drafts", "drafts"),
                       ("prefix_caching", "prefix_caching"),
                       ("max_draft_tokens", "max_draft_tokens"),
                       ("draft_branches", "draft_branches"),
                       ("one_thread_below", "one_thread_below"),
                       ("draft_batch_gate", "batch_gate"), ("prompt_lookup", "prompt_lookup"),
                       ("draft_costs_learned", "learn_costs")):
        assert getattr(eng, attr) == s[name], (where, name)
    # "0 = torch's default": the count the engine thread started with
    assert eng.threads == (s["torch_threads"] or threads_before), where
    assert store.blocks.dtype == TORCH_DTYPES[s["dtype"]], where
    assert store.max_rows == s["max_batch_size"], where
    assert store.nbytes()[0] == want.blocks * want.block_bytes, where
    per_token = want.block_bytes // bs
    if s["preallocate_rows"]:  # rows for the whole context, in blocks
        assert want.context <= store.capacity < want.context + bs, where
        assert store.nbytes()[1] == per_token * s["max_batch_size"] * store.capacity, where
    if s["drafts"]:
        assert eng.draft_ladder.source == "configured", where
        assert eng.draft_ladder.ladder == tuple(int(p) for p in s["draft_ladder"].split(",")), \
            where
    else:  # only read when drafts are on
        assert eng.draft_ladder.source != "configured", where
    warned = [m for m in warnings.messages if "less than the" in m]
    assert bool(warned) == want.warns, (where, warnings.messages)


def run_seed(seed: int, warnings: Warnings) -> str:
    """One random start-up, model against code; returns what happened (for the tally)."""
    rng = random.Random(seed)
    arch = random_arch(rng)
    s = random_settings(rng, arch)
    env = as_env(s)
    where = f"seed {seed}: {env} {arch}"
    threads = torch.get_num_threads()
    try:
        named, replica = start(env, arch, warnings)
    finally:  # an engine given torch_threads sets the process's count
        torch.set_num_threads(threads)
    s = stripped(s)
    bad = config_violations(s)
    if bad:
        assert named in bad, (where, named, bad)
        return "config"
    if s["device"] != "cpu" and not torch.cuda.is_available():
        assert named == K + "DEVICE", (where, named)
        return "device"
    want = expected_build(s, arch)
    if isinstance(want, str):
        assert named == want, (where, named, want)
        return "pool"
    assert named is None, (where, named, want)
    if isinstance(replica, int):
        assert replica == want.blocks, where
        return "sized"
    try:
        check_replica(s, want, replica, warnings, where, threads)
    finally:
        replica.engine.stop()
    return "built"


def test_settings_become_the_pool_and_engine_the_docs_say(app_warnings):
    tally: dict[str, int] = {}
    for seed in range(SEEDS):
        what = run_seed(seed, app_warnings)
        tally[what] = tally.get(what, 0) + 1
    # Every outcome is reached (else the generator drifted and the test checks little).
    assert set(tally) >= {"config", "device", "pool", "built"}, tally
    assert tally["built"] >= SEEDS // 10, tally


def test_every_device_the_config_takes_is_one_torch_takes():
    """A device string validation lets through must be one torch parses to the same device:
    torch refuses "cuda:00" and non-ASCII digits, and on a GPU host the replica then failed
    with a traceback after the model had loaded."""
    rng = random.Random(0)
    alphabet = "cuda:0123\u0661\u00b2 +-x"
    samples = ["cpu", "cuda", "cuda:0", "cuda:00", "cuda:01", "cuda:10", "cuda:\u0661",
               "cuda:\u00b2", "cuda:+1"]
    samples += ["cuda:" + "".join(rng.choice("0123\u0661 +") for _ in range(rng.randint(1, 3)))
                for _ in range(200)]
    samples += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 8)))
                for _ in range(300)]
    for d in samples:
        try:
            KvPoolConfig(device=d).validate()
        except ConfigError as e:
            assert str(e).startswith(K + "DEVICE"), d
            assert not device_ok(d), d
            continue
        assert device_ok(d), d
        if d == "cuda" or int(d.partition(":")[2] or 0) < 128:
            # (torch keeps an index in 8 bits: cuda:300 is cuda:44 to it; `device_problem`
            # refuses an index past the devices visible, before anything loads.)
            assert str(torch.device(d)) == d, d


def test_a_configured_prefix_index_takes_the_replicas_register():
    """With a prefix index configured, every setting validation takes gives a Register the
    index takes (its own rules, the real PrefixIndex and the server's address check)."""
    from services.prefix.index import PrefixIndex

    rng = random.Random(1)
    taken = 0
    for seed in range(400):
        arch = random_arch(rng)
        s = random_settings(random.Random(seed), arch)
        s["prefix_address"] = "127.0.0.1:50053"
        try:
            cfg = load_config(KvPoolConfig, "kvpool", [], environ=as_env(s))
        except ConfigError:
            continue
        taken += 1
        index = PrefixIndex(block_size=cfg.block_size)
        assert is_host_port(cfg.public_address), cfg.public_address
        index.register(cfg.replica_id, "inc-1", cfg.public_address,
                       cfg.model_id or "SmolLM2-135M-Instruct", cfg.block_size)
    assert taken >= 5


# ---- the real load path: dtype and model id from a folder ----------------------------------

@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from tests.kvpool.conftest import make_tiny_model

    path = tmp_path_factory.mktemp("models") / "tiny-\u00e9t\u00e9"
    make_tiny_model(max_pos=256).save_pretrained(path)
    return path


@pytest.mark.parametrize("seed", range(3))
def test_a_model_folder_loads_in_the_configured_dtype(tiny_folder, app_warnings, seed):
    rng = random.Random(seed)
    arch = Arch(2, 4, 2, 64, None, 256)  # make_tiny_model's shape
    s = dict(DEFAULTS)
    s.update(dtype=("float32", "float16", "bfloat16")[seed], drafts=False,
             block_size=rng.choice([1, 4, 16]), max_context=rng.choice([0, 2, 100, 300]),
             preallocate_rows=rng.random() < 0.5, model_id=rng.choice(["", "served-id"]))
    per = _block_bytes(arch, KvPoolConfig(block_size=s["block_size"], dtype=s["dtype"]))
    s["kv_cache_bytes"] = rng.randint(1, 40) * per + rng.randint(0, per - 1)
    env = as_env(s)
    env[K + "MODEL"] = str(tiny_folder)
    env[K + "LINEAR_KERNELS"] = rng.choice(["onednn", "torch"])
    cfg = load_config(KvPoolConfig, "kvpool", [], environ=env)
    want = expected_build(s, arch)
    threads = torch.get_num_threads()
    replica = build_replica(cfg, metrics=False)
    try:
        assert next(replica.engine.model.parameters()).dtype == TORCH_DTYPES[s["dtype"]]
        # "empty = derived from the model (... or the folder name)"
        assert replica.info.model_id == (s["model_id"] or tiny_folder.name)
        check_replica(s, want, replica, app_warnings, str(env), threads)
    finally:
        replica.engine.stop()


def test_a_cuda_device_without_cuda_is_named_before_the_model_loads(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    for d in ("cuda", "cuda:0", "cuda:3"):
        # A folder that does not exist: the device is refused before anything is read.
        cfg = KvPoolConfig(device=d, model=str(tmp_path / "absent"))
        with pytest.raises(ValueError, match=f"^TIERCACHE_KVPOOL_DEVICE={d}: this torch"):
            build_replica(cfg, metrics=False)


# ---- docs/capacity.md and docs/settings.md's figures ---------------------------------------

UNITS = {"KiB": 1 << 10, "MiB": 1 << 20}


def _size(text: str) -> int:
    number, unit = text.split()
    return int(float(number) * UNITS[unit])


SMOLLM2 = Arch(30, 9, 3, 576, 64, 8192)


def test_capacity_tables_bytes_per_block_are_the_codes():
    """docs/capacity.md §1: each row's fp32 and bf16 block and bf16 token, from its layers,
    KV heads and head dim, as the pool sizes a block (16 tokens)."""
    doc = (ROOT / "docs/capacity.md").read_text()
    rows = re.findall(r"^\| ([^|]+) \| (\d+) \| (\d+) \| (\d+) \| ([^|]+) \| ([^|]+) \| "
                      r"([^|]+) \|$", doc, re.M)
    assert len(rows) == 6, rows
    for name, layers, kv, hd, fp32, bf16, bf16_token in rows:
        arch = Arch(int(layers), int(kv), int(kv), int(kv) * int(hd), int(hd), 4096)
        info = model_info(meta_model(arch, torch.float32), name)
        for dtype, figure in (("float32", fp32), ("bfloat16", bf16)):
            per = _size(figure)
            # Exactly one block's bytes make a pool of one; a byte less, none.
            assert pool_blocks(KvPoolConfig(kv_cache_bytes=per), info,
                               TORCH_DTYPES[dtype]) == 1, (name, dtype)
            with pytest.raises(ValueError, match="hold no KV block"):
                pool_blocks(KvPoolConfig(kv_cache_bytes=per - 1), info, TORCH_DTYPES[dtype])
        assert _size(bf16_token) * 16 == _size(bf16), name
    assert rows[0][1:4] == ("30", "3", "64")  # SmolLM2-135M, as below


def smollm2_model():
    """SmolLM2-135M's shape: from its config in the local model cache where it is there."""
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(os.environ.get("TIERCACHE_CACHE_DIR") or "~/.cache/tiercache").expanduser() \
        / "models" / "SmolLM2-135M-Instruct"
    if not (folder / "config.json").is_file():
        return meta_model(SMOLLM2, torch.float32)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def test_the_default_pool_and_working_rows_of_smollm2_are_what_the_docs_say(app_warnings):
    """capacity.md: "kv_cache_bytes = 512 MiB is therefore 728 SmolLM2-135M fp32 blocks
    (11.6k tokens)"; settings.md (max_context): "SmolLM2 fp32: 46 KB per token, so 8 x 8,192
    tokens = 3.0 GB; up to 1.5x that while the last growth step copies"."""
    capacity = (ROOT / "docs/capacity.md").read_text()
    settings = (ROOT / "docs/settings.md").read_text()
    assert "`kv_cache_bytes = 512 MiB` is therefore 728 SmolLM2-135M fp32 blocks\n(11.6k " \
           "tokens)" in capacity
    assert "46 KB per token, so 8 x 8,192 tokens = 3.0 GB; up to 1.5x" in settings
    model = smollm2_model()
    replica = build_replica(KvPoolConfig(drafts=False, preallocate_rows=True), model=model,
                            metrics=False)
    try:
        store = replica.engine.store
        assert replica.engine.pool.num_blocks == 728
        assert f"{728 * 16 / 1000:.1f}k" == "11.6k"
        assert replica.info.max_context == 8192
        pool_bytes, rows_bytes = store.nbytes()
        assert round(pool_bytes / 728 / 16 / 1000) == 46
        assert f"{rows_bytes / 1e9:.1f}" == "3.0" and store.capacity == 8192
        assert store.max_rows == 8
    finally:
        replica.engine.stop()
    # The default 8,192-token context is past the default pool's 11,648 tokens? No: no warning.
    assert not [m for m in app_warnings.messages if "less than the" in m]


def test_the_reference_model_reads_the_docs_defaults():
    """The model's defaults are the documented ones (docs/settings.md's kvpool table)."""
    doc = (ROOT / "docs/settings.md").read_text()
    for name, value in DEFAULTS.items():
        if isinstance(value, bool):
            shown = "true" if value else "false"
        else:
            shown = str(value) if value != "" else '""'
        assert f"| `{K}{name.upper()}` | `{shown}` |" in doc, name
