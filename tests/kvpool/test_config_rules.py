"""Bounds of a kvpool replica's settings (services/kvpool/config.py) that the mutation audit
found unguarded: each edge its message says is taken is taken, and the value past it is
refused naming the variable."""

from __future__ import annotations

import pytest

from services.common.config import ConfigError, load_config
from services.kvpool.config import MAX_BLOCKS, KvPoolConfig

K = "TIERCACHE_KVPOOL_"


@pytest.mark.parametrize(("name", "taken", "refused"), [
    ("MAX_BATCH_SIZE", "256", "257"),  # "must be in 1..256"
    ("HEARTBEAT_SECONDS", "0.1", "0.09"),  # "must be >= 0.1"
    ("NUM_BLOCKS", str(MAX_BLOCKS), str(MAX_BLOCKS + 1)),  # "must be at most 4,194,304"
    ("SEND_STALL_SECONDS", "1", "0.5"),  # "must be 0 (off) or >= 1"
    ("SEND_STALL_SECONDS", "0", "-1"),
    ("MAX_DRAFT_TOKENS", "64", "65"),  # "must be in 1..64"
    ("PIN_TTL_MAX_SECONDS", "1", "0"),  # "must be >= 1": 0 cut every Warm's pin to nothing
])
def test_each_bound_is_taken_at_its_edge_and_refused_past_it(name, taken, refused):
    cfg = load_config(KvPoolConfig, "kvpool", [], environ={K + name: taken})
    assert getattr(cfg, name.lower()) == type(getattr(cfg, name.lower()))(taken)
    with pytest.raises(ConfigError, match=K + name):
        load_config(KvPoolConfig, "kvpool", [], environ={K + name: refused})


@pytest.mark.parametrize(("name", "value"), [
    ("REPLICA_ID", "\u3164"), ("REPLICA_ID", "\u3164\u3164"), ("MODEL_ID", "\u3164"),
    ("MODEL_ID", "\u200b\ufe0f"),
])
def test_an_id_of_only_invisible_characters_is_refused_at_start(name, value):
    """The Hangul filler passed strip() and isprintable(): a replica named by nothing anyone
    could see in Stats or a log line (and the index refuses such ids at Register, so it
    served but was never indexed). A visible character among them is a replica id; a model
    id refuses any such character (errors.model_id_problem: the index refuses them)."""
    with pytest.raises(ConfigError, match=K + name + ".*invisible"):
        load_config(KvPoolConfig, "kvpool", [], environ={K + name: value})
    if name == "MODEL_ID":
        with pytest.raises(ConfigError, match=K + name + ": holds U.*prints as nothing"):
            load_config(KvPoolConfig, "kvpool", [], environ={K + name: value + "r1"})
        return
    cfg = load_config(KvPoolConfig, "kvpool", [], environ={K + name: value + "r1"})
    assert getattr(cfg, name.lower()) == value + "r1"


@pytest.mark.parametrize("device", ["cuda:00", "cuda:01", "cuda:\u0661", "cuda:\u00b2"])
def test_a_device_index_torch_cannot_read_is_refused_at_start(device):
    """A differential review: these passed validation, torch refuses the string ("Invalid
    device string"), and on a GPU host the replica failed with a traceback (exit 1) at
    `model.to` only after the model had loaded."""
    with pytest.raises(ConfigError, match=K + "DEVICE"):
        load_config(KvPoolConfig, "kvpool", [], environ={K + "DEVICE": device})
    for taken in ("cuda", "cuda:0", "cuda:10"):
        assert load_config(KvPoolConfig, "kvpool", [], environ={K + "DEVICE": taken}).device \
            == taken


@pytest.mark.parametrize(("env", "named"), [
    ({"ADDRESS": "127.0.0.1:0"}, "ADDRESS"),  # port 0 is not host:port to the index
    ({"ADVERTISE_ADDRESS": "a" * 251 + ":50054"}, "ADVERTISE_ADDRESS"),  # 257 characters
    ({"ADVERTISE_ADDRESS": "kv\u200bpool-0:50054"}, "ADVERTISE_ADDRESS"),  # not printable
    ({"ADDRESS": "kv\u200bpool-0:50054"}, "ADDRESS"),
])
def test_an_address_the_index_refuses_at_register_is_refused_with_a_prefix_index(env, named):
    """A differential review: with a prefix index configured, an announced address the index
    refuses at Register (its host:port check, 256 characters, printable) passed validation,
    and the replica served but was never indexed (INVALID_ARGUMENT, retried for good). Without
    a prefix index nothing is announced, and an advertised address fixes the listen one's."""
    env = {K + k: v for k, v in env.items()}
    with pytest.raises(ConfigError, match=K + named + ":"):
        load_config(KvPoolConfig, "kvpool", [],
                    environ={**env, K + "PREFIX_ADDRESS": "127.0.0.1:50053"})
    load_config(KvPoolConfig, "kvpool", [], environ=env)
    if named == "ADDRESS":
        load_config(KvPoolConfig, "kvpool", [],
                    environ={**env, K + "PREFIX_ADDRESS": "127.0.0.1:50053",
                             K + "ADVERTISE_ADDRESS": "kvpool-0.kvpool:50054"})
    load_config(KvPoolConfig, "kvpool", [],
                environ={K + "PREFIX_ADDRESS": "127.0.0.1:50053",
                         K + "ADVERTISE_ADDRESS": "a" * 250 + ":50054"})  # 256: taken


def test_draft_costs_past_a_float_are_refused_as_not_finite():
    """The message says every cost is finite: a decimal of 400 digits parses as inf."""
    huge = "9" * 400
    cfg = KvPoolConfig(draft_costs=",".join(["1"] + [huge] * 16))
    assert cfg.given_costs() is None
    with pytest.raises(ConfigError, match="DRAFT_COSTS"):
        cfg.validate()
