"""Rules of `services/semantic/onnx_export.py` a mutation audit found unchecked: the graph's
own output (pooling and normalisation inside, padding applied), an export reused rather than
redone, its files on disk before the rename, the modules and poolings refused, what the
fingerprint follows and ignores, an older export cut short, another model's temporary folder,
and another model's export found at our folder while waiting for its lock.

No test here exports the model again: the graph checks read the session's export (the
`onnx_embedder` fixture's), the others stand in for torch's exporter or for `_export`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from services.semantic import onnx_export
from services.semantic.config import SemanticConfig, default_cache_dir, default_model_dir
from services.semantic.onnx_export import SentenceModelSpec, ensure_onnx

TEXTS = ["Flights from New York to Florida", "hi", "Émigrés café naïve — résumé?",
         "What is the best way to learn Python programming quickly and well?"]


def _session_export() -> Path:
    """The session's export folder, found (not made) by ensure_onnx."""
    cfg = SemanticConfig()
    return ensure_onnx(cfg.resolved_model_dir(), default_cache_dir(), cfg.resolved_model_name())


def test_an_export_in_place_is_reused_not_redone(onnx_embedder):
    """The export runs once per model folder: a later call finds it whole (its recorded
    size, digest and tokenizer agree) and exports nothing."""
    before = onnx_export.exports_done
    folder = _session_export()
    again = _session_export()
    assert folder == again and onnx_export.exports_done == before
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["model_bytes"] == (folder / "model.onnx").stat().st_size


def test_the_graph_itself_pools_normalises_and_applies_the_padding(onnx_embedder):
    """The graph's one output equals sentence-transformers' (MiniLM's folder has a Normalize
    module: unit vectors straight from the graph), for a padded batch row by row as for each
    text alone."""
    import onnxruntime as ort
    from sentence_transformers import SentenceTransformer
    from tokenizers import Tokenizer

    folder = _session_export()
    meta = json.loads((folder / "meta.json").read_text())
    sess = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.enable_truncation(meta["max_seq_length"])
    tok.enable_padding()

    def run(texts: list[str]) -> np.ndarray:
        enc = tok.encode_batch(texts)
        feed = {"input_ids": np.array([e.ids for e in enc], np.int64),
                "attention_mask": np.array([e.attention_mask for e in enc], np.int64),
                "token_type_ids": np.array([e.type_ids for e in enc], np.int64)}
        return sess.run(None, {n: feed[n] for n in meta["inputs"]})[0]

    batched = run(TEXTS)
    single = np.concatenate([run([t]) for t in TEXTS])
    ref = SentenceTransformer(SemanticConfig().resolved_model_dir(), device="cpu").encode(TEXTS)
    np.testing.assert_allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(batched, ref, atol=2e-5)
    np.testing.assert_allclose(single, ref, atol=2e-5)


def test_the_exports_files_are_on_disk_before_the_rename_and_the_rename_after(
        tmp_path, monkeypatch):
    """model.onnx, tokenizer.json and meta.json are fsynced in the temporary folder before it
    is renamed into place, and the cache folder after: a power loss must not leave a renamed
    folder with an empty model.onnx that no later start exports again."""
    import torch

    def small_export(module, args, path, **kwargs) -> None:  # torch's exporter, stood in for
        Path(path).write_bytes(b"not a real graph")

    monkeypatch.setattr(torch.onnx, "export", small_export)
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:
        real_rename(src, dst)
        events.append(("rename", str(dst)))

    monkeypatch.setattr(onnx_export.os, "fsync", fsync)
    monkeypatch.setattr(onnx_export.os, "rename", rename)
    folder = ensure_onnx(default_model_dir(), tmp_path, "mini")
    renamed = events.index(("rename", str(folder)))
    synced = {Path(p).name for kind, p in events[:renamed]
              if kind == "fsync" and Path(p).parent.name.startswith(".mini.")}
    assert synced == {"model.onnx", "tokenizer.json", "meta.json"}
    assert ("fsync", str(tmp_path / "onnx")) in events[renamed:]


