"""The first error each service's `validate` names, check by check, in today's order: every
case below is refused with its exact message even when every later case's bad value is set
too (so a check moved ahead of an earlier one, or a message reworded, fails here). Pinned
before `validate` was split into steps; the messages are today's, verbatim."""

from __future__ import annotations

import dataclasses

import pytest

from services.common.config import ConfigError
from services.kvpool.config import KvPoolConfig
from services.orchestrator.config import OrchestratorConfig
from services.semantic.config import SemanticConfig

BIG = 2**32

# (overrides, message), in the order validate checks them. "{tmp}" is the test's folder.
SEMANTIC = [
    ({"address": "nohost"},
     "TIERCACHE_SEMANTIC_ADDRESS: 'nohost' is not host:port (port 0..65535, 0 = any free "
     "one)"),
    ({"metrics_port": -2}, "TIERCACHE_SEMANTIC_METRICS_PORT: must be -1 (off), 0 or a port"),
    ({"model_dir": "{tmp}/no-model"},
     "TIERCACHE_SEMANTIC_MODEL_DIR: not a sentence-transformers folder: '{tmp}/no-model'"),
    ({"onnx_threads": 1025}, "TIERCACHE_SEMANTIC_ONNX_THREADS: must be in [0, 1024]"),
    ({"onnx_exporter": "x"},
     "TIERCACHE_SEMANTIC_ONNX_EXPORTER: must be one of torchscript, dynamo, got 'x'"),
    ({"max_batch": 0}, "TIERCACHE_SEMANTIC_MAX_BATCH: must be in [1, 1024]"),
    ({"batch_wait_ms": 101.0}, "TIERCACHE_SEMANTIC_BATCH_WAIT_MS: must be in [0, 100]"),
    ({"sqlite_synchronous": "OFF"},
     "TIERCACHE_SEMANTIC_SQLITE_SYNCHRONOUS: must be FULL, NORMAL or EXTRA"),
    ({"hnsw_min_entries": 0}, "TIERCACHE_SEMANTIC_HNSW_MIN_ENTRIES: must be >= 1"),
    ({"hnsw_m": 3}, "TIERCACHE_SEMANTIC_HNSW_M: must be in [4, 128]"),
    ({"hnsw_ef_construction": 7}, "TIERCACHE_SEMANTIC_HNSW_EF_CONSTRUCTION: must be in [8, 32768]"),
    ({"hnsw_ef_search": 7}, "TIERCACHE_SEMANTIC_HNSW_EF_SEARCH: must be in [8, 32768]"),
    ({"faiss_threads": 0}, "TIERCACHE_SEMANTIC_FAISS_THREADS: must be in [1, 1024]"),
    ({"delta_capacity": 0}, "TIERCACHE_SEMANTIC_DELTA_CAPACITY: must be >= 1"),
    ({"tier_strict": 1.5},
     "TIERCACHE_SEMANTIC_TIER_STRICT: tier_strict must be in [threshold_floor=0.0, 1], got "
     "1.5"),
    ({"tier_standard": 1.5},
     "TIERCACHE_SEMANTIC_TIER_STANDARD: tier_standard must be in [threshold_floor=0.0, 1], "
     "got 1.5"),
    ({"tier_relaxed": 1.5},
     "TIERCACHE_SEMANTIC_TIER_RELAXED: tier_relaxed must be in [threshold_floor=0.0, 1], got"
     " 1.5"),
    ({"tier_relaxed": 0.96},
     "TIERCACHE_SEMANTIC_TIER_RELAXED: tiers must not cross: relaxed 0.96 <= standard 0.95 "
     "<= strict 0.94"),
    ({"tier_strict": 0.94},
     "TIERCACHE_SEMANTIC_TIER_STRICT: tiers must not cross: relaxed 0.9 <= standard 0.95 <= "
     "strict 0.94"),
    ({"grace_seconds": -1.0}, "TIERCACHE_SEMANTIC_GRACE_SECONDS: must be >= 0"),
    ({"index_close_seconds": -1.0}, "TIERCACHE_SEMANTIC_INDEX_CLOSE_SECONDS: must be >= 0"),
    ({"snapshot_interval_s": 0.5},
     "TIERCACHE_SEMANTIC_SNAPSHOT_INTERVAL_S: must be 0 (saved only on stop) or >= 1"),
    ({"max_tenant_chars": 63},
     "TIERCACHE_SEMANTIC_MAX_TENANT_CHARS: must be >= 64 (it also bounds model ids; below "
     "that every request is refused)"),
    ({"default_tier": "loose"},
     "TIERCACHE_SEMANTIC_DEFAULT_TIER: must be strict, standard or relaxed"),
    ({"threshold_floor": 0.0}, "TIERCACHE_SEMANTIC_THRESHOLD_FLOOR: must be in (0, 1]"),
    ({"verified_bonus": 0.2}, "TIERCACHE_SEMANTIC_VERIFIED_BONUS: must be in [0, 0.2)"),
    ({"draft_floor": 0.9},
     "TIERCACHE_SEMANTIC_DRAFT_FLOOR: draft_floor must be in (0, threshold_floor]: "
     "draft_floor 0.9, threshold_floor 0.85"),
    ({"guard_tiers": ("strict", "odd")}, "TIERCACHE_SEMANTIC_GUARD_TIERS: unknown tier 'odd'"),
    ({"verifier_tiers": ("relaxed",)},
     "TIERCACHE_SEMANTIC_VERIFIER_TIERS: tier 'relaxed' of verifier_tiers must also be in "
     "guard_tiers (strict,standard): the guard is the verifier's veto"),
    ({"verifier_path": "{tmp}/no-verifier.json"},
     "TIERCACHE_SEMANTIC_VERIFIER_PATH: no such file: '{tmp}/no-verifier.json'"),
    ({"default_ttl_seconds": -1}, "TIERCACHE_SEMANTIC_DEFAULT_TTL_SECONDS: must be >= 0"),
    ({"default_ttl_seconds": 10, "max_ttl_seconds": 5},
     "TIERCACHE_SEMANTIC_DEFAULT_TTL_SECONDS: default_ttl_seconds (10) must not exceed "
     "max_ttl_seconds (5)"),
    ({"default_ttl_seconds": 0, "max_ttl_seconds": 0},
     "TIERCACHE_SEMANTIC_MAX_TTL_SECONDS: must be >= 1"),
    ({"max_ttl_seconds": BIG},
     "TIERCACHE_SEMANTIC_MAX_TTL_SECONDS: must fit the API's uint32 ttl_seconds (<= "
     "4294967295)"),
    ({"max_entries_per_namespace": 0}, "TIERCACHE_SEMANTIC_MAX_ENTRIES_PER_NAMESPACE: >= 1"),
    ({"max_entries_total": 0}, "TIERCACHE_SEMANTIC_MAX_ENTRIES_TOTAL: must be >= 1"),
    ({"max_entries_per_tenant": -1},
     "TIERCACHE_SEMANTIC_MAX_ENTRIES_PER_TENANT: must be >= 0 (0 = no quota)"),
    ({"max_text_chars": 0}, "TIERCACHE_SEMANTIC_MAX_TEXT_CHARS: must be >= 1"),
    ({"max_answer_chars": 0}, "TIERCACHE_SEMANTIC_MAX_ANSWER_CHARS: must be >= 1"),
    ({"max_answer_chars": 10**6},
     "TIERCACHE_SEMANTIC_MAX_ANSWER_CHARS: with max_text_chars 8192 and max_answer_chars "
     "1000000, an entry could take 24098304 bytes, past the 16777216-byte gRPC message limit"
     " (4 x max_text_chars + 24 x max_answer_chars + 64 KiB must fit)"),
    ({"cache_dir": "{tmp}/afile/c"},
     "TIERCACHE_SEMANTIC_CACHE_DIR: {tmp}/afile is a file, where a folder must be"),
    ({"db_path": "{tmp}/afile/d/s.db"},
     "TIERCACHE_SEMANTIC_DB_PATH: {tmp}/afile is a file, where a folder must be"),
    ({"snapshot_path": "{tmp}/afile/s"},
     "TIERCACHE_SEMANTIC_SNAPSHOT_PATH: {tmp}/afile is a file, where a folder must be"),
    ({"expiry_interval_s": 0.05}, "TIERCACHE_SEMANTIC_EXPIRY_INTERVAL_S: must be >= 0.1"),
    ({"model_name": "a/b"},
     "TIERCACHE_SEMANTIC_MODEL_NAME: a plain name without slashes, got 'a/b'"),
    ({"model_name": "\u3164"},
     "TIERCACHE_SEMANTIC_MODEL_NAME: empty (named after the model folder) or visible text, "
     "not only whitespace or invisible characters"),
]

