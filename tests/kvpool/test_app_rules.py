"""Rules of building a replica (services/kvpool/app.py) that the mutation audit found
unguarded: one non-finite logit refuses the weights, and the pool sized in bytes takes one
block, and MAX_BLOCKS blocks, at their edges."""

from __future__ import annotations

import os
import types

import pytest
import torch

from services.common.model_store import ModelStoreError
from services.kvpool.app import check_finite, pool_blocks
from services.kvpool.config import MAX_BLOCKS, KvPoolConfig
from services.kvpool.engine import ModelInfo
from tests.e2e.conftest import DRAFT_COSTS


class _Logits:
    """A stand-in model whose one forward gives fixed logits."""

    def __init__(self, logits: list[float]) -> None:
        self.config = types.SimpleNamespace(vocab_size=8)
        self.logits = torch.tensor([logits])

    def __call__(self, input_ids):
        return types.SimpleNamespace(logits=self.logits)


def test_a_single_non_finite_logit_refuses_the_weights():
    """Weights damaged in one place give one NaN or inf among finite logits: refused all the
    same (the check is that every logit is finite)."""
    check_finite(_Logits([0.0, 1.5, -2.0]), "/models/m")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ModelStoreError, match="/models/m give non-finite logits"):
            check_finite(_Logits([0.0, bad, -2.0]), "/models/m")


INFO = ModelInfo("m", num_layers=2, kv_heads=1, head_dim=2, vocab_size=10, max_context=64,
                 eos_token_ids=frozenset())
PER = 2 * 2 * 1 * 16 * 2 * 4  # layers x (K, V) x heads x block tokens x head_dim x fp32


def test_kv_cache_bytes_of_exactly_one_block_make_a_pool_of_one():
    """Refused only when the bytes hold no block: exactly one block's bytes is a pool of 1."""
    assert pool_blocks(KvPoolConfig(kv_cache_bytes=PER), INFO, torch.float32) == 1
    with pytest.raises(ValueError, match="hold no KV block"):
        pool_blocks(KvPoolConfig(kv_cache_bytes=PER - 1), INFO, torch.float32)


def test_kv_cache_bytes_may_make_max_blocks_and_no_more():
    """MAX_BLOCKS blocks are taken; one more is "over the limit"."""
    cfg = KvPoolConfig(kv_cache_bytes=PER * MAX_BLOCKS)
    assert pool_blocks(cfg, INFO, torch.float32) == MAX_BLOCKS
    with pytest.raises(ValueError, match="over the limit"):
        pool_blocks(KvPoolConfig(kv_cache_bytes=PER * (MAX_BLOCKS + 1)), INFO, torch.float32)


def test_max_context_is_the_smaller_of_the_setting_and_the_models(tiny_model):
    """max_context bounds what is served below the model's own positions; a larger setting
    does not serve past max_position_embeddings (1024 for the tiny model)."""
    from services.kvpool.app import build_replica
    from tests.kvpool.conftest import TINY_ID

    for setting, want in ((64, 64), (1_000_000, 1024)):
        cfg = KvPoolConfig(num_blocks=64, block_size=4, drafts=False, max_context=setting,
                           metrics_port=-1)
        replica = build_replica(cfg, model=tiny_model, model_id=TINY_ID, metrics=False)
        try:
            assert replica.info.max_context == want
        finally:
            replica.engine.stop()


# A timing of the real model on a 2-core CPU: forwards of 1..17 tokens over a 1-token one.
COSTS = DRAFT_COSTS