def _folder_like_minilm(tmp_path: Path, modules: list[dict], pooling: dict | None = None,
                        name: str = "model") -> Path:
    """MiniLM's files (linked) with another modules.json (and pooling config)."""
    src = default_model_dir()
    folder = tmp_path / name
    (folder / "1_Pooling").mkdir(parents=True)
    for f in os.listdir(src):
        if os.path.isfile(os.path.join(src, f)) and f != "modules.json":
            os.symlink(os.path.join(src, f), folder / f)
    (folder / "modules.json").write_text(json.dumps(modules))
    cfg = json.loads(open(os.path.join(src, "1_Pooling", "config.json")).read())
    cfg.update(pooling or {})
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(cfg))
    return folder


def _modules() -> list[dict]:
    return json.loads(open(os.path.join(default_model_dir(), "modules.json")).read())


def test_a_dense_module_is_refused_naming_it(tmp_path):
    """Folders with other modules (Dense, as in LaBSE) are refused at start, naming the
    module: their graph would not give sentence-transformers' vectors."""
    dense = {"idx": 3, "name": "3", "path": "2_Dense",
             "type": "sentence_transformers.models.Dense"}
    folder = _folder_like_minilm(tmp_path, _modules() + [dense])
    with pytest.raises(ValueError, match="unsupported sentence-transformers module "
                                         "sentence_transformers.models.Dense"):
        SentenceModelSpec.read(folder)


def test_a_pooling_other_than_mean_or_cls_is_refused(tmp_path):
    folder = _folder_like_minilm(tmp_path, _modules(), {
        "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False,
        "pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="only mean or CLS pooling"):
        SentenceModelSpec.read(folder)


def test_the_weights_fingerprint_follows_pooling_normalisation_and_window(tmp_path):
    """What the vectors depend on besides the files: each change gives another fingerprint
    (stored vectors are then embedded again)."""
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    base = SentenceModelSpec(tmp_path, 128, "mean", True, 4)
    others = [SentenceModelSpec(tmp_path, 128, "cls", True, 4),
              SentenceModelSpec(tmp_path, 128, "mean", False, 4),
              SentenceModelSpec(tmp_path, 256, "mean", True, 4)]
    prints = {s.weights_fingerprint() for s in [base, *others]}
    assert len(prints) == 4
    assert len({s.fingerprint() for s in [base, *others]}) == 4


@pytest.mark.parametrize("name", ["config_sentence_transformers.json", "data_config.json",
                                  "LICENSE", "LICENCE.txt", "model_card.MD", "plot.png"])
def test_files_no_vector_depends_on_leave_the_fingerprint(tmp_path, name):
    """sentence-transformers' version record, the training data list, licences and pictures
    change no vector: a new one must not re-embed every stored entry."""
    (tmp_path / "config.json").write_text('{"hidden_size": 4}')
    (tmp_path / "model.safetensors").write_bytes(bytes(range(256)))
    spec = SentenceModelSpec(tmp_path, 16, "mean", True, 4)
    before = spec.weights_fingerprint()
    (tmp_path / name).write_text('{"__version__": {"sentence_transformers": "9.9.9"}}')
    assert spec.weights_fingerprint() == before


def _fake_exporter(exports: list[str], digest: bool = True):
    """A stand-in for `_export`: small files and a meta.json as the export writes it (without
    the model's digest, as an export from before it was recorded, when `digest` is off)."""
    from services.common.files import file_digest

    def fake_export(spec, out: Path, exporter: str) -> None:
        exports.append(str(spec.model_dir))
        (out / "model.onnx").write_bytes(b"x" * 64)
        (out / "tokenizer.json").write_text("{}")
        meta = {"fingerprint": spec.fingerprint(exporter), "model_bytes": 64,
                "source": os.path.realpath(spec.model_dir)}
        if digest:
            meta["model_blake2b"] = file_digest(out / "model.onnx")
        (out / "meta.json").write_text(json.dumps(meta))

    return fake_export


def _small_model(folder: Path, hidden: int = 8) -> Path:
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"hidden_size": hidden}))
    (folder / "tokenizer.json").write_text("{}")
    return folder