KVPOOL = [
    ({"model": " "}, "TIERCACHE_KVPOOL_MODEL: must name 'smollm2' or a model folder"),
    ({"device": "cuda:00"}, "TIERCACHE_KVPOOL_DEVICE: must be 'cpu' or 'cuda[:N]', got 'cuda:00'"),
    ({"dtype": "int8"}, "TIERCACHE_KVPOOL_DTYPE: must be float32, float16 or bfloat16, got 'int8'"),
    ({"num_blocks": -1}, "TIERCACHE_KVPOOL_NUM_BLOCKS: must be >= 0 (0 = size by kv_cache_bytes)"),
    ({"max_context": 1}, "TIERCACHE_KVPOOL_MAX_CONTEXT: must be 0 (the model's) or >= 2"),
    ({"num_blocks": 0, "kv_cache_bytes": 0},
     "TIERCACHE_KVPOOL_KV_CACHE_BYTES: must be > 0 when num_blocks is 0"),
    ({"block_size": 0}, "TIERCACHE_KVPOOL_BLOCK_SIZE: must be in 1..1024"),
    ({"max_batch_size": 257}, "TIERCACHE_KVPOOL_MAX_BATCH_SIZE: must be in 1..256"),
    ({"max_prefill_chunk": 0}, "TIERCACHE_KVPOOL_MAX_PREFILL_CHUNK: must be >= 1"),
    ({"max_new_tokens_limit": 0}, "TIERCACHE_KVPOOL_MAX_NEW_TOKENS_LIMIT: must be >= 1"),
    ({"max_waiting": 0}, "TIERCACHE_KVPOOL_MAX_WAITING: must be >= 1 (0 refuses everything)"),
    ({"replica_id": "\u3164"},
     "TIERCACHE_KVPOOL_REPLICA_ID: must not be empty (or only whitespace or invisible "
     "characters)"),
    ({"replica_id": "r" * 257}, "TIERCACHE_KVPOOL_REPLICA_ID: must be at most 256 characters"),
    ({"replica_id": "a b"},
     "TIERCACHE_KVPOOL_REPLICA_ID: printable characters without spaces only"),
    ({"model_id": "m\0"}, "TIERCACHE_KVPOOL_MODEL_ID: at most 256 characters, no NUL"),
    ({"model_id": " "},
     "TIERCACHE_KVPOOL_MODEL_ID: empty (derived from the model) or visible text, not only "
     "whitespace or invisible characters"),
    ({"num_blocks": BIG},
     "TIERCACHE_KVPOOL_NUM_BLOCKS: must be at most 4,194,304 (a pool that large fits no "
     "memory)"),
    ({"torch_threads": BIG}, "TIERCACHE_KVPOOL_TORCH_THREADS: must be at most 1024"),
    ({"address": "nohost"},
     "TIERCACHE_KVPOOL_ADDRESS: 'nohost' is not host:port (port 0..65535, 0 = any free one)"),
    ({"prefix_address": "nohost"}, "TIERCACHE_KVPOOL_PREFIX_ADDRESS: 'nohost' is not host:port"),
    ({"advertise_address": "a b:1", "prefix_address": "127.0.0.1:1"},
     "TIERCACHE_KVPOOL_ADVERTISE_ADDRESS: 'a b:1' is not host:port"),
    ({"address": "127.0.0.1:0", "prefix_address": "127.0.0.1:1"},
     "TIERCACHE_KVPOOL_ADDRESS: '127.0.0.1:0' cannot be announced to the prefix index: "
     "'127.0.0.1:0' is not host:port (host:port with a port 1..65535, at most 256 printable "
     "characters without spaces; with port 0 set TIERCACHE_KVPOOL_ADVERTISE_ADDRESS)"),
    ({"metrics_port": 65536}, "TIERCACHE_KVPOOL_METRICS_PORT: must be -1 (off), 0 or a port"),
    ({"heartbeat_seconds": 0.05}, "TIERCACHE_KVPOOL_HEARTBEAT_SECONDS: must be >= 0.1, got 0.05"),
    ({"publish_interval_seconds": 0.001},
     "TIERCACHE_KVPOOL_PUBLISH_INTERVAL_SECONDS: must be >= 0.01, got 0.001"),
    ({"eviction_policy": "lfu"}, "TIERCACHE_KVPOOL_EVICTION_POLICY: must be 'hybrid' or 'lru'"),
    ({"max_draft_tokens": 65}, "TIERCACHE_KVPOOL_MAX_DRAFT_TOKENS: must be in 1..64"),
    ({"draft_branches": 17}, "TIERCACHE_KVPOOL_DRAFT_BRANCHES: must be in 1..16"),
    ({"linear_kernels": "x"},
     "TIERCACHE_KVPOOL_LINEAR_KERNELS: must be one of onednn, torch, got 'x'"),
    ({"draft_ladder": "3,2,1"},
     "TIERCACHE_KVPOOL_DRAFT_LADDER: must be 'auto' or three ascending integers 'a,b,c' in "
     "1..max_draft_tokens (3)"),
    ({"draft_costs": "1,2"},
     "TIERCACHE_KVPOOL_DRAFT_COSTS: must be empty (timed at start) or max_draft_tokens + 1 "
     "(4) comma-separated costs, the first 1 (a 1-token forward's), every one finite and at "
     "least 0.7 (a forward of more tokens timed under that share of one token's is noise), "
     "got '1,2'"),
    ({"draft_ladder": "1,2,3", "max_draft_tokens": 3, "draft_costs": "1,1,1,1"},
     "TIERCACHE_KVPOOL_DRAFT_COSTS: given with a fixed draft_ladder: the costs choose the "
     "lengths 'auto' would time them for (give one or the other)"),
    ({"shallow_tokens": -1}, "TIERCACHE_KVPOOL_SHALLOW_TOKENS: must be >= 0"),
    ({"pin_ttl_max_seconds": 0}, "TIERCACHE_KVPOOL_PIN_TTL_MAX_SECONDS: must be >= 1"),
    ({"grace_seconds": -1.0}, "TIERCACHE_KVPOOL_GRACE_SECONDS: must be >= 0"),
    ({"engine_stall_seconds": 1.0},
     "TIERCACHE_KVPOOL_ENGINE_STALL_SECONDS: must be 0 (off) or >= 5, got 1.0"),
    ({"send_stall_seconds": 0.5}, "TIERCACHE_KVPOOL_SEND_STALL_SECONDS: must be 0 (off) or >= 1"),
    ({"max_pinned_fraction": 0.0}, "TIERCACHE_KVPOOL_MAX_PINNED_FRACTION: must be in (0, 1]"),
    ({"max_pinned_per_tenant_fraction": 0.0},
     "TIERCACHE_KVPOOL_MAX_PINNED_PER_TENANT_FRACTION: max_pinned_per_tenant_fraction (0) "
     "must be in (0, max_pinned_fraction (0.5)]"),
    ({"torch_threads": -1}, "TIERCACHE_KVPOOL_TORCH_THREADS: must be >= 0"),
    ({"one_thread_below": -1}, "TIERCACHE_KVPOOL_ONE_THREAD_BELOW: must be >= 0"),
]