def test_draft_costs_given_choose_the_lengths_untimed(monkeypatch, tiny_model):
    """With TIERCACHE_KVPOOL_DRAFT_COSTS, nothing is timed at start: the lengths are what
    the rule chooses from the costs given, the source says "given", and the engine uses them
    as a timing (the batch rule and the costs learned as served start from them)."""
    from services.kvpool import app
    from services.kvpool.drafting import choose_ladder
    from tests.kvpool.conftest import TINY_ID

    def timed(*a, **kw):
        raise AssertionError("forward costs timed although given")

    monkeypatch.setattr(app, "forward_costs", timed)
    cfg = KvPoolConfig(num_blocks=64, block_size=4, metrics_port=-1,
                       draft_costs=",".join(map(str, COSTS)))
    choice = app.draft_ladder(cfg, tiny_model)
    assert choice.ladder == choose_ladder(dict(enumerate(COSTS, start=1)), 16) == (3, 5, 16)
    assert (choice.source, choice.costs, choice.measured) == ("given", COSTS, True)
    replica = app.build_replica(cfg, model=tiny_model, model_id=TINY_ID, metrics=False)
    try:
        engine = replica.engine
        assert engine.draft_ladder == choice and engine.costs() == COSTS
        assert engine.served_costs is not None
    finally:
        replica.engine.stop()
    # Without the costs, "auto" times them (the stand-in above is what gets called).
    with pytest.raises(AssertionError, match="timed although given"):
        app.forward_costs(tiny_model, 17)
    fell_back = app.draft_ladder(KvPoolConfig(num_blocks=64, block_size=4), tiny_model)
    assert fell_back.source.startswith("fixed: could not time draft forwards")


@pytest.mark.parametrize(("blocks", "pinned", "tenant", "want"), [
    (100, 0.58, 0.29, (58, 29)), (100, 0.57, 0.07, (57, 7)), (50, 0.58, 0.14, (29, 7)),
    (10, 0.5, 0.25, (5, 2)), (1, 0.5, 0.25, (1, 1)),
])
def test_the_pin_limits_are_the_configured_shares_of_the_pool(tiny_model, blocks, pinned,
                                                              tenant, want):
    """A differential review: `int(n * fraction)` in binary floating point made 100 x 0.29 =
    28.999999999999996 blocks 28, not 29: a share's last block was refused. At least one."""
    from services.kvpool.app import build_replica
    from tests.kvpool.conftest import TINY_ID

    cfg = KvPoolConfig(num_blocks=blocks, block_size=4, drafts=False, metrics_port=-1,
                       max_pinned_fraction=pinned, max_pinned_per_tenant_fraction=tenant)
    replica = build_replica(cfg, model=tiny_model, model_id=TINY_ID, metrics=False)
    try:
        assert (replica.engine.pool.max_pinned, replica.engine.pool.max_pinned_per_salt) == want
    finally:
        replica.engine.stop()


@pytest.mark.parametrize("inherited", [
    {"TIERCACHE_KVPOOL_DRAFT_LADDER": "2,4,8"}, {"TIERCACHE_KVPOOL_MAX_DRAFT_TOKENS": "8"},
    {"TIERCACHE_KVPOOL_DRAFT_COSTS": "1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1"}])
def test_e2e_replicas_take_the_costs_only_where_nothing_sets_drafts(monkeypatch, inherited):
    """The e2e replicas inherit os.environ under their env: costs given beside a ladder or
    another max_draft_tokens exported in the shell are settings every replica refuses."""
    from services.common.config import load_config
    from tests.e2e.conftest import with_draft_costs

    assert with_draft_costs({})["TIERCACHE_KVPOOL_DRAFT_COSTS"] == ",".join(map(str, COSTS))
    for k, v in inherited.items():
        monkeypatch.setenv(k, v)
    env = {**os.environ, **with_draft_costs({})}
    load_config(KvPoolConfig, "kvpool", [], env)  # the replica's own settings check passes


def test_the_costs_a_start_log_prints_start_another_replica_alike(monkeypatch, caplog,
                                                                   tiny_model):
    """The value a replica that timed its forwards logs for TIERCACHE_KVPOOL_DRAFT_COSTS is
    taken as it is and gives the same lengths, untimed."""
    import logging
    import re

    from services.common.config import load_config
    from services.kvpool import app

    seconds = {q: 0.01 * c for q, c in enumerate(DRAFT_COSTS, start=1)}  # a timing, in s
    monkeypatch.setattr(app, "forward_costs", lambda *a, **kw: seconds)
    with caplog.at_level(logging.INFO, logger="services.kvpool.app"):
        timed = app.draft_ladder(KvPoolConfig(), tiny_model)
    assert timed.source == "measured"
    value = re.search(r"TIERCACHE_KVPOOL_DRAFT_COSTS=(\S+)\)", caplog.text).group(1)
    cfg = load_config(KvPoolConfig, "kvpool", [],
                      environ={"TIERCACHE_KVPOOL_DRAFT_COSTS": value})
    monkeypatch.setattr(app, "forward_costs", None)  # not called again
    given = app.draft_ladder(cfg, tiny_model)
    assert (given.ladder, given.costs, given.source) == (timed.ladder, timed.costs, "given")