def test_an_older_export_cut_short_is_exported_again(tmp_path, monkeypatch):
    """An export from before digests were recorded is still checked by its size: a
    model.onnx cut short is exported again, one whole is kept."""
    exports: list[str] = []
    monkeypatch.setattr(onnx_export, "_export", _fake_exporter(exports, digest=False))
    model = _small_model(tmp_path / "model")
    folder = ensure_onnx(model, tmp_path / "cache", "m")
    assert ensure_onnx(model, tmp_path / "cache", "m") == folder and len(exports) == 1
    (folder / "model.onnx").write_bytes(b"x" * 10)
    assert ensure_onnx(model, tmp_path / "cache", "m") == folder and len(exports) == 2
    assert (folder / "model.onnx").stat().st_size == 64


def test_another_models_temporary_folder_is_not_taken_for_a_leftover(tmp_path, monkeypatch):
    """Only `.{name}.XXXXXXXX` (and `.{name}.old.XXXXXXXX`) are ours: the temporary folder of
    a model named "m.v2_large", which may be exporting under its own lock, stays."""
    exports: list[str] = []
    monkeypatch.setattr(onnx_export, "_export", _fake_exporter(exports))
    root = tmp_path / "cache" / "onnx"
    theirs = [".m.v2_large.k3j4h5g6", ".m.v2_large.old.k3j4h5g6"]
    for name in [".m.abcd1234", *theirs]:
        (root / name).mkdir(parents=True)
    ensure_onnx(_small_model(tmp_path / "model"), tmp_path / "cache", "m")
    assert sorted(os.listdir(root)) == sorted([".m.lock", "m", *theirs])


def test_another_models_export_found_after_the_lock_wait_is_left_to_it(tmp_path, monkeypatch):
    """Another model folder of the same name exported into our folder while we waited for
    its lock: that export is not replaced (its process may be loading it); ours goes to a
    folder of its own beside it."""
    import fcntl as real_fcntl

    exports: list[str] = []
    fake = _fake_exporter(exports)
    monkeypatch.setattr(onnx_export, "_export", fake)
    ours, other = _small_model(tmp_path / "a" / "model"), _small_model(tmp_path / "b" / "model",
                                                                       16)
    plain = tmp_path / "cache" / "onnx" / "model"

    class Fcntl:
        LOCK_EX = real_fcntl.LOCK_EX
        first = True

        def flock(self, f, op) -> None:
            if self.first:  # the other process's export lands while we wait
                self.first = False
                plain.mkdir()
                fake(SentenceModelSpec.read(other), plain, "torchscript")
            real_fcntl.flock(f, op)

    monkeypatch.setattr(onnx_export, "fcntl", Fcntl())
    got = ensure_onnx(ours, tmp_path / "cache", "model")
    assert got != plain and got.parent == plain.parent
    assert json.loads((got / "meta.json").read_text())["source"] == str(ours)
    assert json.loads((plain / "meta.json").read_text())["source"] == str(other)
    assert exports == [str(other), str(ours)]


def test_the_window_is_read_from_the_folders_sentence_bert_config(tmp_path):
    """max_seq_length from sentence_bert_config.json (MiniLM's says 256, as the default)."""
    folder = _small_model(tmp_path / "model", 8)
    (folder / "sentence_bert_config.json").write_text('{"max_seq_length": 128}')
    assert SentenceModelSpec.read(folder).max_seq_length == 128


