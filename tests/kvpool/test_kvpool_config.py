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
])
def test_bad_values_name_the_variable(env, var) -> None:
    with pytest.raises(ConfigError, match=var):
        load_config(KvPoolConfig, "kvpool", [], environ=env)
