import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.common.config import ConfigError, env_name, load_config, require
from services.common.model_store import ModelStoreError


@dataclass(frozen=True)
class DemoConfig:
    address: str = "127.0.0.1:1"
    num_blocks: int = 8
    ratio: float = 0.5
    enabled: bool = False
    peers: tuple[str, ...] = ()

    def validate(self) -> None:
        require(self.num_blocks > 0, "demo", "num_blocks", "must be > 0")


def test_defaults_env_then_flags():
    env = {"TIERCACHE_DEMO_NUM_BLOCKS": "32", "TIERCACHE_DEMO_ENABLED": "yes",
           "TIERCACHE_DEMO_PEERS": "a:1, b:2", "TIERCACHE_DEMO_RATIO": "0.25"}
    cfg = load_config(DemoConfig, "demo", ["--num-blocks", "64"], environ=env)
    assert cfg == DemoConfig("127.0.0.1:1", 64, 0.25, True, ("a:1", "b:2"))


def test_env_name():
    assert env_name("kvpool", "num_blocks") == "TIERCACHE_KVPOOL_NUM_BLOCKS"


@pytest.mark.parametrize("env,needle", [
    ({"TIERCACHE_DEMO_NUM_BLOCKS": "many"}, "TIERCACHE_DEMO_NUM_BLOCKS"),
    ({"TIERCACHE_DEMO_ENABLED": "perhaps"}, "TIERCACHE_DEMO_ENABLED"),
    ({"TIERCACHE_DEMO_NUM_BLOCKS": "0"}, "TIERCACHE_DEMO_NUM_BLOCKS: must be > 0"),
])
def test_bad_values_name_the_variable(env, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config(DemoConfig, "demo", [], environ=env)


def test_bad_flag_names_the_flag():
    with pytest.raises(ConfigError, match="--ratio"):
        load_config(DemoConfig, "demo", ["--ratio", "x"], environ={})


@pytest.mark.parametrize("var,value,want", [
    ("PREFIX_ADDRESSES", ",", "only commas, no entry"),
    ("PREFIX_ADDRESSES", " , ", "only commas, no entry"),
    ("SEMANTIC_ADDRESS", ",", "must name at least one host:port"),
    ("SEMANTIC_ADDRESS", " , ,", "must name at least one host:port"),
])
def test_a_shard_list_of_only_commas_is_refused_not_read_as_tier_off(var, value, want):
    """Empty, a shard list turns its tier off; "," (a list whose entries were lost) ran the
    orchestrator without the tier, no word said. kvpool's prefix_address refused it already."""
    from services.orchestrator.config import OrchestratorConfig

    var = "TIERCACHE_ORCHESTRATOR_" + var
    with pytest.raises(ConfigError, match=f"^{var}: {want}"):
        load_config(OrchestratorConfig, "orchestrator", [], environ={var: value})
    cfg = load_config(OrchestratorConfig, "orchestrator", [], environ={var: ""})
    assert not cfg.prefix_addresses and not cfg.semantic_address


def test_orchestrator_config_validates():
    from services.orchestrator.config import OrchestratorConfig

    with pytest.raises(ConfigError, match="TIERCACHE_ORCHESTRATOR_SEMANTIC_TIER"):
        load_config(OrchestratorConfig, "orchestrator", ["--semantic-tier", "lax"], environ={})
    cfg = load_config(OrchestratorConfig, "orchestrator", [],
                      environ={"TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES": "h:1,h:2"})
    assert cfg.kvpool_addresses == ("h:1", "h:2")
    with pytest.raises(ConfigError, match="TIERCACHE_ORCHESTRATOR_REPLICA_POLL_S"):
        load_config(OrchestratorConfig, "orchestrator", ["--replica-poll-s", "0"], environ={})
    with pytest.raises(ConfigError, match="TIERCACHE_ORCHESTRATOR_REPLICA_STATS_TIMEOUT_S"):
        load_config(OrchestratorConfig, "orchestrator", [],
                    environ={"TIERCACHE_ORCHESTRATOR_REPLICA_STATS_TIMEOUT_S": "0"})
    with pytest.raises(ConfigError, match="TIERCACHE_ORCHESTRATOR_REPLICA_HUNG_POLLS"):
        load_config(OrchestratorConfig, "orchestrator", ["--replica-hung-polls", "0"],
                    environ={})


@pytest.mark.parametrize(("value", "ok"), [("0.1", False), ("0.49", False), ("0", True),
                                           ("0.5", True)])
def test_the_tokens_file_is_read_once_or_rechecked_at_most_twice_a_second(value, ok):
    """A mutation audit: no test set tokens_reload_s, so its floor (0 = read once, else
    >= 0.5 s; below, the watcher hashed the tokens file many times a second) could go."""
    from services.orchestrator.config import OrchestratorConfig

    env = {"TIERCACHE_ORCHESTRATOR_TOKENS_RELOAD_S": value}
    if ok:
        assert load_config(OrchestratorConfig, "orchestrator", [],
                           environ=env).tokens_reload_s == float(value)
    else:
        with pytest.raises(ConfigError, match=r"TIERCACHE_ORCHESTRATOR_TOKENS_RELOAD_S: must "
                                              r"be 0 \(read once\) or >= 0\.5"):
            load_config(OrchestratorConfig, "orchestrator", [], environ=env)


def test_an_unknown_log_level_is_a_config_error_not_a_traceback(monkeypatch, caplog):
    """A service's main gets None (and exits 2) with a message naming the variable."""
    import logging

    from services.common.bootstrap import load_service_config

    monkeypatch.setenv("TIERCACHE_LOG_LEVEL", "verbose")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert load_service_config(DemoConfig, "demo", []) is None
        monkeypatch.setenv("TIERCACHE_LOG_LEVEL", "warning")
        assert load_service_config(DemoConfig, "demo", []) == DemoConfig()
        assert root.level == logging.WARNING
        monkeypatch.setenv("TIERCACHE_LOG_LEVEL", " error\n")  # stripped, as every setting
        assert load_service_config(DemoConfig, "demo", []) == DemoConfig()
        assert root.level == logging.ERROR
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


@pytest.mark.parametrize("var,value", [("TIERCACHE_DRAIN_DELAY_S", "abc"),
                                       ("TIERCACHE_HASH_KEY", "k" * 65)])
def test_process_wide_settings_fail_the_start_before_anything_binds(monkeypatch, capfd, var,
                                                                     value):
    """Read later (drain delay at shutdown, hash key after the model loads), they used to
    crash with a traceback and exit 1 after health said SERVING."""
    import logging

    from services.common.bootstrap import load_service_config

    monkeypatch.setenv(var, value)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert load_service_config(DemoConfig, "demo", []) is None
        err = capfd.readouterr().err
        assert var in err and "bad configuration" in err
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_a_cuda_device_without_cuda_is_refused_before_the_model_loads(monkeypatch):
    import logging

    import torch

    from services.kvpool.__main__ import device_problem, main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_problem("cpu") == ""
    assert "no CUDA device" in device_problem("cuda")
    monkeypatch.setenv("TIERCACHE_KVPOOL_DEVICE", "cuda:0")
    monkeypatch.setenv("TIERCACHE_KVPOOL_ADDRESS", "127.0.0.1:0")
    monkeypatch.setenv("TIERCACHE_KVPOOL_METRICS_PORT", "-1")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        assert main([]) == 2
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_problem("cuda:0") == "" and "only 1" in device_problem("cuda:1")


def test_library_callers_get_the_device_problem_not_torchs_assertion(monkeypatch):
    """build_replica/load_model (benchmarks, tests) skipped the check __main__ makes: a CUDA
    device on a CPU-only torch raised AssertionError from inside torch."""
    import pytest
    import torch

    from services.kvpool.app import load_model
    from services.kvpool.config import KvPoolConfig

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^TIERCACHE_KVPOOL_DEVICE=cuda:0: this torch .* sees "
                                         r"no CUDA device"):
        load_model(KvPoolConfig(device="cuda:0"))