def test_a_start_while_another_path_repairs_an_export_of_its_contents_waits_for_it(
        tmp_path, monkeypatch):
    """/a/model and /b/model hold the same files; the export at "model" was made from /a. A
    process repairing it (`broken=`) holds its lock and has renamed it aside when a start for
    /b looks: it read the folder's source (/a) and then found no current export, so it
    exported a second copy into a folder of its own (tens of seconds, a folder kept for good)
    instead of waiting for the repair. Found by test_onnx_export_differential."""
    import fcntl
    import shutil
    import tempfile
    import threading

    from services.common.files import remove_aside

    exports: list[str] = []
    fake = _fake_exporter(exports)
    monkeypatch.setattr(onnx_export, "_export", fake)
    a = _small_model(tmp_path / "a" / "model")
    b = tmp_path / "b" / "model"
    shutil.copytree(a, b)
    plain = ensure_onnx(a, tmp_path / "cache", "model")
    read_source, renamed = threading.Event(), threading.Event()

    def repair() -> None:  # another process, as its lock and files show it
        with open(plain.parent / ".model.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            read_source.wait(30)
            remove_aside(plain, ".model.old.")
            renamed.set()
            tmp = Path(tempfile.mkdtemp(prefix=".model.", dir=plain.parent))
            fake(SentenceModelSpec.read(a), tmp, "torchscript")
            os.rename(tmp, plain)

    real_source = onnx_export._source

    def source(d: Path):
        got = real_source(d)
        if d == plain and not read_source.is_set():
            read_source.set()
            assert renamed.wait(30)
        return got

    monkeypatch.setattr(onnx_export, "_source", source)
    other = threading.Thread(target=repair)
    other.start()
    got = ensure_onnx(b, tmp_path / "cache", "model")
    other.join(30)
    assert got == plain and exports == [str(a), str(a)]  # the first export and the repair
    assert sorted(os.listdir(plain.parent)) == [".model.lock", "model"]


def test_a_model_folder_without_its_files_names_the_setting(tmp_path: Path):
    """An empty folder as model_dir: the refusal names TIERCACHE_SEMANTIC_MODEL_DIR (it named
    only the path)."""
    with pytest.raises(ValueError, match=r"needs config.json and tokenizer.json .*"
                                         r"TIERCACHE_SEMANTIC_MODEL_DIR"):
        SentenceModelSpec.read(tmp_path)


def test_a_cache_folder_that_cannot_be_written_is_said_with_the_setting(tmp_path, monkeypatch):
    """A read-only cache folder: the export's refusal keeps its path, which the start's line
    says with the fix and the setting, not a bare "[Errno 1] Operation not permitted"
    (simulated: root writes past a folder's mode)."""
    from services.semantic.__main__ import not_writable

    model = _small_model(tmp_path / "model")

    def refused(self, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "mkdir", refused)
    with pytest.raises(PermissionError) as info:
        ensure_onnx(model, tmp_path / "cache", "m")
    line = not_writable(info.value)
    assert line.startswith(f"{info.value.filename} is not writable")
    assert str(tmp_path / "cache") in line and "TIERCACHE_SEMANTIC_CACHE_DIR" in line


def test_a_damaged_export_is_made_again_under_a_warning_naming_the_file(tmp_path, monkeypatch,
                                                                        caplog):
    """A cut-short, changed or missing file of a cached export was exported again under the
    first start's "exporting ... (once)" at INFO: the operator never learnt that the cache
    had been damaged, nor which file. Now one WARNING names it; a first export stays INFO."""
    exports: list[str] = []
    monkeypatch.setattr(onnx_export, "_export", _fake_exporter(exports))
    model = _small_model(tmp_path / "model")
    with caplog.at_level("INFO", logger="services.semantic.onnx_export"):
        folder = ensure_onnx(model, tmp_path / "cache", "m")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    damages = [
        (lambda: (folder / "model.onnx").write_bytes(b"x" * 10),
         "model.onnx is 10 bytes, 64 when exported"),
        (lambda: (folder / "model.onnx").write_bytes(b"y" * 64), "model.onnx changed"),
        (lambda: (folder / "meta.json").unlink(), "meta.json is missing"),
        (lambda: (folder / "meta.json").write_text("{"), "meta.json or a file it names"),
    ]
    for damage, said in damages:
        damage()
        caplog.clear()
        with caplog.at_level("WARNING", logger="services.semantic.onnx_export"):
            assert ensure_onnx(model, tmp_path / "cache", "m") == folder
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and said in warned[0] and str(folder) in warned[0], warned
    assert len(exports) == 1 + len(damages)
