"""A differential review of configuration loading (services/common/config.py `load_config` and
each service's config class): seeded random settings against a model of the documented rules.

The model is written from the docs, not from the loader: each service's settings (name,
variable, flag, default) are read from docs/settings.md itself; a setting `foo_bar` is read
from `TIERCACHE_<SVC>_FOO_BAR` and `--foo-bar` wins over it (the variable then not read at
all); booleans are 1/true/yes/on or 0/false/no/off in any case, numbers are decimal (sign,
spaces, a float's exponent; nan, inf and past 1e9 refused), lists are comma-separated with
blanks dropped, text loses surrounding whitespace, an empty credential or tokens setting is
refused. The limits are the ones the docs and the README state (and each refusal's own
wording), written here as a brute-force table of rules over the resulting values, with the
fields each rule involves. Each random case sets 1-5 settings of one service by variable, by
flag or by both, spelled in every documented way, with boundary values, invalid spellings
and values across the cross-field limits; sometimes a misspelt variable or flag. The model
decides: the config equals the documented values (defaults where unset), or a ConfigError
whose message starts with what the user typed for a field a broken rule involves (the flag if
one was given, else the variable; the other never named instead), for a rule over several
fields one the user set, naming every field involved; a misspelt variable is refused, the
nearest setting offered when it is one edit from a setting's name.

Run: 2,500 seeds per service before the fixes, 5,000 per service after them (clean). Found:
`--internal-token` with a space or an accent was refused naming TIERCACHE_<SVC>_INTERNAL_TOKEN,
not the flag the user typed; semantic `guard_tiers` narrowed alone was blamed on
`verifier_tiers`, which the user never set; and, read off the refusals and by hand beside the
run, `a:1;b:2` got the IPv6 bracket hint, a variable spelt in small letters
(TIERCACHE_KVPOOL_num_blocks) got no hint, orchestrator `warm_min_hits` past 2^63 was refused
as "must be >= 1". All fixed, each with its own test (tests/test_config_rules.py,
tests/semantic/ and tests/orchestrator/test_config_rules.py). Every single-edit misspelling
of every setting's variable (8,237 of them) was refused naming that setting. Undocumented,
reported, not asserted either way: Python's digit separators and non-ASCII digits in numbers
(`1_000`, `\u0661\u0662`), a flag value starting with '-' that is no plain number
(`--grace-seconds -1e-3`: argparse's "expected one argument", exit 2; `=` form works), a
misspelt flag (argparse's "unrecognized arguments", exit 2, no suggestion), a wholly
small-letter name (tiercache_kvpool_...: no TIERCACHE_ variable, ignored).
Teeth (1,000 seeds per service): booleans read case-sensitively failed 450 cases, the variable
winning over the flag 1,933, the half-life conflict always blamed on lease_seconds 22, a
float of exactly 1e9 refused 38, kvpool's heartbeat floor at 0.01 instead of 0.1 4.

More seeds: CONFIG_DIFFERENTIAL_SEEDS=5000 pytest tests/test_config_differential.py (per service).
"""

from __future__ import annotations

import math
import os
import random
import re
from pathlib import Path

import pytest

from services.common.config import ConfigError, load_config
from services.kvpool.config import KvPoolConfig
from services.orchestrator.config import OrchestratorConfig
from services.prefix.config import PrefixConfig
from services.semantic.config import SemanticConfig
from tests.blank_text import blank

SEEDS = int(os.environ.get("CONFIG_DIFFERENTIAL_SEEDS", "1000"))
DOC = Path(__file__).resolve().parents[1] / "docs" / "settings.md"
CLASSES = {"orchestrator": OrchestratorConfig, "semantic": SemanticConfig,
           "prefix": PrefixConfig, "kvpool": KvPoolConfig}
LISTS = {"kvpool_addresses", "prefix_addresses", "guard_tiers", "verifier_tiers"}
# Paths this host must have (semantic checks them in validate): left at their defaults.
FIXED = {("semantic", f) for f in ("model_dir", "cache_dir", "db_path", "snapshot_path",
                                   "verifier_path")} | {("orchestrator", "tokens_file")}
BIG = 1e9  # the largest float a setting may have (docs: seconds, about 31 years)