def test_float32_matmuls_are_pinned_to_full_precision_on_cuda():
    """Nothing turned TF32 off: with NVIDIA_TF32_OVERRIDE=1, or any import enabling it, float32
    products kept ~10 mantissa bits and greedy tokens could change with batching."""
    import torch

    from services.kvpool.app import exact_matmuls

    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
             torch.get_float32_matmul_precision(),
             torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
             torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("medium")
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = True
        exact_matmuls()
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
        # Half precision left as it was: its speed is the point of the dtype.
        assert torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction
    finally:
        (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) = saved[:2]
        torch.set_float32_matmul_precision(saved[2])
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = saved[3]
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved[4]


def _kvpool_start_failing_with(monkeypatch, exc: BaseException) -> int:
    """`python -m services.kvpool`'s exit code when building the replica raises `exc`."""
    import logging

    import services.kvpool.__main__ as kv_main

    def fail(cfg):
        raise exc

    monkeypatch.setattr(kv_main, "build_replica", fail)
    monkeypatch.setenv("TIERCACHE_KVPOOL_ADDRESS", "127.0.0.1:0")
    monkeypatch.setenv("TIERCACHE_KVPOOL_METRICS_PORT", "-1")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        return kv_main.main([])
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_a_pool_too_big_for_memory_is_a_bad_configuration(monkeypatch, capfd):
    """A pool or rows too big for the GPU, or a CPU allocation that failed, gave a traceback
    and exit 1 naming no setting; kv_cache_bytes making billions of blocks built a Python list
    of them first (2.6 GB in 30 s and growing)."""
    from types import SimpleNamespace

    import torch

    from services.kvpool.app import pool_blocks
    from services.kvpool.config import KvPoolConfig

    info = SimpleNamespace(num_layers=2, kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"^TIERCACHE_KVPOOL_KV_CACHE_BYTES: .* over the limit"):
        pool_blocks(KvPoolConfig(kv_cache_bytes=10**18), info, torch.float32)
    for exc in (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
                RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: "
                             "can't allocate memory: you tried to allocate 2211840000000 bytes")):
        assert _kvpool_start_failing_with(monkeypatch, exc) == 2
        err = capfd.readouterr().err
        assert "out of memory loading" in err and "TIERCACHE_KVPOOL_KV_CACHE_BYTES" in err
        assert "Traceback" not in err