ORCHESTRATOR = [
    ({"metrics_port": -2}, "TIERCACHE_ORCHESTRATOR_METRICS_PORT: must be -1 (off), 0 or a port"),
    ({"model": ""}, "TIERCACHE_ORCHESTRATOR_MODEL: must name 'smollm2' or a model folder"),
    ({"min_prefix_tokens": 0}, "TIERCACHE_ORCHESTRATOR_MIN_PREFIX_TOKENS: must be >= 1"),
    ({"tokens": "nopair"}, "TIERCACHE_ORCHESTRATOR_TOKENS: expected token=tenant,..."),
    ({"address": "nohost"},
     "TIERCACHE_ORCHESTRATOR_ADDRESS: 'nohost' is not host:port (port 0..65535, 0 = any free"
     " one)"),
    ({"kvpool_addresses": ()}, "TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES: at least one replica"),
    ({"kvpool_addresses": ("nohost",)},
     "TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES: 'nohost' is not host:port"),
    ({"prefix_addresses": ("nohost",)},
     "TIERCACHE_ORCHESTRATOR_PREFIX_ADDRESSES: 'nohost' is not host:port"),
    ({"semantic_address": "nohost"},
     "TIERCACHE_ORCHESTRATOR_SEMANTIC_ADDRESS: 'nohost' is not host:port"),
    ({"block_size": 1025}, "TIERCACHE_ORCHESTRATOR_BLOCK_SIZE: must be in 1..1024"),
    ({"model_id": " "},
     "TIERCACHE_ORCHESTRATOR_MODEL_ID: empty (derived from the model) or visible text, not "
     "only whitespace or invisible characters"),
    ({"default_max_tokens": 0},
     "TIERCACHE_ORCHESTRATOR_DEFAULT_MAX_TOKENS: default_max_tokens (0) must be in (0, "
     "max_tokens_limit (2147483648)]"),
    ({"max_tokens_limit": 2**31},
     "TIERCACHE_ORCHESTRATOR_MAX_TOKENS_LIMIT: must be at most 2147483647"),
    ({"max_prompt_tokens": 0}, "TIERCACHE_ORCHESTRATOR_MAX_PROMPT_TOKENS: must be > 0"),
    ({"max_message_chars": 0}, "TIERCACHE_ORCHESTRATOR_MAX_MESSAGE_CHARS: must be > 0"),
    ({"max_request_bytes": 1},
     "TIERCACHE_ORCHESTRATOR_MAX_REQUEST_BYTES: must be in [65536, 2147483647] (gRPC's "
     "message size is an int32)"),
    ({"max_concurrent_per_tenant": -1},
     "TIERCACHE_ORCHESTRATOR_MAX_CONCURRENT_PER_TENANT: must be >= 0 (0 = automatic)"),
    ({"request_timeout_s": 0.0}, "TIERCACHE_ORCHESTRATOR_REQUEST_TIMEOUT_S: must be > 0"),
    ({"semantic_timeout_s": 0.0}, "TIERCACHE_ORCHESTRATOR_SEMANTIC_TIMEOUT_S: must be > 0"),
    ({"prefix_timeout_s": 0.0}, "TIERCACHE_ORCHESTRATOR_PREFIX_TIMEOUT_S: must be > 0"),
    ({"grace_s": -1.0}, "TIERCACHE_ORCHESTRATOR_GRACE_S: must be >= 0"),
    ({"tokens_reload_s": 0.1},
     "TIERCACHE_ORCHESTRATOR_TOKENS_RELOAD_S: must be 0 (read once) or >= 0.5, got 0.1"),
    ({"max_connection_age_s": -1.0}, "TIERCACHE_ORCHESTRATOR_MAX_CONNECTION_AGE_S: must be >= 0"),
    ({"semantic_tier": "x"},
     "TIERCACHE_ORCHESTRATOR_SEMANTIC_TIER: must be strict, standard or relaxed"),
    ({"routing_policy": "x"},
     "TIERCACHE_ORCHESTRATOR_ROUTING_POLICY: must be prefix or round_robin"),
    ({"routing_epsilon": 0.0}, "TIERCACHE_ORCHESTRATOR_ROUTING_EPSILON: must be > 0"),
    ({"routing_load_window_s": 0.0}, "TIERCACHE_ORCHESTRATOR_ROUTING_LOAD_WINDOW_S: must be > 0"),
    ({"routing_load_floor": 1025.0},
     "TIERCACHE_ORCHESTRATOR_ROUTING_LOAD_FLOOR: must be in [0, 1024]"),
    ({"dispatch_memory_s": -1.0}, "TIERCACHE_ORCHESTRATOR_DISPATCH_MEMORY_S: must be >= 0"),
    ({"max_attempts": 0}, "TIERCACHE_ORCHESTRATOR_MAX_ATTEMPTS: must be >= 1"),
    ({"replica_poll_s": 0.001}, "TIERCACHE_ORCHESTRATOR_REPLICA_POLL_S: must be >= 0.01"),
    ({"warm_interval_s": 0.5},
     "TIERCACHE_ORCHESTRATOR_WARM_INTERVAL_S: must be <= 0 (off) or >= 1"),
    ({"replica_stats_timeout_s": 0.0},
     "TIERCACHE_ORCHESTRATOR_REPLICA_STATS_TIMEOUT_S: must be > 0"),
    ({"replica_hung_polls": 0}, "TIERCACHE_ORCHESTRATOR_REPLICA_HUNG_POLLS: must be in 1..100"),
    ({"replica_stall_s": -1.0}, "TIERCACHE_ORCHESTRATOR_REPLICA_STALL_S: must be >= 0 (0 = off)"),
    ({"warm_pin_ttl_s": 0.0}, "TIERCACHE_ORCHESTRATOR_WARM_PIN_TTL_S: must be > 0"),
    ({"warm_pin_ttl_max_s": 1.0},
     "TIERCACHE_ORCHESTRATOR_WARM_PIN_TTL_MAX_S: warm_pin_ttl_max_s (1) must be >= "
     "warm_pin_ttl_s (600)"),
    ({"warm_pin_ttl_max_s": float(BIG)},
     "TIERCACHE_ORCHESTRATOR_WARM_PIN_TTL_MAX_S: must be at most 4294967295"),
    ({"warm_top_k": -1}, "TIERCACHE_ORCHESTRATOR_WARM_TOP_K: must be >= 0"),
    ({"warm_min_hits": 0}, "TIERCACHE_ORCHESTRATOR_WARM_MIN_HITS: must be in 1..2^63"),
    ({"warm_max_prefills_per_call": 0},
     "TIERCACHE_ORCHESTRATOR_WARM_MAX_PREFILLS_PER_CALL: must be in 1..4096 (64 prompts x 64"
     " replicas)"),
    ({"warm_max_load": -1.0}, "TIERCACHE_ORCHESTRATOR_WARM_MAX_LOAD: must be >= 0"),
    ({"warm_max_prompts_per_cycle": -1},
     "TIERCACHE_ORCHESTRATOR_WARM_MAX_PROMPTS_PER_CYCLE: must be >= 0"),
    ({"max_workers": 1},
     "TIERCACHE_ORCHESTRATOR_MAX_WORKERS: must be > 8 (threads kept for health checks and "
     "Stats)"),
    ({"max_concurrent_rpcs": 1},
     "TIERCACHE_ORCHESTRATOR_MAX_CONCURRENT_RPCS: must be 0 (4 x max_workers) or > "
     "max_workers (streams must not fill it)"),
]