def read_doc() -> dict[str, dict[str, tuple[str, object]]]:
    """service -> field -> (type, default), from docs/settings.md."""
    out: dict[str, dict[str, tuple[str, object]]] = {}
    svc = ""
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            svc = line[3:].strip()
            out[svc] = {}
            continue
        m = re.match(r"\| `TIERCACHE_([A-Z]+)_([A-Z0-9_]+)` \| `(.*?)` \|", line)
        if not m:
            continue
        assert m.group(1).lower() == svc
        field, shown = m.group(2).lower(), m.group(3)
        if field in LISTS:
            typ, d = "list", tuple(s for s in shown.strip('"').split(",") if s)
        elif shown in ("true", "false"):
            typ, d = "bool", shown == "true"
        elif re.fullmatch(r"-?\d+", shown):
            typ, d = "int", int(shown)
        elif re.fullmatch(r"-?\d+\.\d+", shown):
            typ, d = "float", float(shown)
        else:
            typ, d = "str", "" if shown == '""' else shown
        out[svc][field] = (typ, d)
    return out


SPEC = read_doc()

# --- the documented limits: (fields involved, holds(values)) ------------------------------


def _hostport(a: str, *, listen: bool = False) -> bool:
    host, _, port = a.rpartition(":")  # a host without spaces, commas, semicolons, slashes
    return (bool(host) and not any(c.isspace() or c in ",;/" for c in host) and not blank(host)
            and port.isascii() and port.isdigit()
            and (0 if listen else 1) <= int(port) <= 65535)


def _announced(a: str) -> bool:
    return _hostport(a) and len(a) <= 256 and a.isprintable()


def _addr_list(items) -> bool:
    items = [a.strip() for a in items if a.strip()]
    return (all(_hostport(a) for a in items)
            and len({a.lower() for a in items}) == len(items))


def PORT(v: int) -> bool:  # noqa: N802 (a rule, read as a constant)
    return -1 <= v <= 65535
TIERS = ("strict", "standard", "relaxed")


def _pairs_ok(tokens: str) -> bool:
    seen = set()
    for p in (p.strip() for p in tokens.split(",")):
        if not p:
            continue
        tok, sep, name = p.rpartition("=")
        if not (sep and tok and name) or tok in seen:
            return False
        seen.add(tok)
    return True


def _ladder_ok(ladder: str, top: int) -> bool:
    if ladder == "auto":
        return True
    parts = [p.strip() for p in ladder.split(",")]
    if len(parts) != 3 or not all(re.fullmatch(r"[0-9]+", p) for p in parts):
        return False
    a, b, c = map(int, parts)
    return 1 <= a <= b <= c <= top


def _costs_ok(costs: str, top: int) -> bool:
    """Empty, or top + 1 plain ASCII decimals, the first 1, none under 0.7."""
    if not costs.strip():
        return True
    parts = [p.strip() for p in costs.split(",")]
    if not all(re.fullmatch(r"[0-9]+(\.[0-9]*)?|\.[0-9]+", p, re.ASCII) for p in parts):
        return False
    values = [float(p) for p in parts]
    return len(values) == top + 1 and values[0] == 1 and min(values) >= 0.7


def _at_most_one(name: str):
    return lambda v: v[name] <= 1


def _over_floor(name: str):
    return lambda v: v[name] >= v["threshold_floor"]