@pytest.mark.parametrize("exc, says", [
    (ModelStoreError("TIERCACHE_KVPOOL_MODEL: /m has no config.json"),
     "bad configuration (the model could not be loaded): TIERCACHE_KVPOOL_MODEL: /m has no "
     "config.json"),
    (ValueError("unrecognized configuration class"),
     "bad configuration (the model could not be loaded): unrecognized configuration class"),
    (OSError(28, "No space left on device", "/c/w.bin"),
     "cannot start: /c/w.bin cannot be written (No space left on device): free space"),
])
def test_a_model_that_cannot_be_loaded_is_a_bad_configuration(monkeypatch, capfd, exc, says):
    """How a replica's start ends when its model cannot be loaded: one line, exit 2, a full
    volume said as such; pinned before `_main` was split into its steps."""
    assert _kvpool_start_failing_with(monkeypatch, exc) == 2
    err = capfd.readouterr().err
    assert says in err and "Traceback" not in err


def test_a_runtime_error_other_than_out_of_memory_is_not_a_configuration(monkeypatch):
    """Only an allocation failure is said as a setting to lower: another RuntimeError from the
    load goes on up (a traceback, exit 1); pinned before `_main` was split into its steps."""
    with pytest.raises(RuntimeError, match="^expected all tensors on one device$"):
        _kvpool_start_failing_with(monkeypatch, RuntimeError("expected all tensors on one device"))


def test_a_file_where_a_semantic_folder_must_be_names_the_variable(tmp_path):
    from services.semantic.config import SemanticConfig

    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match=r"^TIERCACHE_SEMANTIC_DB_PATH: .*afile is a file"):
        load_config(SemanticConfig, "semantic", [],
                    {"TIERCACHE_SEMANTIC_DB_PATH": str(tmp_path / "afile" / "s.db")})
    with pytest.raises(ConfigError, match=r"^TIERCACHE_SEMANTIC_CACHE_DIR: .*afile is a file"):
        load_config(SemanticConfig, "semantic", [],
                    {"TIERCACHE_SEMANTIC_CACHE_DIR": str(tmp_path / "afile")})
    load_config(SemanticConfig, "semantic", [],  # folders not made yet are fine
                {"TIERCACHE_SEMANTIC_DB_PATH": str(tmp_path / "new" / "deeper" / "s.db")})


