"""ONNX embedder: equal to sentence-transformers, micro-batching, concurrency-safe export."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from services.common.files import file_digest
from services.semantic.config import SemanticConfig
from services.semantic.embedder import BatchingEmbedder
from tests.procs import communicate_all

TEXTS = [
    "Flights from New York to Florida",
    "hi",
    "What is the best way to learn Python programming quickly and well, in your opinion?",
    "一个女人在弹吉他。",
    "Émigrés café naïve — résumé?",
    " ".join(["long"] * 400),  # truncated at max_seq_length
]


def test_onnx_matches_sentence_transformers(onnx_embedder):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(SemanticConfig().resolved_model_dir(), device="cpu")
    ref = st.encode(TEXTS, convert_to_numpy=True)
    ref = ref / np.linalg.norm(ref, axis=1, keepdims=True)
    batched = onnx_embedder.embed(TEXTS)  # padded batch
    single = np.stack([onnx_embedder.embed([t])[0] for t in TEXTS])
    assert batched.shape == (len(TEXTS), 384) and batched.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    assert (batched * ref).sum(1).min() >= 0.9999
    assert (single * ref).sum(1).min() >= 0.9999


def test_onnx_spinning_is_configurable_and_changes_no_vector(onnx_embedder):
    """TIERCACHE_SEMANTIC_ONNX_SPINNING=false reaches ONNX Runtime's session (its threads
    sleep between embeddings), and the vectors are the same."""
    from services.common.config import load_config
    from services.semantic.server import make_embedder

    def spins(emb) -> str:
        return emb._sess.get_session_options().get_session_config_entry(
            "session.intra_op.allow_spinning")

    assert spins(onnx_embedder) == "1"  # the default
    cfg = load_config(SemanticConfig, "semantic", [],
                      {"TIERCACHE_SEMANTIC_ONNX_SPINNING": "false"})
    assert cfg.onnx_spinning is False
    batching = make_embedder(cfg)
    try:
        assert spins(batching.inner) == "0"
        np.testing.assert_allclose(batching.embed(TEXTS), onnx_embedder.embed(TEXTS),
                                   rtol=0, atol=1e-6)
    finally:
        batching.close()


def test_the_dynamo_exporter_gives_the_traced_vectors_in_its_own_folder(tmp_path,
                                                                       onnx_embedder):
    """TIERCACHE_SEMANTIC_ONNX_EXPORTER=dynamo exports with torch.export (for a torch without
    the legacy tracer) into a folder of its own, beside the traced export, and embeds as the
    traced graph does: stored entries keep their vectors and their model tag."""
    from services.common.config import load_config
    from services.semantic.onnx_export import export_folder
    from services.semantic.server import make_embedder

    env = {"TIERCACHE_SEMANTIC_ONNX_EXPORTER": "dynamo", "TIERCACHE_SEMANTIC_CACHE_DIR":
           str(tmp_path)}
    cfg = load_config(SemanticConfig, "semantic", [], env)
    batching = make_embedder(cfg)
    try:
        name = cfg.resolved_model_name()
        folder = export_folder(tmp_path, name, "dynamo")
        assert folder.name == f"{name}.dynamo" and (folder / "model.onnx").is_file()
        assert not (tmp_path / "onnx" / name).exists()
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["exporter"] == "dynamo"
        assert batching.inner._output != "embedding"  # its output has another name
        assert batching.identity == onnx_embedder.identity
        dyn, traced = batching.embed(TEXTS), onnx_embedder.embed(TEXTS)  # a padded batch
        assert (dyn * traced).sum(1).min() >= 0.99999
        np.testing.assert_allclose(dyn, traced, rtol=0, atol=1e-5)
        one = batching.embed_one(TEXTS[0])
        np.testing.assert_allclose(one, traced[0], rtol=0, atol=1e-5)
    finally:
        batching.close()


def test_a_failing_torchscript_export_names_the_dynamo_exporter(tmp_path, monkeypatch):
    """A torch release without the legacy tracer fails the default export at first start: the
    error says which setting gets past it, and no export folder is left behind."""
    import torch

    from services.semantic.config import default_model_dir
    from services.semantic.onnx_export import ensure_onnx

    def gone(*args, **kwargs):
        assert kwargs["dynamo"] is False
        raise TypeError("export() got an unexpected keyword argument 'dynamic_axes'")

    monkeypatch.setattr(torch.onnx, "export", gone)
    with pytest.raises(RuntimeError, match="TIERCACHE_SEMANTIC_ONNX_EXPORTER=dynamo"):
        ensure_onnx(default_model_dir(), tmp_path, "mini")
    assert [p.name for p in (tmp_path / "onnx").iterdir()] == [".mini.lock"]


def test_an_unknown_exporter_is_refused_before_anything_is_written(tmp_path):
    from services.semantic.config import default_model_dir
    from services.semantic.onnx_export import SentenceModelSpec, ensure_onnx

    with pytest.raises(ValueError, match="unknown ONNX exporter 'jit'"):
        ensure_onnx(default_model_dir(), tmp_path, "mini", exporter="jit")
    assert list(tmp_path.iterdir()) == []
    spec = SentenceModelSpec.read(default_model_dir())
    assert spec.fingerprint("dynamo") != spec.fingerprint("torchscript") == spec.fingerprint()


def test_batching_embedder_returns_each_callers_vector(onnx_embedder):
    b = BatchingEmbedder(onnx_embedder, max_batch=8)
    try:
        texts = [f"question number {i} about cooking pasta" for i in range(40)]
        with ThreadPoolExecutor(12) as pool:
            got = np.stack(list(pool.map(b.embed_one, texts)))
        want = onnx_embedder.embed(texts)
        assert (got * want).sum(1).min() >= 0.9999
        assert b.batched_texts == 40 and b.batches < 40
    finally:
        b.close()


@pytest.mark.e2e
def test_concurrent_first_export_is_done_once_and_atomically(tmp_path):
    """Two processes export into an empty cache dir at once: both get a complete model."""
    code = (
        "import sys, json\n"
        "from services.common.logs import setup_logging\n"
        "setup_logging('semantic')\n"  # as the service: the export's steps are log lines
        "from services.semantic.onnx_export import ensure_onnx\n"
        "from services.semantic.config import default_model_dir\n"
        "d = ensure_onnx(default_model_dir(), sys.argv[1], 'mini')\n"
        "print(json.dumps(str(d)))\n"
    )
    root = Path(__file__).resolve().parents[2]  # not the working directory pytest started in
    env = dict(os.environ, PYTHONPATH=str(root))
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, cwd=root,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = communicate_all(procs, timeout=300)
    assert all(p.returncode == 0 for p in procs), [e[-2000:] for _, e in outs]
    folders = {json.loads(o.strip().splitlines()[-1]) for o, _ in outs}
    assert folders == {str(tmp_path / "onnx" / "mini")}
    progress = [e for _, e in outs if "ONNX export of " in e and "4/4 steps done" in e]
    assert len(progress) == 1, "exactly one process exports (with progress output)"
    assert sorted(os.listdir(tmp_path / "onnx")) == [".mini.lock", "mini"]
    meta = json.loads((tmp_path / "onnx" / "mini" / "meta.json").read_text())
    assert meta["pooling"] == "mean" and meta["normalize"] and meta["dim"] == 384


def test_any_sentence_transformers_folder_works_through_config(tmp_path, make_cfg, clock):
    """A folder with CLS pooling and no Normalize module (a different recipe than MiniLM's)
    exports and matches sentence-transformers on that folder, in direction: its vectors (norm
    5-7 there) are made unit length, as the index's inner product needs. Unnormalised, every
    lookup hit at similarity 1.0, an unrelated question too."""
    from sentence_transformers import SentenceTransformer

    from services.semantic.embedder import OnnxEmbedder

    src = SemanticConfig().resolved_model_dir()
    folder = tmp_path / "cls-model"
    (folder / "1_Pooling").mkdir(parents=True)
    for name in os.listdir(src):
        if os.path.isfile(os.path.join(src, name)) and name != "modules.json":
            os.symlink(os.path.join(src, name), folder / name)
    modules = json.loads(open(os.path.join(src, "modules.json")).read())[:2]
    (folder / "modules.json").write_text(json.dumps(modules))
    pooling = json.loads(open(os.path.join(src, "1_Pooling", "config.json")).read())
    pooling.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))

    emb = OnnxEmbedder(str(folder), str(tmp_path / "cache"), "cls-model")
    got = emb.embed(TEXTS[:4])
    ref = SentenceTransformer(str(folder), device="cpu").encode(TEXTS[:4])
    assert np.linalg.norm(ref, axis=1).min() > 1.5, "no normalisation in this recipe"
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, rtol=1e-5)
    cos = (got * ref).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(ref, axis=1)
    assert cos.min() >= 0.9999
    # Through the cache: an unrelated question misses, the stored one hits.
    from services.semantic.cache import Namespace, SemanticCache
    from services.semantic.embedder import BatchingEmbedder
    from services.semantic.store import EntryStore

    cfg = make_cfg()
    batching = BatchingEmbedder(emb)
    cache = SemanticCache(cfg, batching, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        ns = Namespace("t", "m", "")
        cache.store_entry(ns, "How do I cook pasta?", "Boil water, add pasta.")
        assert cache.lookup(ns, "How do I cook pasta?").hit
        near = cache.lookup(ns, "How do I cook pasta? ")  # by its vector, not its text
        assert near.hit and not near.exact
        r = cache.lookup(ns, "What is the capital of France?", tier="relaxed")
        assert not r.hit and r.similarity < 0.9
        # The committed verifier was fitted on MiniLM's similarities: off for this model
        # (its tiers keep the guard).
        assert cache.verifier is None
    finally:
        cache.close_indexes()
        cache.store.close()
        batching.close()


def test_config_errors_name_the_variable(tmp_path):
    from services.common.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="TIERCACHE_SEMANTIC_TIER_STRICT"):
        load_config(SemanticConfig, "semantic", [], {"TIERCACHE_SEMANTIC_TIER_STRICT": "0.5"})
    with pytest.raises(ConfigError, match="TIERCACHE_SEMANTIC_MODEL_DIR"):
        load_config(SemanticConfig, "semantic", [],
                    {"TIERCACHE_SEMANTIC_MODEL_DIR": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="GUARD_TIERS"):
        load_config(SemanticConfig, "semantic", ["--guard-tiers", "strict,bogus"], {})
    # ttl_seconds is a uint32 on the wire: a larger TTL stored fine, then every hit failed.
    with pytest.raises(ConfigError, match="TIERCACHE_SEMANTIC_MAX_TTL_SECONDS"):
        load_config(SemanticConfig, "semantic", [],
                    {"TIERCACHE_SEMANTIC_DEFAULT_TTL_SECONDS": str(2**32),
                     "TIERCACHE_SEMANTIC_MAX_TTL_SECONDS": str(2**32)})
    # A cap of 0 made every TTL 0 ("never expires") at load: expired entries came back.
    with pytest.raises(ConfigError, match="TIERCACHE_SEMANTIC_MAX_TTL_SECONDS.*>= 1"):
        load_config(SemanticConfig, "semantic", [],
                    {"TIERCACHE_SEMANTIC_DEFAULT_TTL_SECONDS": "0",
                     "TIERCACHE_SEMANTIC_MAX_TTL_SECONDS": "0"})
    with pytest.raises(ConfigError, match="TIERCACHE_SEMANTIC_ONNX_EXPORTER.*'onnx'"):
        load_config(SemanticConfig, "semantic", [], {"TIERCACHE_SEMANTIC_ONNX_EXPORTER": "onnx"})


@pytest.mark.parametrize("name, content", [("sentence_bert_config.json", "not json"),
                                           ("modules.json", '[{"type": "x.Pooling"}]'),
                                           ("config.json", "[1, 2]")])
def test_a_malformed_model_file_is_named_with_its_folder_and_setting(tmp_path, name, content):
    """"bad configuration: JSONDecodeError: Expecting value: line 1 column 1 (char 0)" named
    neither the file's folder nor the setting; a pooling module without a path was a KeyError
    traceback."""
    import shutil

    from services.semantic.config import default_model_dir
    from services.semantic.onnx_export import SentenceModelSpec

    folder = tmp_path / "model"
    shutil.copytree(default_model_dir(), folder)
    (folder / name).write_text(content)
    with pytest.raises(ValueError, match="TIERCACHE_SEMANTIC_MODEL_DIR") as e:
        SentenceModelSpec.read(folder)
    assert str(folder) in str(e.value)


def test_the_export_fingerprint_follows_the_weights_content(tmp_path):
    """A fine-tuned checkpoint has the same size as the original: the fingerprint must still
    change, or the old export (and old stored vectors) would keep being used."""

    from services.semantic.onnx_export import SentenceModelSpec

    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(bytes(range(256)) * 4)
    spec = SentenceModelSpec(Path(tmp_path), 16, "mean", True, 4)
    before = spec.fingerprint()
    vectors = spec.weights_fingerprint()
    # Documentation changes neither: a new README re-embedded every stored entry at start
    # (most of an hour at the 200,000-entry cap).
    (tmp_path / "README.md").write_text("# a new release of the model card")
    (tmp_path / ".gitattributes").write_text("*.bin filter=lfs")
    assert (spec.fingerprint(), spec.weights_fingerprint()) == (before, vectors)
    data = bytearray(weights.read_bytes())
    data[100] ^= 0xFF  # same size, other weights
    weights.write_bytes(bytes(data))
    assert spec.fingerprint() != before and spec.weights_fingerprint() != vectors


def test_an_export_cut_short_is_exported_again(tmp_path):
    """After a power loss the export folder could keep its meta.json and an empty
    model.onnx: no start would export it again, and every start failed to load it."""
    from services.semantic.config import default_model_dir
    from services.semantic.onnx_export import ensure_onnx

    d = ensure_onnx(default_model_dir(), tmp_path, "mini")
    whole = (d / "model.onnx").stat().st_size
    (d / "model.onnx").write_bytes(b"")
    again = ensure_onnx(default_model_dir(), tmp_path, "mini")
    assert (again / "model.onnx").stat().st_size == whole


def test_exceeds_window_agrees_with_the_tokenizer(onnx_embedder):
    """The byte-count shortcut never calls a text short that the model would cut."""
    import random

    rng = random.Random(7)
    pieces = ["a", "é", "中", "😀", " ", "word ", "x.", "!!", "1 "]
    seen = set()
    for _ in range(600):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 400)))
        cut = bool(onnx_embedder._tok.encode(text).overflowing)
        assert onnx_embedder.exceeds_window(text) == cut, text
        seen.add(cut)
    assert seen == {True, False}


def test_unseen_skips_tokenising_plain_ascii_and_agrees_with_the_tokenizer(onnx_embedder,
                                                                          monkeypatch):
    """Every lookup whose candidate would hit asks what the model cannot read: tokenising
    each question cost ~0.4 ms of search time at 100k entries. MiniLM reads every printable
    ASCII character, so a plain ASCII text has nothing unseen."""
    # A word of 120 letters is one [UNK] to WordPiece (past max_input_chars_per_word): two
    # questions differing only there embedded alike, and were served each other's answer.
    texts = ["What is 2+2?", "a\tb\nc  d", "ctl\x00here", "del\x7f", "Is 🐍 a pet?",
             "Zürich café", "hello\u200bworld", "~!@#$%^&*()_+{}|:<>?`-=[]\\;',./",
             "Decode this string please: " + "QWERTYUIOP" * 12]
    assert onnx_embedder._reads_ascii
    for t in texts:
        assert onnx_embedder.unseen(t) == onnx_embedder.unseen_slow(t), repr(t)
    assert onnx_embedder.unseen("Decode it: " + "ab" * 60) != onnx_embedder.unseen(
        "Decode it: " + "ba" * 60)
    monkeypatch.setattr(onnx_embedder, "unseen_slow", lambda t: (_ for _ in ()).throw(
        AssertionError(f"tokenised {t!r}")))
    assert onnx_embedder.unseen("How do I reset my router?") == ""


def test_folders_of_exports_killed_part_way_are_removed_at_the_next_export(tmp_path,
                                                                           monkeypatch):
    """SIGKILL, an OOM kill or SIGTERM while starting left `.{name}.XXXXXXXX` (and
    `.{name}.old.XXXXXXXX`) behind for good: tens of MB at each interrupted start."""
    from services.semantic import onnx_export

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    (model / "tokenizer.json").write_text("{}")
    root = tmp_path / "cache" / "onnx"
    for leftover in (".m.abcd1234", ".m.old.x_y9zz00"):
        (root / leftover).mkdir(parents=True)
        (root / leftover / "model.onnx").write_bytes(b"\0" * 1024)
    (root / ".m.lock").write_text("")
    (root / ".other.abcd1234").mkdir()  # another model's: its own lock guards it
    (root / ".m.notmine").mkdir()  # not a name mkdtemp gives

    def fake_export(spec, out: Path, exporter: str) -> None:
        (out / "model.onnx").write_bytes(b"x")
        (out / "tokenizer.json").write_text("{}")
        (out / "meta.json").write_text(json.dumps({"fingerprint": spec.fingerprint(),
                                                   "model_bytes": 1}))

    monkeypatch.setattr(onnx_export, "_export", fake_export)
    assert onnx_export.ensure_onnx(model, tmp_path / "cache", "m") == root / "m"
    assert sorted(os.listdir(root)) == [".m.lock", ".m.notmine", ".other.abcd1234", "m"]


def _copying_export(real: Path, exports: list[bool], then: Callable[[Path], None]):
    """A stand-in for `onnx_export._export`: the real export `real` copied (without its ~10 s),
    the call noted in `exports`, then `then(out)` on the copy."""
    import shutil

    def copy_export(spec, out: Path, exporter: str) -> None:
        exports.append(True)
        for f in real.iterdir():
            shutil.copy2(f, out / f.name)
        then(out)
        meta = json.loads((out / "meta.json").read_text())
        if "model_blake2b" in meta:  # as the export records it: of what it wrote
            meta["model_blake2b"] = file_digest(out / "model.onnx")
            (out / "meta.json").write_text(json.dumps(meta))

    return copy_export


def test_an_export_damaged_but_of_its_size_is_exported_again_once(tmp_path, monkeypatch,
                                                                  onnx_embedder):
    """A cached model.onnx damaged in place (its size kept, so meta.json's check passed) made
    every start exit on onnxruntime's InvalidProtobuf. It is now removed and exported again,
    once: an export that fails to load as well is not retried."""
    import shutil

    from services.semantic import onnx_export
    from services.semantic.config import default_cache_dir
    from services.semantic.embedder import OnnxEmbedder

    cfg = SemanticConfig()
    name = cfg.resolved_model_name()
    real = onnx_export.ensure_onnx(cfg.resolved_model_dir(), default_cache_dir(), name)
    cached = tmp_path / "onnx" / name
    shutil.copytree(real, cached)
    # Made from this checkout's model folder: the shared cache's export may come from another
    # checkout (another path), and a damaged export of another folder is not ours to replace.
    meta = json.loads((cached / "meta.json").read_text())
    meta["source"] = os.path.realpath(cfg.resolved_model_dir())
    (cached / "meta.json").write_text(json.dumps(meta))

    def damage(folder: Path) -> None:
        with open(folder / "model.onnx", "r+b") as f:
            f.write(np.random.default_rng(0).bytes(4096))

    damage(cached)
    exports: list[bool] = []
    damaged_export = [False]

    monkeypatch.setattr(onnx_export, "_export", _copying_export(
        real, exports, lambda out: damage(out) if damaged_export[0] else None))
    emb = OnnxEmbedder(cfg.resolved_model_dir(), str(tmp_path), name)
    assert exports == [True]
    assert (cached / "model.onnx").read_bytes() == (real / "model.onnx").read_bytes()
    np.testing.assert_allclose(emb.embed(["hello there"]), onnx_embedder.embed(["hello there"]),
                               atol=1e-6)
    assert sorted(os.listdir(tmp_path / "onnx")) == [f".{name}.lock", name]

    damage(cached)
    damaged_export[0] = True
    with pytest.raises(Exception, match="(?i)protobuf"):
        OnnxEmbedder(cfg.resolved_model_dir(), str(tmp_path), name)
    assert exports == [True, True]  # once, not in a loop


def test_an_export_damaged_inside_its_weights_is_exported_again(tmp_path, monkeypatch,
                                                                onnx_embedder):
    """Bytes overwritten deep in model.onnx (its weights) loaded without a word, and every
    vector was NaN: every lookup a silent miss. meta.json now records the graph's digest."""
    import shutil

    from services.semantic import onnx_export
    from services.semantic.embedder import OnnxEmbedder

    cfg = SemanticConfig()
    name = cfg.resolved_model_name()
    real = tmp_path / "real"
    real.mkdir()
    onnx_export._export(onnx_export.SentenceModelSpec.read(cfg.resolved_model_dir()), real)
    assert json.loads((real / "meta.json").read_text())["model_blake2b"]
    cached = tmp_path / "cache" / "onnx" / name
    shutil.copytree(real, cached)
    size = (cached / "model.onnx").stat().st_size
    with open(cached / "model.onnx", "r+b") as f:
        f.seek(int(size * 0.9))
        f.write(np.random.default_rng(0).bytes(4096))
    exports: list[bool] = []
    monkeypatch.setattr(onnx_export, "_export", _copying_export(real, exports, lambda out: None))
    emb = OnnxEmbedder(cfg.resolved_model_dir(), str(tmp_path / "cache"), name)
    assert exports == [True]
    v = emb.embed(["hello there"])
    assert np.isfinite(v).all()
    np.testing.assert_allclose(v, onnx_embedder.embed(["hello there"]), atol=1e-6)


def test_a_full_cache_disk_during_the_export_is_an_oserror_naming_the_setting(tmp_path,
                                                                              monkeypatch):
    """The exporter's OSError (no space left) came out as a RuntimeError telling the user to
    switch exporters, and the service died with a traceback."""
    import errno

    import torch

    from services.semantic.config import default_model_dir
    from services.semantic.onnx_export import ensure_onnx

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch.onnx, "export", full)
    with pytest.raises(OSError, match="TIERCACHE_SEMANTIC_CACHE_DIR") as e:
        ensure_onnx(default_model_dir(), tmp_path, "mini")
    assert e.value.errno == errno.ENOSPC and "dynamo" not in str(e.value)
    assert [p.name for p in (tmp_path / "onnx").iterdir()] == [".mini.lock"]


def test_a_tokenizer_damaged_or_gone_is_exported_again_and_a_second_failure_is_one_line(
        tmp_path, monkeypatch):
    """A tokenizer.json of the export cut short, zeroed or deleted made every start exit with
    a traceback (the tokenizer's parse error), and nothing exported it again: meta.json
    checked only model.onnx's size. Its size and digest are now recorded and checked; an
    export from before that (no digests) is exported again once its tokenizer fails to
    load; a tokenizer that fails after a fresh export is a ValueError naming the file (the
    service's one-line "bad configuration", exit 2)."""
    import shutil

    from services.semantic import onnx_export
    from services.semantic.config import default_cache_dir
    from services.semantic.embedder import OnnxEmbedder

    cfg = SemanticConfig()
    name, model = cfg.resolved_model_name(), cfg.resolved_model_dir()
    real = onnx_export.ensure_onnx(model, default_cache_dir(), name)
    cached = tmp_path / "onnx" / name
    shutil.copytree(real, cached)
    # Made from this very model folder: the shared export may come from another checkout's
    # venv, and a damaged export of another folder is redone in a folder of its own beside it
    # (`_own_folder`), not over `cached`.
    source = os.path.realpath(model)
    meta = json.loads((cached / "meta.json").read_text())
    meta.pop("files", None)  # as exports made before the tokenizer was checked
    meta["source"] = source
    (cached / "meta.json").write_text(json.dumps(meta))
    tokenizer = (real / "tokenizer.json").read_bytes()
    exports: list[bool] = []
    broken_source = [False]

    def as_exported_now(out: Path) -> None:
        if broken_source[0]:
            (out / "tokenizer.json").write_bytes(tokenizer[:1000])
        m = json.loads((out / "meta.json").read_text())
        m["files"] = {"tokenizer.json": onnx_export._file_record(out / "tokenizer.json")}
        m["source"] = source
        (out / "meta.json").write_text(json.dumps(m))

    monkeypatch.setattr(onnx_export, "_export", _copying_export(real, exports, as_exported_now))
    (cached / "tokenizer.json").write_bytes(tokenizer[:1000])  # an older export, cut short
    emb = OnnxEmbedder(model, str(tmp_path), name)
    assert exports == [True] and emb.embed(["hello there"]).shape == (1, emb.dim)
    assert (cached / "tokenizer.json").read_bytes() == tokenizer
    OnnxEmbedder(model, str(tmp_path), name)
    assert exports == [True]  # loaded as it is: no export at every start

    # The export now records the tokenizer: one zeroed at its size is exported again before
    # anything loads it, one deleted as well.
    (cached / "tokenizer.json").write_bytes(b"\0" * len(tokenizer))
    OnnxEmbedder(model, str(tmp_path), name)
    assert exports == [True, True] and (cached / "tokenizer.json").read_bytes() == tokenizer
    (cached / "tokenizer.json").unlink()
    OnnxEmbedder(model, str(tmp_path), name)
    assert exports == [True, True, True]

    # A fresh export fails as well (the model folder's own tokenizer): one line naming the
    # file, exported once, not in a loop.
    broken_source[0] = True
    (cached / "tokenizer.json").write_bytes(tokenizer[:1000])
    meta = json.loads((cached / "meta.json").read_text())
    meta.pop("files")
    (cached / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"tokenizer\.json cannot be loaded even when exported "
                                         r"again \(Exception: EOF") as err:
        OnnxEmbedder(model, str(tmp_path), name)
    assert str(cached / "tokenizer.json") in str(err.value) and "\n" not in str(err.value)
    assert exports == [True, True, True, True]


def test_two_model_folders_of_one_name_keep_their_own_exports(tmp_path, monkeypatch):
    """/a/model and /b/model are both named "model": they shared one export folder, and each
    start of either exported again over the other's (tens of seconds, and a process could
    load the other model's graph while it was swapped in)."""
    from services.semantic import onnx_export

    exports: list[str] = []

    def fake_export(spec, out: Path, exporter: str) -> None:
        exports.append(str(spec.model_dir))
        (out / "model.onnx").write_bytes(b"x")
        (out / "tokenizer.json").write_text("{}")
        (out / "meta.json").write_text(json.dumps({
            "fingerprint": spec.fingerprint(exporter), "model_bytes": 1,
            "source": os.path.realpath(spec.model_dir)}))

    monkeypatch.setattr(onnx_export, "_export", fake_export)
    folders = []
    for side, hidden in (("a", 8), ("b", 16)):
        model = tmp_path / side / "model"
        model.mkdir(parents=True)
        (model / "config.json").write_text(json.dumps({"hidden_size": hidden}))
        (model / "tokenizer.json").write_text("{}")
        folders.append(model)
    got = [onnx_export.ensure_onnx(m, tmp_path / "cache", "model") for m in folders * 3]
    assert len(exports) == 2  # once each, not at every start
    assert got[0] == tmp_path / "cache" / "onnx" / "model"  # the first keeps the plain name
    assert got[1] != got[0] and set(got) == {got[0], got[1]}
    for m, d in zip(folders, got[:2], strict=True):
        assert json.loads((d / "meta.json").read_text())["source"] == str(m)
    # The same model at a new path (a new venv or checkout) uses the export it has, wherever
    # that was made from: no export again, no folder more.
    moved = tmp_path / "c" / "model"
    moved.parent.mkdir()
    import shutil

    shutil.copytree(folders[0], moved)
    assert onnx_export.ensure_onnx(moved, tmp_path / "cache", "model") == got[0]
    assert len(exports) == 2
    assert sorted(os.listdir(tmp_path / "cache" / "onnx")) == sorted(
        [".model.lock", f".{got[1].name}.lock", "model", got[1].name])


class _SlowInner:
    """What BatchingEmbedder needs of an OnnxEmbedder; each batch blocks until released."""

    name = identity = "slow@test"
    dim = 4

    def __init__(self) -> None:
        import threading

        self.release = threading.Event()
        self.embedded: list[str] = []

    def exceeds_window(self, text: str) -> bool:
        return False

    def unseen(self, text: str) -> str:
        return ""

    def embed_checked(self, texts):
        self.release.wait(10)
        self.embedded += texts
        v = np.ones((len(texts), 4), np.float32) / 2.0
        return v, [False] * len(texts)


def test_the_batcher_drops_texts_of_callers_gone_before_their_batch_runs(make_cfg, clock):
    """Lookup never asked whether its caller still waited: under overload the batcher embedded
    texts of callers long past their deadline, counted them, touched the entries they hit,
    and live lookups queued behind that work (4 ms became 1 s)."""
    import threading

    from services.common.errors import DeadlineExceeded
    from services.semantic.cache import Namespace, SemanticCache
    from services.semantic.store import EntryStore

    inner = _SlowInner()
    b = BatchingEmbedder(inner, max_batch=8)
    try:
        inner.release.clear()
        first = threading.Thread(target=b.embed_one, args=("occupies the batcher",))
        first.start()
        time.sleep(0.2)  # that batch is running: the next ones queue
        alive = {"x": True}
        out: dict[str, object] = {}

        def call(text: str, wanted) -> None:
            try:
                out[text] = b.embed_one_checked(text, wanted=wanted)
            except DeadlineExceeded as e:
                out[text] = e

        threads = [threading.Thread(target=call, args=(f"gone {i}", lambda: False))
                   for i in range(5)]
        threads.append(threading.Thread(target=call, args=("live", lambda: alive["x"])))
        for t in threads:
            t.start()
        time.sleep(0.2)
        inner.release.set()
        for t in [first, *threads]:
            t.join(10)
        assert inner.embedded == ["occupies the batcher", "live"]
        assert all(isinstance(out[f"gone {i}"], DeadlineExceeded) for i in range(5))
        assert b.dropped_texts == 5 and b.batched_texts == 2
    finally:
        inner.release.set()
        b.close()
    # Through the cache: a caller gone is not counted and touches no entry.
    cfg = make_cfg(guard_tiers=(), verifier_tiers=())
    b = BatchingEmbedder(inner, max_batch=8)
    cache = SemanticCache(cfg, b, EntryStore(cfg.resolved_db_path(), "NORMAL"), clock)
    try:
        ns = Namespace("t", "m", "")
        e = cache.store_entry(ns, "a question", "an answer")
        before = cache.stats()
        with pytest.raises(DeadlineExceeded):
            cache.lookup(ns, "another question", wanted=lambda: False)
        with pytest.raises(DeadlineExceeded):
            cache.lookup(ns, "a question", wanted=lambda: False)  # the exact repeat too
        after = cache.stats()
        assert after.lookups_total == before.lookups_total
        assert cache._entries[e.label].hit_count == 0
        assert cache.lookup(ns, "another question", wanted=lambda: True).hit
    finally:
        cache.close_indexes()
        cache.store.close()
        b.close()


def test_a_decomposed_accent_is_read_as_its_letter_wherever_it_sits(onnx_embedder):
    """MiniLM's normalizer strips accents; a combining accent ending a word ("cafe" + U+0301,
    as macOS and iOS type it) fell outside its token's offsets and counted as unread, so
    "café" written decomposed was refused its own entry (at cosine 1.0) while "cafe" hit."""
    import unicodedata as ud

    nfc = "Where can I find a good café in Zürich?"
    nfd = ud.normalize("NFD", nfc)
    assert nfd != nfc
    assert onnx_embedder.unseen(nfc) == onnx_embedder.unseen(nfd) == ""
    assert onnx_embedder.unseen("cafe\u0301s") == onnx_embedder.unseen("cafe\u0301") == ""
    # A mark on nothing the model reads is still unread.
    assert onnx_embedder.unseen("\U0001f600\u0301") == "\U0001f600\u0301"
    assert onnx_embedder.unseen("x \u0301 y") == "\u0301"