RULES: dict[str, list[tuple[tuple[str, ...], object]]] = {
    "prefix": [
        (("address",), lambda v: _hostport(v["address"], listen=True)),
        (("metrics_port",), lambda v: PORT(v["metrics_port"])),
        (("block_size",), lambda v: 1 <= v["block_size"] <= 1024),
        (("lease_seconds",), lambda v: v["lease_seconds"] >= 0.1),
        (("max_nodes",), lambda v: 1 <= v["max_nodes"] < 2**64),
        (("prune_to",), lambda v: 0 < v["prune_to"] <= 0.99),
        (("prune_step",), lambda v: v["prune_step"] >= 1),
        (("eviction_policy",), lambda v: v["eviction_policy"] in ("hybrid", "lru")),
        (("shallow_tokens",), lambda v: v["shallow_tokens"] >= 0),
        (("min_deep_hits",), lambda v: v["min_deep_hits"] >= 0),
        (("cold_after_ticks",), lambda v: v["cold_after_ticks"] >= 0),
        (("hit_half_life_seconds",), lambda v: v["hit_half_life_seconds"] >= 0),
        (("hit_half_life_seconds", "lease_seconds"),
         lambda v: v["hit_half_life_seconds"] <= 0
         or v["hit_half_life_seconds"] >= v["lease_seconds"]),
        (("max_events",), lambda v: 1 <= v["max_events"] < 2**32),
        (("max_blocks",), lambda v: 1 <= v["max_blocks"] < 2**32),
        (("grace_seconds",), lambda v: v["grace_seconds"] >= 0),
    ],
    "kvpool": [
        (("model",), lambda v: v["model"] != ""),
        (("device",), lambda v: re.fullmatch(r"cpu|cuda(:(0|[1-9][0-9]*))?", v["device"])
         is not None),
        (("dtype",), lambda v: v["dtype"] in ("float32", "float16", "bfloat16")),
        (("num_blocks",), lambda v: 0 <= v["num_blocks"] <= 1 << 22),
        (("max_context",), lambda v: v["max_context"] == 0 or v["max_context"] >= 2),
        (("kv_cache_bytes", "num_blocks"),
         lambda v: v["num_blocks"] != 0 or v["kv_cache_bytes"] > 0),
        (("block_size",), lambda v: 1 <= v["block_size"] <= 1024),
        (("max_batch_size",), lambda v: 1 <= v["max_batch_size"] <= 256),
        (("max_prefill_chunk",), lambda v: v["max_prefill_chunk"] >= 1),
        (("max_new_tokens_limit",), lambda v: v["max_new_tokens_limit"] >= 1),
        (("max_waiting",), lambda v: v["max_waiting"] >= 1),
        (("replica_id",), lambda v: 0 < len(v["replica_id"]) <= 256
         and v["replica_id"].isprintable() and not any(c.isspace() for c in v["replica_id"])
         and not blank(v["replica_id"])),
        (("model_id",), lambda v: len(v["model_id"]) <= 256 and "\0" not in v["model_id"]
         and (not v["model_id"] or not blank(v["model_id"]))),
        (("torch_threads",), lambda v: 0 <= v["torch_threads"] <= 1024),
        (("address",), lambda v: _hostport(v["address"], listen=True)),
        (("prefix_address",), lambda v: not v["prefix_address"]
         or (_addr_list(v["prefix_address"].split(","))
             and any(a.strip() for a in v["prefix_address"].split(",")))),
        (("advertise_address",), lambda v: not v["advertise_address"]
         or _hostport(v["advertise_address"])),
        # With a prefix index, the address announced (advertise_address, else address) is one
        # the index takes at Register: host:port with a port 1..65535, 256 printable characters.
        (("address",), lambda v: not v["prefix_address"].strip() or v["advertise_address"]
         or _announced(v["address"])),
        (("advertise_address",), lambda v: not v["prefix_address"].strip()
         or not v["advertise_address"] or _announced(v["advertise_address"])),
        (("metrics_port",), lambda v: PORT(v["metrics_port"])),
        (("heartbeat_seconds",), lambda v: v["heartbeat_seconds"] >= 0.1),
        (("publish_interval_seconds",), lambda v: v["publish_interval_seconds"] >= 0.01),
        (("eviction_policy",), lambda v: v["eviction_policy"] in ("hybrid", "lru")),
        (("max_draft_tokens",), lambda v: 1 <= v["max_draft_tokens"] <= 64),
        (("draft_branches",), lambda v: 1 <= v["draft_branches"] <= 16),
        (("linear_kernels",), lambda v: v["linear_kernels"] in ("onednn", "torch")),
        (("draft_ladder", "max_draft_tokens"),
         lambda v: _ladder_ok(v["draft_ladder"], v["max_draft_tokens"])),
        (("draft_costs", "max_draft_tokens"),
         lambda v: _costs_ok(v["draft_costs"], v["max_draft_tokens"])),
        (("draft_costs", "draft_ladder"),
         lambda v: not v["draft_costs"].strip() or v["draft_ladder"] == "auto"),
        (("shallow_tokens",), lambda v: v["shallow_tokens"] >= 0),
        (("pin_ttl_max_seconds",), lambda v: v["pin_ttl_max_seconds"] >= 1),
        (("grace_seconds",), lambda v: v["grace_seconds"] >= 0),
        (("engine_stall_seconds",), lambda v: v["engine_stall_seconds"] == 0
         or v["engine_stall_seconds"] >= 5),
        (("send_stall_seconds",), lambda v: v["send_stall_seconds"] == 0
         or v["send_stall_seconds"] >= 1),
        (("max_pinned_fraction",), lambda v: 0 < v["max_pinned_fraction"] <= 1),
        (("max_pinned_per_tenant_fraction",),
         lambda v: v["max_pinned_per_tenant_fraction"] > 0),
        (("max_pinned_per_tenant_fraction", "max_pinned_fraction"),
         lambda v: v["max_pinned_per_tenant_fraction"] <= v["max_pinned_fraction"]),
        (("one_thread_below",), lambda v: v["one_thread_below"] >= 0),
    ],
    "orchestrator": [
        (("metrics_port",), lambda v: PORT(v["metrics_port"])),
        (("model",), lambda v: v["model"] != ""),
        # kvpool's rule for the same id.
        (("model_id",), lambda v: len(v["model_id"]) <= 256 and "\0" not in v["model_id"]
         and (not v["model_id"] or not blank(v["model_id"]))),
        (("min_prefix_tokens",), lambda v: v["min_prefix_tokens"] >= 1),
        (("tokens",), lambda v: _pairs_ok(v["tokens"])),
        (("address",), lambda v: _hostport(v["address"], listen=True)),
        (("kvpool_addresses",), lambda v: bool(v["kvpool_addresses"])
         and _addr_list(v["kvpool_addresses"])),
        (("prefix_addresses",), lambda v: _addr_list(v["prefix_addresses"])),
        (("semantic_address",), lambda v: not v["semantic_address"]
         or (_addr_list(v["semantic_address"].split(","))
             and any(a.strip() for a in v["semantic_address"].split(",")))),
        (("block_size",), lambda v: 1 <= v["block_size"] <= 1024),
        (("default_max_tokens",), lambda v: v["default_max_tokens"] > 0),
        (("default_max_tokens", "max_tokens_limit"),
         lambda v: v["default_max_tokens"] <= v["max_tokens_limit"]),
        (("max_tokens_limit",), lambda v: v["max_tokens_limit"] <= 2**31 - 1),
        (("max_prompt_tokens",), lambda v: v["max_prompt_tokens"] > 0),
        (("max_message_chars",), lambda v: v["max_message_chars"] > 0),
        (("max_request_bytes",), lambda v: 65536 <= v["max_request_bytes"] <= 2**31 - 1),
        (("max_concurrent_per_tenant",), lambda v: v["max_concurrent_per_tenant"] >= 0),
        (("request_timeout_s",), lambda v: v["request_timeout_s"] > 0),
        (("semantic_timeout_s",), lambda v: v["semantic_timeout_s"] > 0),
        (("prefix_timeout_s",), lambda v: v["prefix_timeout_s"] > 0),
        (("grace_s",), lambda v: v["grace_s"] >= 0),
        (("tokens_reload_s",), lambda v: v["tokens_reload_s"] == 0
         or v["tokens_reload_s"] >= 0.5),
        (("max_connection_age_s",), lambda v: v["max_connection_age_s"] >= 0),
        (("semantic_tier",), lambda v: v["semantic_tier"] in TIERS),
        (("routing_policy",), lambda v: v["routing_policy"] in ("prefix", "round_robin")),
        (("routing_epsilon",), lambda v: v["routing_epsilon"] > 0),
        (("routing_load_window_s",), lambda v: v["routing_load_window_s"] > 0),
        (("routing_load_floor",), lambda v: 0 <= v["routing_load_floor"] <= 1024),
        (("dispatch_memory_s",), lambda v: v["dispatch_memory_s"] >= 0),
        (("max_attempts",), lambda v: v["max_attempts"] >= 1),
        (("replica_poll_s",), lambda v: v["replica_poll_s"] >= 0.01),
        (("warm_interval_s",), lambda v: v["warm_interval_s"] <= 0
         or v["warm_interval_s"] >= 1),
        (("replica_stats_timeout_s",), lambda v: v["replica_stats_timeout_s"] > 0),
        (("replica_hung_polls",), lambda v: 1 <= v["replica_hung_polls"] <= 100),
        (("replica_stall_s",), lambda v: v["replica_stall_s"] >= 0),
        (("warm_pin_ttl_s",), lambda v: v["warm_pin_ttl_s"] > 0),
        (("warm_pin_ttl_max_s", "warm_pin_ttl_s"),
         lambda v: v["warm_pin_ttl_max_s"] >= v["warm_pin_ttl_s"]),
        (("warm_pin_ttl_max_s",), lambda v: v["warm_pin_ttl_max_s"] < 2**32),
        (("warm_top_k",), lambda v: v["warm_top_k"] >= 0),
        (("warm_min_hits",), lambda v: 1 <= v["warm_min_hits"] <= 2**63),
        (("warm_max_prefills_per_call",),
         lambda v: 1 <= v["warm_max_prefills_per_call"] <= 4096),
        (("warm_max_load",), lambda v: v["warm_max_load"] >= 0),
        (("warm_max_prompts_per_cycle",), lambda v: v["warm_max_prompts_per_cycle"] >= 0),
        (("max_workers",), lambda v: v["max_workers"] > 8),
        (("max_concurrent_rpcs", "max_workers"), lambda v: v["max_concurrent_rpcs"] == 0
         or v["max_concurrent_rpcs"] > v["max_workers"]),
    ],
    "semantic": [
        (("address",), lambda v: _hostport(v["address"], listen=True)),
        (("metrics_port",), lambda v: PORT(v["metrics_port"])),
        (("onnx_threads",), lambda v: 0 <= v["onnx_threads"] <= 1024),
        (("onnx_exporter",), lambda v: v["onnx_exporter"] in ("torchscript", "dynamo")),
        (("max_batch",), lambda v: 1 <= v["max_batch"] <= 1024),
        (("batch_wait_ms",), lambda v: 0 <= v["batch_wait_ms"] <= 100),
        (("sqlite_synchronous",),
         lambda v: v["sqlite_synchronous"].upper() in ("FULL", "NORMAL", "EXTRA")),
        (("hnsw_min_entries",), lambda v: v["hnsw_min_entries"] >= 1),
        (("hnsw_m",), lambda v: 4 <= v["hnsw_m"] <= 128),
        (("hnsw_ef_construction",), lambda v: 8 <= v["hnsw_ef_construction"] <= 32768),
        (("hnsw_ef_search",), lambda v: 8 <= v["hnsw_ef_search"] <= 32768),
        (("faiss_threads",), lambda v: 1 <= v["faiss_threads"] <= 1024),
        (("delta_capacity",), lambda v: v["delta_capacity"] >= 1),
        *[((t,), _at_most_one(t)) for t in ("tier_strict", "tier_standard", "tier_relaxed")],
        *[((t, "threshold_floor"), _over_floor(t))
          for t in ("tier_strict", "tier_standard", "tier_relaxed")],
        (("tier_relaxed", "tier_standard"), lambda v: v["tier_relaxed"] <= v["tier_standard"]),
        (("tier_standard", "tier_strict"), lambda v: v["tier_standard"] <= v["tier_strict"]),
        (("grace_seconds",), lambda v: v["grace_seconds"] >= 0),
        (("index_close_seconds",), lambda v: v["index_close_seconds"] >= 0),
        (("snapshot_interval_s",), lambda v: v["snapshot_interval_s"] == 0
         or v["snapshot_interval_s"] >= 1),
        (("max_tenant_chars",), lambda v: v["max_tenant_chars"] >= 64),
        (("default_tier",), lambda v: v["default_tier"] in TIERS),
        (("threshold_floor",), lambda v: 0 < v["threshold_floor"] <= 1),
        (("verified_bonus",), lambda v: 0 <= v["verified_bonus"] < 0.2),
        (("draft_floor",), lambda v: v["draft_floor"] > 0),
        (("draft_floor", "threshold_floor"), lambda v: v["draft_floor"] <= v["threshold_floor"]),
        (("guard_tiers",), lambda v: all(t in TIERS for t in v["guard_tiers"])),
        (("verifier_tiers", "guard_tiers"),
         lambda v: set(v["verifier_tiers"]) <= set(v["guard_tiers"])),
        (("default_ttl_seconds",), lambda v: v["default_ttl_seconds"] >= 0),
        (("default_ttl_seconds", "max_ttl_seconds"),
         lambda v: v["default_ttl_seconds"] <= v["max_ttl_seconds"]),
        (("max_ttl_seconds",), lambda v: 1 <= v["max_ttl_seconds"] < 2**32),
        (("max_entries_per_namespace",), lambda v: v["max_entries_per_namespace"] >= 1),
        (("max_entries_total",), lambda v: v["max_entries_total"] >= 1),
        (("max_entries_per_tenant",), lambda v: v["max_entries_per_tenant"] >= 0),
        (("max_text_chars",), lambda v: v["max_text_chars"] >= 1),
        (("max_answer_chars",), lambda v: v["max_answer_chars"] >= 1),
        (("max_answer_chars", "max_text_chars"),
         lambda v: 4 * v["max_text_chars"] + 24 * v["max_answer_chars"] + 65536 <= 16 << 20),
        (("expiry_interval_s",), lambda v: v["expiry_interval_s"] >= 0.1),
        (("model_name",), lambda v: v["model_name"] not in (".", "..")
         and v["model_name"].isprintable() and not set("/\\") & set(v["model_name"])
         and (not v["model_name"] or not blank(v["model_name"]))),
    ],
}