def test_a_timed_ladder_is_chosen_from_the_costs_it_reports(monkeypatch, caplog, tiny_model):
    """A differential review: the ladder was chosen from the raw seconds while the costs
    reported and logged are rounded to three decimals. Here 3 tokens at 0.9804 and 4 at
    1.0004 of one token's (1 is not 2% cheaper than 2: lengths 2,2,2) print as 0.98 and 1.0
    (it is: 1,2,2), and a replica given the printed value chose other lengths than the one
    that printed it ("used as that timing would be")."""
    import logging
    import re

    from services.common.config import load_config
    from services.kvpool import app

    seconds = {1: 0.01, 2: 0.009804, 3: 0.010004}
    monkeypatch.setattr(app, "forward_costs", lambda *a, **kw: seconds)
    cfg = load_config(KvPoolConfig, "kvpool", [],
                      environ={"TIERCACHE_KVPOOL_MAX_DRAFT_TOKENS": "2"})
    with caplog.at_level(logging.INFO, logger="services.kvpool.app"):
        timed = app.draft_ladder(cfg, tiny_model)
    assert timed.costs == (1.0, 0.98, 1.0)
    value = re.search(r"TIERCACHE_KVPOOL_DRAFT_COSTS=(\S+)\)", caplog.text).group(1)
    given = app.draft_ladder(load_config(KvPoolConfig, "kvpool", [], environ={
        "TIERCACHE_KVPOOL_MAX_DRAFT_TOKENS": "2", "TIERCACHE_KVPOOL_DRAFT_COSTS": value}),
        tiny_model)
    assert timed.ladder == given.ladder == (1, 2, 2)


def test_a_one_token_forward_timed_zero_keeps_the_fixed_lengths(monkeypatch, caplog, tiny_model):
    """A clock too coarse to time one token's forward (0 s) divided every cost by zero: the
    replica failed to start. It keeps the fixed lengths instead and says why."""
    import logging

    from services.common.config import load_config
    from services.kvpool import app
    from services.kvpool.drafting import default_ladder

    monkeypatch.setattr(app, "forward_costs", lambda *a, **kw: {1: 0.0, 2: 0.0, 3: 0.015})
    cfg = load_config(KvPoolConfig, "kvpool", [],
                      environ={"TIERCACHE_KVPOOL_MAX_DRAFT_TOKENS": "2"})
    with caplog.at_level(logging.WARNING, logger="services.kvpool.app"):
        got = app.draft_ladder(cfg, tiny_model)
    assert got.ladder == default_ladder(2) and got.costs == ()
    assert got.source == "fixed: draft forward timings unusable (one token's forward timed 0 s)"
    assert "timed 0 s" in caplog.text


def _config_only_folder(path) -> str:
    """A model folder with a config.json and no weights: INFO's shape (2 layers, 1 KV head,
    head dim 2), so a 16-token fp32 block is PER bytes."""
    import json

    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 2,
        "num_key_value_heads": 1, "hidden_size": 4, "intermediate_size": 8, "vocab_size": 10,
        "max_position_embeddings": 64}))
    return str(path)


def test_kv_cache_bytes_holding_no_block_is_judged_from_the_config_alone(tmp_path):
    """The block's bytes come from config.json, before any weight loads (the folder has
    none); the same edges as `pool_blocks`, in the configured dtype."""
    from services.kvpool.app import pool_problem

    model = _config_only_folder(tmp_path / "m")
    assert pool_problem(KvPoolConfig(model=model, kv_cache_bytes=PER)) == ""
    assert f"hold no KV block of this model ({PER} bytes per 16-token block)" in pool_problem(
        KvPoolConfig(model=model, kv_cache_bytes=PER - 1))
    assert pool_problem(KvPoolConfig(model=model, kv_cache_bytes=PER // 2,
                                     dtype="bfloat16")) == ""
    assert "over the limit" in pool_problem(
        KvPoolConfig(model=model, kv_cache_bytes=PER * (MAX_BLOCKS + 1)))
    # Sized in blocks, the bytes are not read.
    assert pool_problem(KvPoolConfig(model=model, num_blocks=4, kv_cache_bytes=1)) == ""