def test_another_embedding_folder_gets_its_own_name():
    """The default name used to stand for any folder: another model's ONNX export went to
    all-MiniLM-L6-v2's cache path (replacing it) and its entries carried MiniLM's name."""
    from services.semantic.config import SemanticConfig, default_model_dir

    assert SemanticConfig().resolved_model_name() == "all-MiniLM-L6-v2"
    assert SemanticConfig(model_dir=default_model_dir() + "/").resolved_model_name() \
        == "all-MiniLM-L6-v2"  # the packaged folder named explicitly
    assert SemanticConfig(model_dir="/models/paraphrase-multilingual-MiniLM-L12-v2/"
                          ).resolved_model_name() == "paraphrase-multilingual-MiniLM-L12-v2"
    assert SemanticConfig(model_dir="/models/x", model_name="mine").resolved_model_name() == "mine"


def test_the_orchestrator_reads_converted_models_from_its_own_cache_dir(monkeypatch, tmp_path):
    """Before, only kvpool had cache_dir: setting it alone made the orchestrator convert the
    packaged model a second time into the default cache, just for its tokenizer."""
    from services.common.model_store import ModelStoreError
    from services.orchestrator import app
    from services.orchestrator.config import OrchestratorConfig

    seen = []

    def resolve(spec, cache_dir=None, model_id=None, load=None):
        seen.append((spec, cache_dir))
        raise ModelStoreError("stop here")  # nothing after resolving matters here

    monkeypatch.setattr(app, "load_resolved", resolve)
    cfg = load_config(OrchestratorConfig, "orchestrator", [],
                      environ={"TIERCACHE_ORCHESTRATOR_CACHE_DIR": str(tmp_path)})
    with pytest.raises(ModelStoreError):
        app.build(cfg)
    assert seen == [("smollm2", str(tmp_path))]


@pytest.mark.parametrize("var,value", [("TIERCACHE_KVPOOL_MAX_WAITING", "0"),
                                       ("TIERCACHE_KVPOOL_DEVICE", "cudafoo"),
                                       ("TIERCACHE_KVPOOL_DEVICE", "cuda:abc"),
                                       ("TIERCACHE_KVPOOL_DRAFT_BRANCHES", "0"),
                                       ("TIERCACHE_KVPOOL_DRAFT_BRANCHES", "17")])
def test_kvpool_settings_that_would_brick_or_crash_the_replica_are_refused(var, value):
    """max_waiting=0 refused every request on an idle replica; 'cuda:abc' crashed int() at
    start and 'cudafoo' failed inside torch."""
    from services.kvpool.config import KvPoolConfig

    with pytest.raises(ConfigError, match=var):
        load_config(KvPoolConfig, "kvpool", [], environ={var: value})
    assert load_config(KvPoolConfig, "kvpool", [],
                       environ={"TIERCACHE_KVPOOL_DEVICE": "cuda:1"}).device == "cuda:1"


# ---- the config review: values that passed and then misbehaved ------------------------------

def config_class(service: str) -> type:
    from services.kvpool.config import KvPoolConfig
    from services.orchestrator.config import OrchestratorConfig
    from services.prefix.config import PrefixConfig
    from services.semantic.config import SemanticConfig

    return {"semantic": SemanticConfig, "prefix": PrefixConfig, "kvpool": KvPoolConfig,
            "orchestrator": OrchestratorConfig}[service]