# --- random spellings ------------------------------------------------------------------------

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
# Values by field (besides generic boundaries): valid ones and ones the rules refuse.
CHOICES = {
    "address": ["127.0.0.1:0", "h:65535", "h:65536", "h:1", "[::1]:5", "h", ":5", "h:-1",
                "\u3164:1"],
    "eviction_policy": ["hybrid", "lru", "LRU", "lfu", ""],
    "device": ["cpu", "cuda", "cuda:1", "cuda:x", "gpu", ""],
    "dtype": ["float32", "float16", "bfloat16", "fp16", ""],
    "linear_kernels": ["onednn", "torch", "mkl"],
    "replica_id": ["kvpool-1", "a b", "", "x" * 256, "x" * 257, "r\x07", "\u3164"],
    "model_id": ["", "m", "x" * 257, "\u3164"],
    "model": ["smollm2", "", "some/folder"],
    "prefix_address": ["", "a:1", "a:1,b:2", "a:1,", "a:1,A:1", "a:0", "a", ",", "a:1;b:2"],
    "advertise_address": ["", "10.0.0.5:50054", "a:0", "a"],
    "draft_ladder": ["auto", "1,2,3", "1,4,16", "3,2,1", "1,2", "1, 2, 20", "a,b,c", "0,1,2",
                     "2,4,8"],
    "draft_costs": ["", " ", "1" + ",1.2" * 16, " 1.0 ," + "0.7," * 15 + "9", "1" + ",.8" * 16,
                    "1" + ",0.69" + ",1" * 15, "1" + ",1.2" * 15, "1" + ",1.2" * 17,
                    "1.1" + ",1.2" * 16, "1" + ",nan" * 16, "1" + ",1_0" * 16,
                    "1" + ",\u0661" * 16, "1" + ",1e0" * 16, "1,,1.2" + ",1.2" * 14, "x",
                    "1" + ",1." * 16, "1"],
    "kvpool_addresses": ["a:1", "a:1,b:2", "", ",", "a:1, a:1", "a:1,B:2,b:2", "x", "a:1,,b:2"],
    "prefix_addresses": ["", "p:1", "p:1,q:2", "p", "p:1,p:1", ","],
    "semantic_address": ["", "s:1", "s:1,t:2", "s", "s:1,S:1", "s:1,", ","],
    "tokens": ["a=acme", "a=acme,b=beta", "a", "a=acme,a=beta", "=x", "c2VjcmV0===acme",
               "a=acme,"],
    "semantic_tier": list(TIERS) + ["lax", "Strict"],
    "default_tier": list(TIERS) + ["lax"],
    "routing_policy": ["prefix", "round_robin", "random"],
    "onnx_exporter": ["torchscript", "dynamo", "onnx"],
    "sqlite_synchronous": ["FULL", "NORMAL", "EXTRA", "normal", "OFF"],
    "guard_tiers": ["strict,standard", "strict", "", "relaxed,standard,strict", "lax",
                    "standard"],
    "verifier_tiers": ["strict,standard", "strict", "", "standard", "relaxed"],
    "internal_token": ["s3cret-token", "", "a b", "tok\u00e9n", "\ttok\n"],
    "model_name": ["", "mini", "..", "a/b", "x\ty", "\u3164"],
}
INTS = [-2, -1, 0, 1, 2, 3, 4, 7, 8, 9, 63, 64, 65, 256, 257, 1024, 1025, 4096, 4097, 32768,
        32769, 65535, 65536, 1 << 22, (1 << 22) + 1, 2**31 - 1, 2**31, 2**32 - 1, 2**32,
        2**63, 2**63 + 1, 2**64 - 1, 2**64, 10**30]