def test_the_packaged_model_not_yet_converted_is_left_to_the_load(tmp_path):
    """Nothing to read before converting: not judged here (and nothing is converted)."""
    from services.kvpool.app import pool_problem

    assert pool_problem(KvPoolConfig(cache_dir=str(tmp_path), kv_cache_bytes=1)) == ""
    assert list(tmp_path.iterdir()) == []


def test_a_replica_refuses_a_pool_of_no_block_before_binding_or_loading(tmp_path, monkeypatch):
    """Live: `--kv-cache-bytes 1000` was refused only after the model had loaded, as "the
    model could not be loaded" and named as the variable. Now a ConfigError (service_main:
    one line naming the flag as given, exit 2) before the server binds."""
    import services.kvpool.__main__ as entry
    from services.common.config import ConfigError

    def bound(**kw):
        raise AssertionError("bound and went on to load the model")

    monkeypatch.setattr(entry, "create_server", bound)
    model = _config_only_folder(tmp_path / "m")
    with pytest.raises(ConfigError, match=f"{PER - 1} bytes hold no KV block"):
        entry._main(["--model", model, "--kv-cache-bytes", str(PER - 1), "--metrics-port", "-1"])


def test_an_architecture_without_sdpa_attention_is_refused_naming_the_folder(tmp_path):
    """The engine drives every model through SDPA (one 4-D boolean mask over the paged rows):
    a Gemma 2 folder was refused by transformers' own paragraph, which named neither the
    folder nor the setting. The refusal is one line naming both, and a Llama folder passes."""
    from transformers import Gemma2Config, LlamaConfig

    from services.kvpool.app import check_attention, load_model

    small = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    Gemma2Config(**small).save_pretrained(tmp_path / "gemma2")
    LlamaConfig(**small).save_pretrained(tmp_path / "llama")
    check_attention(str(tmp_path / "llama"))
    folder = str(tmp_path / "gemma2")
    with pytest.raises(ModelStoreError) as e:
        load_model(KvPoolConfig(model=folder))
    msg = str(e.value)
    assert "\n" not in msg and folder in msg and "Gemma2ForCausalLM" in msg
    assert "TIERCACHE_KVPOOL_MODEL" in msg and "SDPA" in msg


def test_the_replicas_pool_ages_its_shallow_hits(tiny_model):
    """The replica's pool ranks shallow blocks with the hit half-life (see
    `test_shallow_hits_age_so_a_base_hot_long_ago_goes_before_one_hot_now`): built without
    it, a base hot once stayed ahead of every base hot since, for good."""
    from services.common.policy import POOL_HIT_HALF_LIFE_S, HybridPolicy
    from services.kvpool import app
    from tests.kvpool.conftest import TINY_ID

    cfg = KvPoolConfig(num_blocks=64, block_size=4, metrics_port=-1, draft_costs="1,1,1")
    replica = app.build_replica(cfg, model=tiny_model, model_id=TINY_ID, metrics=False)
    try:
        policy = replica.engine.pool.policy
        assert isinstance(policy, HybridPolicy) and policy.half_life == POOL_HIT_HALF_LIFE_S
    finally:
        replica.engine.stop()


@pytest.mark.parametrize(("given", "want"), [(None, "256"), ("1024", "1024")])
def test_the_replica_caps_onednns_primitive_cache_unless_the_environment_sets_it(given, want):
    """oneDNN keeps a compiled kernel (~0.65 MiB) per forward size up to 1,024 by default: a
    replica's RSS rose 20 MiB a minute under steady traffic, 10.6 with 256 (docs/deploy.md,
    Memory). `python -m services.kvpool` sets 256 before torch loads; an operator's value
    stands."""
    import subprocess
    import sys
    from pathlib import Path

    name = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"
    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k != name}
    env["PYTHONPATH"] = os.pathsep.join([str(root), str(root / "gen")])
    if given is not None:
        env[name] = given
    out = subprocess.run(
        [sys.executable, "-c", f"import os, services.kvpool.__main__; print(os.environ[{name!r}])"],
        cwd=root, env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == want