def run_service(service: str, env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    """`python -m services.<service>` from the repo root with `env` added; its output."""
    root = Path(__file__).resolve().parent.parent
    full = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{root / 'gen'}", **env}
    return subprocess.run([sys.executable, "-m", f"services.{service}"], env=full, cwd=root,
                          capture_output=True, text=True, timeout=timeout)

@pytest.mark.parametrize("service", ["semantic", "prefix", "kvpool", "orchestrator"])
@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:abc", ":", "127.0.0.1"])
def test_a_listen_address_outside_host_port_is_refused(service, address):
    """gRPC took port 99999 modulo 65536 and served on 34463 without a word; `host:abc`
    passed too."""
    cls = config_class(service)
    with pytest.raises(ConfigError, match=f"TIERCACHE_{service.upper()}_ADDRESS"):
        load_config(cls, service, [], environ={f"TIERCACHE_{service.upper()}_ADDRESS": address})
    assert load_config(cls, service, [], environ={
        f"TIERCACHE_{service.upper()}_ADDRESS": "127.0.0.1:0"}).address == "127.0.0.1:0"


@pytest.mark.parametrize(("service", "env", "var"), [
    ("semantic", {"TIERCACHE_SEMANTIC_TIER_STRICT": "0.90",
                  "TIERCACHE_SEMANTIC_TIER_RELAXED": "0.97"}, "TIERCACHE_SEMANTIC_TIER_RELAXED"),
    ("semantic", {"TIERCACHE_SEMANTIC_MAX_TENANT_CHARS": "0"},
     "TIERCACHE_SEMANTIC_MAX_TENANT_CHARS"),
    ("orchestrator", {"TIERCACHE_ORCHESTRATOR_MAX_MESSAGE_CHARS": "-1"},
     "TIERCACHE_ORCHESTRATOR_MAX_MESSAGE_CHARS"),
    ("prefix", {"TIERCACHE_PREFIX_LEASE_SECONDS": "1e11"}, "TIERCACHE_PREFIX_LEASE_SECONDS"),
    ("semantic", {"TIERCACHE_SEMANTIC_GRACE_SECONDS": "-1"}, "TIERCACHE_SEMANTIC_GRACE_SECONDS"),
    ("semantic", {"TIERCACHE_SEMANTIC_INDEX_CLOSE_SECONDS": "-1"},
     "TIERCACHE_SEMANTIC_INDEX_CLOSE_SECONDS"),
    ("orchestrator", {"TIERCACHE_ORCHESTRATOR_TOKENS": "a=b,a=c"},
     "TIERCACHE_ORCHESTRATOR_TOKENS.*repeats"),
    # Past what their int32 / uint32 proto fields carry: every request (warm-up) failed.
    ("orchestrator", {"TIERCACHE_ORCHESTRATOR_MAX_TOKENS_LIMIT": "3000000000"},
     "TIERCACHE_ORCHESTRATOR_MAX_TOKENS_LIMIT"),
    ("orchestrator", {"TIERCACHE_ORCHESTRATOR_WARM_PIN_TTL_MAX_S": "5000000000"},
     "TIERCACHE_ORCHESTRATOR_WARM_PIN_TTL_MAX_S"),
    # Over the native block hasher's 2^20 (it refused what the Python one hashed).
    ("orchestrator", {"TIERCACHE_ORCHESTRATOR_BLOCK_SIZE": "2000000"},
     "TIERCACHE_ORCHESTRATOR_BLOCK_SIZE"),
    ("prefix", {"TIERCACHE_PREFIX_BLOCK_SIZE": "2000000"}, "TIERCACHE_PREFIX_BLOCK_SIZE"),
    # Refused by the index at Register, forever: the replica served and was never indexed.
    ("kvpool", {"TIERCACHE_KVPOOL_REPLICA_ID": "kv pool"}, "TIERCACHE_KVPOOL_REPLICA_ID"),
    ("kvpool", {"TIERCACHE_KVPOOL_MODEL_ID": "m" * 300}, "TIERCACHE_KVPOOL_MODEL_ID"),
    # Overflowed inside torch, faiss or ONNX Runtime later (a dead engine thread, a merge
    # thread's traceback at every start, a hang), or grew a list until the OOM killer.
    ("kvpool", {"TIERCACHE_KVPOOL_TORCH_THREADS": "99999999999999999999"},
     "TIERCACHE_KVPOOL_TORCH_THREADS"),
    ("kvpool", {"TIERCACHE_KVPOOL_NUM_BLOCKS": "99999999999999999999"},
     "TIERCACHE_KVPOOL_NUM_BLOCKS"),
    ("semantic", {"TIERCACHE_SEMANTIC_HNSW_EF_SEARCH": "3000000000"},
     "TIERCACHE_SEMANTIC_HNSW_EF_SEARCH"),
    ("semantic", {"TIERCACHE_SEMANTIC_HNSW_EF_CONSTRUCTION": "3000000000"},
     "TIERCACHE_SEMANTIC_HNSW_EF_CONSTRUCTION"),
    ("semantic", {"TIERCACHE_SEMANTIC_FAISS_THREADS": "5000000000"},
     "TIERCACHE_SEMANTIC_FAISS_THREADS"),
    ("semantic", {"TIERCACHE_SEMANTIC_ONNX_THREADS": "100000"}, "TIERCACHE_SEMANTIC_ONNX_THREADS"),
    # The variable the user set is the one named (relaxed raised was blamed on standard).
    ("semantic", {"TIERCACHE_SEMANTIC_TIER_RELAXED": "0.98"}, "TIERCACHE_SEMANTIC_TIER_RELAXED"),
    ("semantic", {"TIERCACHE_SEMANTIC_DEFAULT_TTL_SECONDS": "99999999999"},
     "TIERCACHE_SEMANTIC_DEFAULT_TTL_SECONDS.*max_ttl_seconds"),
    ("semantic", {"TIERCACHE_SEMANTIC_MAX_TTL_SECONDS": "3600"},
     "TIERCACHE_SEMANTIC_MAX_TTL_SECONDS.*default_ttl_seconds"),
    ("semantic", {"TIERCACHE_SEMANTIC_TIER_STRICT": "0.93"}, "TIERCACHE_SEMANTIC_TIER_STRICT"),
    ("semantic", {"TIERCACHE_SEMANTIC_EXPIRY_INTERVAL_S": "1e-9"},
     "TIERCACHE_SEMANTIC_EXPIRY_INTERVAL_S"),
    # A folder name under the ONNX cache: "../x" put the export outside it.
    ("semantic", {"TIERCACHE_SEMANTIC_MODEL_NAME": "../elsewhere"},
     "TIERCACHE_SEMANTIC_MODEL_NAME"),
    ("semantic", {"TIERCACHE_SEMANTIC_MODEL_NAME": "/abs/path"}, "TIERCACHE_SEMANTIC_MODEL_NAME"),
    # Every replica counted as a prefix holder: routing lost its session ring.
    ("orchestrator", {"TIERCACHE_ORCHESTRATOR_MIN_PREFIX_TOKENS": "-5"},
     "TIERCACHE_ORCHESTRATOR_MIN_PREFIX_TOKENS"),
])
def test_settings_that_started_a_service_refusing_everything_are_refused(service, env, var):
    """Crossed tiers made strict laxer than relaxed; a tenant/message limit of 0 refused every
    request; a 1e11 s lease killed the sweeper thread (Event.wait overflow); a repeated token
    silently moved to the last tenant."""
    cls = config_class(service)
    with pytest.raises(ConfigError, match=var):
        load_config(cls, service, [], environ=env)


def test_a_tokens_file_that_is_not_json_or_repeats_a_token_names_the_file(tmp_path):
    from services.orchestrator.tenants import TenantRegistry

    def build(text: str) -> None:
        f = tmp_path / "tokens.json"
        f.write_text(text)
        TenantRegistry.build(tokens_file=str(f), tokens="", key=b"k", max_prompt_tokens=1,
                             max_tokens=1, max_concurrent=1)

    with pytest.raises(ValueError, match=r"tokens\.json: not JSON"):
        build("nope")
    with pytest.raises(ValueError, match=r"tokens\.json: .*repeats") as e:
        build('{"secret-1": "a", "secret-1": "b"}')
    assert "secret-1" not in str(e.value)  # a token is never shown


@pytest.mark.parametrize("what", ["address", "metrics_port"])
def test_a_port_in_use_is_one_line_and_exit_2_not_a_traceback(what):
    """add_insecure_port raises RuntimeError (and the metrics server OSError) where the code
    checked for a 0 return: every service died with a traceback and exit 1."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        busy = held.getsockname()[1]
        r = run_service("prefix", {
            "TIERCACHE_PREFIX_ADDRESS": f"127.0.0.1:{busy}" if what == "address"
            else "127.0.0.1:0",
            "TIERCACHE_PREFIX_METRICS_PORT": str(busy) if what == "metrics_port" else "-1"},
            timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert f"TIERCACHE_PREFIX_{what.upper()}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("service", ["semantic", "kvpool"])
def test_a_bad_path_found_only_at_start_is_one_line_and_exit_2(tmp_path, service):
    """semantic: a database path that is a folder died with IsADirectoryError (exit 1, a
    traceback); kvpool: a model folder whose config.json names no model_type with ValueError."""
    up = service.upper()
    env = {f"TIERCACHE_{up}_ADDRESS": "127.0.0.1:0", f"TIERCACHE_{up}_METRICS_PORT": "-1"}
    if service == "semantic":
        env["TIERCACHE_SEMANTIC_DB_PATH"] = str(tmp_path)  # a folder
    else:
        (tmp_path / "config.json").write_text("{}")
        env["TIERCACHE_KVPOOL_MODEL"] = str(tmp_path)
    r = run_service(service, env, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    if service == "semantic":  # the store's own start check names the folder and the way out
        assert f"cannot start: {tmp_path} is a folder" in r.stderr, r.stderr[-2000:]
        assert "TIERCACHE_SEMANTIC_DB_PATH" in r.stderr
    else:
        assert "bad configuration" in r.stderr


def test_help_shows_each_default_and_a_refused_flag_is_named_as_the_flag(capsys):
    """--help showed neither defaults nor what a flag takes (booleans need a value); a value
    refused after parsing named the environment variable though the user typed a flag."""
    from services.prefix.config import PrefixConfig

    with pytest.raises(SystemExit):
        load_config(PrefixConfig, "prefix", ["--help"])
    out = capsys.readouterr().out
    assert "default 16" in out and "--verify-hashes {true,false}" in out
    assert "TIERCACHE_PREFIX_INTERNAL_TOKEN; default none" in out
    with pytest.raises(ConfigError, match=r"^--prune-to \(env TIERCACHE_PREFIX_PRUNE_TO\): "):
        load_config(PrefixConfig, "prefix", ["--prune-to", "1"])
    with pytest.raises(ConfigError, match=r"^TIERCACHE_PREFIX_PRUNE_TO: "):
        load_config(PrefixConfig, "prefix", [], environ={"TIERCACHE_PREFIX_PRUNE_TO": "1"})


def test_text_settings_lose_surrounding_whitespace():
    """Validation stripped addresses but the values went out as given: a replica advertising
    " 127.0.0.1:50054" was refused by the prefix index at every Register (prefix routing off
    for it, for good), and a blank prefix address crashed the replica after its model loaded."""
    from services.kvpool.config import KvPoolConfig

    cfg = load_config(KvPoolConfig, "kvpool", [], environ={
        "TIERCACHE_KVPOOL_ADDRESS": " 127.0.0.1:50054", "TIERCACHE_KVPOOL_PREFIX_ADDRESS": " ",
        "TIERCACHE_KVPOOL_ADVERTISE_ADDRESS": "kvpool-0.kvpool:50054\n"})
    assert cfg.address == "127.0.0.1:50054" and cfg.prefix_address == ""
    assert cfg.public_address == "kvpool-0.kvpool:50054"


def test_a_cache_dir_under_home_is_expanded_by_every_service(monkeypatch, tmp_path):
    """The model store expanded "~" in TIERCACHE_CACHE_DIR, semantic did not: its database
    and ONNX export went to a folder named "~" under the working directory."""
    from services.common.model_store import cache_dir_default
    from services.semantic.config import SemanticConfig, default_cache_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("TIERCACHE_CACHE_DIR", "~/tc")
    assert default_cache_dir() == str(cache_dir_default()) == str(tmp_path / "tc")
    assert SemanticConfig().resolved_db_path() == str(tmp_path / "tc" / "semantic" / "semantic.db")
    assert SemanticConfig(cache_dir="~/x", db_path="~/y.db").resolved_cache_dir() == str(
        tmp_path / "x")
    assert SemanticConfig(db_path="~/y.db").resolved_db_path() == str(tmp_path / "y.db")


def test_the_semantic_model_dir_under_home_is_expanded(monkeypatch, tmp_path):
    """TIERCACHE_SEMANTIC_MODEL_DIR kept a literal "~" (kvpool and the orchestrator expand
    their model settings): the config refused the folder as not a sentence-transformers one."""
    from services.common.config import load_config
    from services.semantic.config import SemanticConfig, default_model_dir

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "minilm").symlink_to(default_model_dir())
    cfg = load_config(SemanticConfig, "semantic", [],
                      {"TIERCACHE_SEMANTIC_MODEL_DIR": "~/minilm"})
    assert cfg.resolved_model_dir() == str(tmp_path / "minilm")
    assert cfg.resolved_model_name() == "all-MiniLM-L6-v2"  # the packaged model, by realpath
