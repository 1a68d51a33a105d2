"""KvPoolConfig: env + flags, validation errors that name the variable."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.kvpool.config import KvPoolConfig


def test_defaults_serve_smollm2_on_cpu_fp32() -> None:
    cfg = load_config(KvPoolConfig, "kvpool", [], environ={})
    assert (cfg.model, cfg.device, cfg.dtype, cfg.block_size) == ("smollm2", "cpu", "float32", 16)
    assert cfg.address == "127.0.0.1:50054" and cfg.public_address == cfg.address


def test_env_and_flags() -> None:
    cfg = load_config(KvPoolConfig, "kvpool", ["--max-batch-size", "4"],
                      environ={"TIERCACHE_KVPOOL_NUM_BLOCKS": "100",
                               "TIERCACHE_KVPOOL_MAX_BATCH_SIZE": "2"})
    assert cfg.num_blocks == 100 and cfg.max_batch_size == 4


@pytest.mark.parametrize("env,var", [
    ({"TIERCACHE_KVPOOL_DEVICE": "tpu"}, "TIERCACHE_KVPOOL_DEVICE"),
    ({"TIERCACHE_KVPOOL_BLOCK_SIZE": "0"}, "TIERCACHE_KVPOOL_BLOCK_SIZE"),
    ({"TIERCACHE_KVPOOL_EVICTION_POLICY": "fifo"}, "TIERCACHE_KVPOOL_EVICTION_POLICY"),
    ({"TIERCACHE_KVPOOL_DTYPE": "int8"}, "TIERCACHE_KVPOOL_DTYPE"),
    ({"TIERCACHE_KVPOOL_KV_CACHE_BYTES": "0"}, "TIERCACHE_KVPOOL_KV_CACHE_BYTES"),
    ({"TIERCACHE_KVPOOL_ENGINE_STALL_SECONDS": "-1"}, "TIERCACHE_KVPOOL_ENGINE_STALL_SECONDS"),
    ({"TIERCACHE_KVPOOL_DRAFT_LADDER": "2,1,16"}, "TIERCACHE_KVPOOL_DRAFT_LADDER"),
    ({"TIERCACHE_KVPOOL_DRAFT_LADDER": "0,1,2"}, "TIERCACHE_KVPOOL_DRAFT_LADDER"),
    ({"TIERCACHE_KVPOOL_DRAFT_LADDER": "1,2,17"}, "TIERCACHE_KVPOOL_DRAFT_LADDER"),
    ({"TIERCACHE_KVPOOL_DRAFT_LADDER": "1,2"}, "TIERCACHE_KVPOOL_DRAFT_LADDER"),
    ({"TIERCACHE_KVPOOL_DRAFT_LADDER": "fast"}, "TIERCACHE_KVPOOL_DRAFT_LADDER"),
    ({"TIERCACHE_KVPOOL_DRAFT_COSTS": "1,1.1"}, "TIERCACHE_KVPOOL_DRAFT_COSTS"),  # 17 wanted
    ({"TIERCACHE_KVPOOL_DRAFT_COSTS": ",".join(["1"] * 18)}, "TIERCACHE_KVPOOL_DRAFT_COSTS"),
    ({"TIERCACHE_KVPOOL_DRAFT_COSTS": ",".join(["1.1"] * 17)}, "TIERCACHE_KVPOOL_DRAFT_COSTS"),
    ({"TIERCACHE_KVPOOL_DRAFT_COSTS": "1," + ",".join(["nan"] * 16)},
     "TIERCACHE_KVPOOL_DRAFT_COSTS"),
    ({"TIERCACHE_KVPOOL_DRAFT_COSTS": "1," + ",".join(["inf"] * 16)},
     "TIERCACHE_KVPOOL_DRAFT_COSTS"),
    ({"TIERCACHE_KVPOOL_DRAFT_COSTS": "1,0.69" + ",1.2" * 15}, "TIERCACHE_KVPOOL_DRAFT_COSTS"),
    ({"TIERCACHE_KVPOOL_DRAFT_COSTS": "1,,1.2" + ",1.2" * 14}, "TIERCACHE_KVPOOL_DRAFT_COSTS"),
    ({"TIERCACHE_KVPOOL_DRAFT_COSTS": "1;1.2" + ",1.2" * 15}, "TIERCACHE_KVPOOL_DRAFT_COSTS"),
    ({"TIERCACHE_KVPOOL_DRAFT_COSTS": "1" + ",1.2" * 16, "TIERCACHE_KVPOOL_DRAFT_LADDER": "1,2,16"},
     "TIERCACHE_KVPOOL_DRAFT_COSTS"),
    ({"TIERCACHE_KVPOOL_LINEAR_KERNELS": "mkl"}, "TIERCACHE_KVPOOL_LINEAR_KERNELS"),
    ({"TIERCACHE_KVPOOL_ONE_THREAD_BELOW": "-1"}, "TIERCACHE_KVPOOL_ONE_THREAD_BELOW"),
    ({"TIERCACHE_KVPOOL_MAX_CONTEXT": "1"}, "TIERCACHE_KVPOOL_MAX_CONTEXT"),
    # Floors (a config review): an idle replica read its own waits as a stall, or heartbeat
    # the index ~1,500 times a second.
    ({"TIERCACHE_KVPOOL_ENGINE_STALL_SECONDS": "0.001"}, "TIERCACHE_KVPOOL_ENGINE_STALL_SECONDS"),
    ({"TIERCACHE_KVPOOL_HEARTBEAT_SECONDS": "1e-9"}, "TIERCACHE_KVPOOL_HEARTBEAT_SECONDS"),
    ({"TIERCACHE_KVPOOL_PUBLISH_INTERVAL_SECONDS": "0.001"},
     "TIERCACHE_KVPOOL_PUBLISH_INTERVAL_SECONDS"),
])
def test_bad_values_name_the_variable(env, var) -> None:
    with pytest.raises(ConfigError, match=var):
        load_config(KvPoolConfig, "kvpool", [], environ=env)


def test_draft_ladder_is_auto_or_three_ascending_lengths() -> None:
    assert KvPoolConfig().draft_ladder == "auto" and KvPoolConfig().fixed_ladder() is None
    cfg = load_config(KvPoolConfig, "kvpool", [],
                      environ={"TIERCACHE_KVPOOL_DRAFT_LADDER": "4, 8,16"})
    assert cfg.fixed_ladder() == (4, 8, 16)


def test_draft_costs_are_empty_or_max_draft_tokens_plus_one_plausible_costs() -> None:
    """As a replica's Stats give them (3 decimals) or its start log (2), spaces allowed; the
    count follows max_draft_tokens; 0.7 of one token's is the lowest taken (the bar that
    refuses a timing at start as disturbed)."""
    assert KvPoolConfig().draft_costs == "" and KvPoolConfig().given_costs() is None
    costs = "1.0, 0.998,1.041 ,1.053"
    cfg = load_config(KvPoolConfig, "kvpool", [], environ={
        "TIERCACHE_KVPOOL_DRAFT_COSTS": costs, "TIERCACHE_KVPOOL_MAX_DRAFT_TOKENS": "3"})
    assert cfg.given_costs() == (1.0, 0.998, 1.041, 1.053)
    cfg = load_config(KvPoolConfig, "kvpool", [], environ={
        "TIERCACHE_KVPOOL_DRAFT_COSTS": "1,0.7", "TIERCACHE_KVPOOL_MAX_DRAFT_TOKENS": "1"})
    assert cfg.given_costs() == (1.0, 0.7)
    with pytest.raises(ConfigError, match="TIERCACHE_KVPOOL_DRAFT_COSTS.*got '1,0.7'"):
        load_config(KvPoolConfig, "kvpool", [], environ={  # 17 wanted at the default 16
            "TIERCACHE_KVPOOL_DRAFT_COSTS": "1,0.7"})


def test_pool_sized_in_bytes_or_blocks() -> None:
    import torch

    from services.kvpool.app import pool_blocks
    from services.kvpool.engine import ModelInfo

    info = ModelInfo("m", num_layers=30, kv_heads=3, head_dim=64, vocab_size=10, max_context=64,
                     eos_token_ids=frozenset())
    per_block = 30 * 2 * 3 * 16 * 64 * 4  # SmolLM2, fp32: 737,280 bytes
    cfg = KvPoolConfig(kv_cache_bytes=100 * per_block + 5)
    assert pool_blocks(cfg, info, torch.float32) == 100
    assert pool_blocks(KvPoolConfig(num_blocks=7), info, torch.float32) == 7
    with pytest.raises(ValueError, match="TIERCACHE_KVPOOL_KV_CACHE_BYTES: 1000 bytes hold no"):
        pool_blocks(KvPoolConfig(kv_cache_bytes=1000), info, torch.float32)


@pytest.mark.parametrize(("field", "value", "words"), [
    ("prefix_address", "127.0.0.1:1,127.0.0.1:1", "given twice"),
    ("prefix_address", " , ", "at least one host:port"),
    ("prefix_address", "prefix-0.prefix", "is not host:port"),
    ("advertise_address", "kvpool-0", "is not host:port"),
    ("replica_id", "r" * 257, "at most 256"),
])
def test_addresses_and_ids_the_replica_would_fail_on_later_are_refused_at_start(field, value,
                                                                                words):
    # Before: the publisher's client raised ValueError (a traceback, exit 1) after the model
    # had loaded, or the index refused Register forever (replica_id over 256 characters).
    from services.common.config import ConfigError
    from services.kvpool.config import KvPoolConfig

    with pytest.raises(ConfigError, match=f"TIERCACHE_KVPOOL_{field.upper()}.*{words}"):
        KvPoolConfig(**{field: value}).validate()
    ok = {"prefix_address": ["prefix-0.prefix:50053,[::1]:50053,", "dns:///prefix:50053"],
          "advertise_address": ["kvpool-0.kvpool:50054", "fd00:10:244::5:50054"],
          "replica_id": ["r" * 256]}[field]
    for v in ok:  # a trailing comma, a gRPC target, a bare IPv6 pod IP + port (the manifest's)
        KvPoolConfig(**{field: v}).validate()


def test_a_tenants_pin_share_cannot_exceed_what_pins_may_hold() -> None:
    with pytest.raises(ConfigError, match="TIERCACHE_KVPOOL_MAX_PINNED_PER_TENANT_FRACTION"):
        load_config(KvPoolConfig, "kvpool", [],
                    environ={"TIERCACHE_KVPOOL_MAX_PINNED_FRACTION": "0.5",
                             "TIERCACHE_KVPOOL_MAX_PINNED_PER_TENANT_FRACTION": "0.6"})


@pytest.mark.parametrize(("value", "ok"), [("2", False), ("4.9", False), ("5", True),
                                           ("0", True)])
def test_the_engine_stall_check_is_off_or_at_least_five_seconds(value, ok) -> None:
    """A mutation audit: only 0.001 s and -1 were tried, so the floor itself (5 s, under
    which an idle engine's own wait between turns read as a stall and health stayed
    NOT_SERVING) could move without a test noticing; 0 (off) and 5 stay accepted."""
    env = {"TIERCACHE_KVPOOL_ENGINE_STALL_SECONDS": value}
    if ok:
        assert load_config(KvPoolConfig, "kvpool", [], environ=env).engine_stall_seconds == \
            float(value)
    else:
        with pytest.raises(ConfigError, match=r"TIERCACHE_KVPOOL_ENGINE_STALL_SECONDS: must be "
                                              r"0 \(off\) or >= 5"):
            load_config(KvPoolConfig, "kvpool", [], environ=env)