FLOATS = [-1.0, -0.0, 0.0, 1e-9, 0.009, 0.01, 0.05, 0.1, 0.099, 0.2, 0.25, 0.5, 0.75, 0.8,
          0.85, 0.9, 0.95, 0.97, 0.98, 0.99, 1.0, 1.01, 4.9, 5.0, 10.0, 100.0, 100.5, 3600.0,
          1e9]


def _pad(rng: random.Random, s: str) -> str:
    return rng.choice(["", " ", "\t"]) + s + rng.choice(["", " ", "\n"])


def spell(rng: random.Random, field: str, typ: str, default):
    """(raw text, the value the docs give it or None when refused at parsing)."""
    if typ == "bool":
        if rng.random() < 0.15:
            return rng.choice(["", "y", "2", "enabled", "tru e", "nope"]), None
        word = rng.choice(TRUE + FALSE)
        word = "".join(c.upper() if rng.random() < 0.5 else c for c in word)
        return _pad(rng, word), word.lower() in TRUE
    if typ == "int":
        if rng.random() < 0.1:
            return rng.choice(["", "1.0", "1e3", "abc", "0x10", "1 2", "--1", "one"]), None
        v = rng.choice(INTS + [default, default + 1, default - 1])
        text = str(v)
        if v >= 0 and rng.random() < 0.2:
            text = "+" + text
        if rng.random() < 0.1:
            text = ("-" if v < 0 else "") + "00" + str(abs(v))
        return _pad(rng, text), v
    if typ == "float":
        r = rng.random()
        if r < 0.08:
            return rng.choice(["", "abc", "1,5", "0x1p3", "1..2", "e5"]), None
        if r < 0.16:
            return rng.choice(["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "1e9000",
                               "1000000001", "-1e10", "2e9"]), None
        v = rng.choice(FLOATS + [default, default * 2, default / 2])
        form = rng.choice([repr, lambda x: f"{x:e}", lambda x: f"{x:.12g}",
                           lambda x: str(int(x)) if x == int(x) and abs(x) < 1e15 else repr(x)])
        text = form(v)
        if not text.startswith("-") and rng.random() < 0.15:
            text = "+" + text
        return _pad(rng, text), float(text)
    if typ == "list":
        text = rng.choice(CHOICES.get(field, ["a,b"]))
        if rng.random() < 0.3:
            text = text.replace(",", " , ")
        items = tuple(s.strip() for s in text.split(",") if s.strip())
        return _pad(rng, text), items if items or not text.strip() else None  # "," refused
    text = rng.choice(CHOICES.get(field, ["", "x", default or "y"]))
    raw = _pad(rng, text) if rng.random() < 0.3 else text
    return raw, raw.strip()