def _first_errors(cls, base: dict, cases, tmp: str) -> list[str]:
    """Each case's message, applying the cases from the last to the first on top of one
    another: each is refused while every later case's bad value is still set."""
    fields = dict(base)
    messages = []
    for overrides, _ in reversed(cases):
        fields.update({k: v.replace("{tmp}", tmp) if isinstance(v, str) else v
                       for k, v in overrides.items()})
        with pytest.raises(ConfigError) as e:
            dataclasses.replace(cls(), **fields).validate()
        messages.append(str(e.value).replace(tmp, "{tmp}"))
    return messages[::-1]


@pytest.mark.parametrize(("cls", "cases"), [
    (SemanticConfig, SEMANTIC), (KvPoolConfig, KVPOOL), (OrchestratorConfig, ORCHESTRATOR),
], ids=["semantic", "kvpool", "orchestrator"])
def test_validate_names_the_first_bad_setting_in_todays_order(cls, cases, tmp_path,
                                                             monkeypatch):
    monkeypatch.delenv("TIERCACHE_CACHE_DIR", raising=False)
    (tmp_path / "afile").write_text("")
    (tmp_path / "model").mkdir()
    base = {"model_dir": str(tmp_path / "model")} if cls is SemanticConfig else {}
    dataclasses.replace(cls(), **base).validate()  # each step's error is its case's alone
    assert _first_errors(cls, base, cases, str(tmp_path)) == [m for _, m in cases]