# --- one case --------------------------------------------------------------------------------


def _closest_by_one_edit(rest: str, names: list[str]) -> set[str]:
    """Names one edit (insert, delete, replace, swap of neighbours) from `rest`."""
    def one(a: str, b: str) -> bool:
        if abs(len(a) - len(b)) > 1 or a == b:
            return False
        if len(a) == len(b):
            diff = [i for i in range(len(a)) if a[i] != b[i]]
            return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1
                                       and a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
        s, t = (a, b) if len(a) < len(b) else (b, a)
        return any(t[:i] + t[i + 1:] == s for i in range(len(t)))
    return {n for n in names if one(rest, n)}


def _typo(rng: random.Random, name: str) -> str:
    i = rng.randrange(len(name))
    kind = rng.choice(["drop", "dup", "swap", "sub"])
    if kind == "drop":
        return name[:i] + name[i + 1:]
    if kind == "dup":
        return name[:i] + name[i] + name[i:]
    if kind == "swap" and i + 1 < len(name):
        return name[:i] + name[i + 1] + name[i] + name[i + 2:]
    return name[:i] + rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") + name[i + 1:]


def run_case(service: str, seed: int) -> None:
    rng = random.Random(f"{service}:{seed}")
    spec = SPEC[service]
    names = [f for f in spec if (service, f) not in FIXED]
    env: dict[str, str] = {}
    argv: list[str] = []
    given: dict[str, str] = {}  # field -> "env" or "flag" (what the user typed that counts)
    expect: dict[str, object] = {}
    for field in rng.sample(names, rng.randint(1, min(5, len(names)))):
        typ, default = spec[field]
        var, flag = f"TIERCACHE_{service.upper()}_{field.upper()}", "--" + field.replace("_", "-")
        how = rng.choice(["env", "flag", "both"])
        raw, value = spell(rng, field, typ, default)
        if how in ("env", "both"):
            env[var], expect[field] = raw, value
            given[field] = "env"
        if how in ("flag", "both"):
            if how == "both":  # the variable is shadowed: anything, even unparsable
                env[var] = rng.choice(["garbage", raw, ""])
            if raw.startswith("-") or rng.random() < 0.5:
                argv.append(f"{flag}={raw}")  # "--x -1e-3" is argparse's option
            else:
                argv += [flag, raw]
            expect[field], given[field] = value, "flag"
    typo = None
    if rng.random() < 0.05:
        real = rng.choice(list(spec)).upper()
        rest = _typo(rng, real)
        if rest.lower() not in spec and rest not in ("TLS_CERT", "TLS_KEY"):
            typo = f"TIERCACHE_{service.upper()}_{rest}"
            env[typo] = "1"
    values = {f: d for f, (_, d) in spec.items()}

    def label(field: str) -> str:
        var = f"TIERCACHE_{service.upper()}_{field.upper()}"
        flag = "--" + field.replace("_", "-")
        return flag if given.get(field) == "flag" else var

    ctx = f"{service} seed {seed}: env={env!r} argv={argv!r}"
    try:
        cfg = load_config(CLASSES[service], service, argv, environ=env)
        err = None
    except ConfigError as exc:
        cfg, err = None, str(exc)

    if typo is not None and err is not None and err.startswith(typo):
        near = _closest_by_one_edit(typo.split("_", 2)[2], [f.upper() for f in spec])
        if len(near) == 1 and len(next(iter(near))) >= 8:
            want = f"TIERCACHE_{service.upper()}_{next(iter(near))}"
            assert f"did you mean {want}?" in err, ctx + f" -> {err!r}"
        return
    bad_parse = [f for f, v in expect.items() if v is None]
    # Values are parsed before names are checked: only a value refused may come first.
    assert typo is None or bad_parse, ctx + f": typo {typo} -> {err!r}"
    if not bad_parse:
        for f, v in expect.items():
            values[f] = v
        typ_of = {f: t for f, (t, _) in spec.items()}
        for f, v in expect.items():
            if typ_of[f] == "float" and (not math.isfinite(v) or abs(v) > BIG):
                bad_parse.append(f)
    if bad_parse:
        assert err is not None, ctx + f": parsed {bad_parse}"
        assert any(err.startswith(label(f) + ":") for f in bad_parse), ctx + f" -> {err!r}"
        return
    empty = [f for f in ("internal_token", "tokens", "tokens_file")
             if f in expect and f in spec and values[f] == ""]
    token = values.get("internal_token", "")
    secret_bad = empty + (["internal_token"] if token and not all(
        0x21 <= ord(c) <= 0x7E for c in token) else [])
    broken = [fields for fields, holds in RULES[service] if not holds(values)]
    if not secret_bad and not broken:
        assert err is None, ctx + f" -> {err!r}"
        for f in spec:
            got = getattr(cfg, f)
            assert got == values[f] and type(got) is type(values[f]), (
                ctx + f": {f} = {got!r}, docs say {values[f]!r}")
        return
    assert err is not None, ctx + f": accepted, docs break {secret_bad or broken}"
    ok = []
    for f in secret_bad:
        ok.append((label(f), ()))
    for fields in broken:
        if len(fields) > 1 and any(f in given for f in fields):
            cands = [f for f in fields if f in given]
        else:
            cands = list(fields)
        ok += [(label(f), fields) for f in cands]
    for name, fields in ok:
        if err.startswith(name + ":") or err.startswith(name + " (env "):
            for f in fields:  # "tier_relaxed" may be "relaxed" in the tiers' line
                assert f in err or f.upper() in err or (
                    f.startswith("tier_") and f[5:] in err), ctx + f" -> {err!r} (names no {f})"
            if name.startswith("TIERCACHE_"):
                flag = "--" + name.split("_", 2)[2].lower().replace("_", "-")
                assert flag not in err.split(":", 1)[0], ctx + f" -> {err!r}"
            return
    raise AssertionError(ctx + f" -> {err!r}; the docs break {secret_bad or broken}")


@pytest.mark.parametrize("service", sorted(CLASSES))
def test_random_settings_load_as_documented(service):
    for seed in range(SEEDS):
        run_case(service, seed)


def test_the_docs_table_lists_every_field():
    """The model reads the settings from docs/settings.md: it must see them all."""
    import dataclasses

    for service, cls in CLASSES.items():
        assert list(SPEC[service]) == [f.name for f in dataclasses.fields(cls)]
