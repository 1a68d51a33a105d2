"""Rules of the model store that no other test pinned: how the packaged model is named, what
a failed load of a cached conversion does, which end-of-answer ids count, when a cached
folder is whole, who may read a conversion, and the tokenizer and config fix-ups. Every
conversion here is the small fake one of `test_model_store` (no GGUF parsed)."""

from __future__ import annotations

import json
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from services.common import files, model_store
from services.common.model_store import resolve_model
from tests.kvpool.test_model_store import _fake_gguf


def test_the_packaged_spec_is_read_in_any_case_and_keeps_a_given_model_id(tmp_path: Path,
                                                                            monkeypatch):
    """" SmolLM2 " is the packaged model (as the launcher and the configs compare it), and a
    model_id given for it is the id it is served under."""
    loads = _fake_gguf(tmp_path, monkeypatch)
    got = resolve_model(" SmolLM2 ", cache_dir=str(tmp_path), model_id="served-as")
    assert got.path == str(tmp_path / "models" / model_store.SMOLLM2_MODEL_ID)
    assert got.model_id == "served-as" and loads == [1]


def test_a_memory_error_while_loading_a_conversion_is_not_converted_again(tmp_path: Path,
                                                                          monkeypatch):
    """Running out of memory is not the cache's fault: it propagates and nothing is redone."""
    loads = _fake_gguf(tmp_path, monkeypatch)

    def oom(path: str):
        raise MemoryError

    with pytest.raises(MemoryError):
        model_store.load_resolved("smollm2", str(tmp_path), None, oom)
    assert loads == [1]


def test_end_of_answer_ids_take_token_zero_but_no_booleans(tmp_path: Path):
    """An eos id of 0 is a token id like any other; JSON true/false are no ids (bool is an
    int in Python)."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, True]}))
    assert model_store.eos_token_ids(str(tmp_path)) == {0}
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": False}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert model_store.eos_token_ids(str(tmp_path)) == {7}


def test_a_file_grown_past_its_recorded_size_is_not_converted(tmp_path: Path, monkeypatch):
    """The marker's sizes are exact: weights longer than written (a bad restore appending,
    another file copied over) are converted again, as shorter ones are."""
    _fake_gguf(tmp_path, monkeypatch)
    path = Path(resolve_model("smollm2", cache_dir=str(tmp_path)).path)
    sid = model_store.source_id(model_store.packaged_gguf_path())
    with open(path / "model.safetensors", "ab") as f:
        f.write(b"w")
    assert not model_store.is_converted(path, sid)


def test_an_old_marker_over_weights_longer_than_their_header_says_is_not_converted(
        tmp_path: Path):
    """`_safetensors_whole` wants the file exactly as long as its header says: trailing bytes
    mean another file was written over it."""
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 8)
    (tmp_path / model_store._DONE_MARKER).write_text(json.dumps({"source_id": "s"}))
    assert model_store.is_converted(tmp_path, "s")
    with open(weights, "ab") as f:
        f.write(b"\0")
    assert not model_store.is_converted(tmp_path, "s")


def test_a_conversion_is_readable_by_every_user(tmp_path: Path, monkeypatch):
    """The image converts as root and the pods run as uid 10001: the folder is 0755 and each
    file 0644 (mkdtemp made 0700, save_pretrained 0600)."""
    _fake_gguf(tmp_path, monkeypatch)
    path = Path(resolve_model("smollm2", cache_dir=str(tmp_path)).path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in path.iterdir()}
    assert modes and set(modes.values()) == {0o644}, modes


def test_only_a_digits_first_gguf_gets_the_digit_split():
    """SmolLM2's pre-tokenizer type ("smollm") splits each digit off before the byte-level
    regex; another type (or none) keeps what transformers gave it."""
    from tokenizers import pre_tokenizers

    before = object()
    tok = SimpleNamespace(backend_tokenizer=SimpleNamespace(pre_tokenizer=before))
    for other in (None, "gpt2", "llama-bpe"):
        model_store._fix_pre_tokenizer(tok, other)
        assert tok.backend_tokenizer.pre_tokenizer is before
    model_store._fix_pre_tokenizer(tok, "smollm")
    split = tok.backend_tokenizer.pre_tokenizer
    assert isinstance(split, pre_tokenizers.Sequence)
    assert [w for w, _ in split.pre_tokenize_str("a12")] == ["a", "1", "2"]


def test_the_saved_config_loses_its_quantization_and_nothing_else(tmp_path: Path):
    """save_pretrained keeps the GGUF's quantization_config, which makes from_pretrained
    expect quantized weights: it is dropped; a config without one is left as written."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"b": 1, "quantization_config": {"q": 4}, "a": 2}))
    model_store._drop_quantization_from_saved_config(cfg)
    assert json.loads(cfg.read_text()) == {"a": 2, "b": 1}
    cfg.write_text('{"b": 1,   "a": 2}')
    model_store._drop_quantization_from_saved_config(cfg)
    assert cfg.read_text() == '{"b": 1,   "a": 2}'


def test_an_old_marker_over_a_folder_without_weights_is_not_converted(tmp_path: Path,
                                                                     monkeypatch):
    """An older marker (no sizes) is trusted once each safetensors file is as long as its
    header says: with the weights deleted there is no file to check, and the folder passed
    (vacuously) and was reused without its weights. Found by test_model_store_differential."""
    loads = _fake_gguf(tmp_path, monkeypatch)
    path = Path(resolve_model("smollm2", cache_dir=str(tmp_path)).path)
    marker = path / model_store._DONE_MARKER
    meta = json.loads(marker.read_text())
    del meta["files"], meta["digests"]  # as written before sizes were recorded
    marker.write_text(json.dumps(meta))
    sid = model_store.source_id(model_store.packaged_gguf_path())
    header = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    (path / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header
                                             + b"\0" * 8)  # whole, by its header
    assert model_store.is_converted(path, sid)
    (path / "model.safetensors").unlink()
    assert not model_store.is_converted(path, sid)
    resolve_model("smollm2", cache_dir=str(tmp_path))
    assert loads == [1, 1] and (path / "model.safetensors").is_file()


def test_a_cache_folder_that_cannot_be_written_is_an_oserror_naming_its_path(tmp_path: Path,
                                                                            monkeypatch):
    """A read-only cache folder stays an OSError with its path, which the services' entry
    points say as "cannot start: <path> is not writable" with the fix (`files.not_writable`;
    the refusal is simulated: root writes past a folder's mode)."""
    _fake_gguf(tmp_path, monkeypatch)

    def refused(self, *args, **kwargs):
        raise PermissionError(1, "Operation not permitted", str(self))

    monkeypatch.setattr(Path, "mkdir", refused)
    with pytest.raises(PermissionError) as e:
        resolve_model("smollm2", cache_dir=str(tmp_path / "ro"))
    assert e.value.filename.startswith(str(tmp_path / "ro"))
    why = files.not_writable(e.value, "the conversion", "TIERCACHE_KVPOOL_CACHE_DIR")
    assert why.startswith(f"{e.value.filename} is not writable") and "CACHE_DIR" in why


def test_a_cache_folder_that_is_a_file_names_the_settings(tmp_path: Path, monkeypatch):
    """TIERCACHE_CACHE_DIR naming a file: the same refusal, not "[Errno 20] Not a directory"."""
    _fake_gguf(tmp_path, monkeypatch)
    (tmp_path / "file").write_text("")
    with pytest.raises(model_store.ModelStoreError,
                       match=r"cache folder .*file cannot be written .*TIERCACHE_CACHE_DIR"):
        resolve_model("smollm2", cache_dir=str(tmp_path / "file"))


def test_a_damaged_conversion_is_converted_again_under_a_warning_naming_the_file(
        tmp_path: Path, monkeypatch, caplog):
    """A cut-short, missing or changed file of a cached conversion was converted again under
    the first start's "converting ... (once)" at INFO: the operator never learnt that the
    cache had been damaged, nor which file. Now one WARNING names the file and what is wrong;
    a first conversion (no folder yet) stays INFO."""
    loads = _fake_gguf(tmp_path, monkeypatch)
    with caplog.at_level("INFO", logger="services.common.model_store"):
        path = Path(resolve_model("smollm2", cache_dir=str(tmp_path)).path)
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    sid = model_store.source_id(model_store.packaged_gguf_path())
    assert model_store.conversion_problem(path, sid) == ""
    damages = [
        (lambda: (path / "model.safetensors").write_bytes(b""),
         "model.safetensors is 0 bytes, 4096 when converted"),
        (lambda: (path / "config.json").unlink(), "config.json is missing"),
        (lambda: (path / "tokenizer.json").write_bytes(b"x" * 10),
         "tokenizer.json changed since it was converted"),
        (lambda: (path / model_store._DONE_MARKER).unlink(), "no completion marker"),
        (lambda: (path / model_store._DONE_MARKER).write_text("{"), "cannot be read"),
    ]
    for damage, said in damages:
        damage()
        caplog.clear()
        with caplog.at_level("WARNING", logger="services.common.model_store"):
            resolve_model("smollm2", cache_dir=str(tmp_path))
        warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warned) == 1 and said in warned[0] and str(path) in warned[0], warned
        assert model_store.is_converted(path, sid)
    assert len(loads) == 1 + len(damages)


def test_a_conversion_damaged_again_between_load_and_repair_is_said_once(tmp_path: Path,
                                                                          monkeypatch, caplog):
    """A conversion that failed to load was said "cannot be loaded", and, if a file changed
    before the repair looked (a copy still running, a second damage), "cannot be used" too:
    two WARNINGs for one repair. The load's failure is said; the repair does not say it again
    (as `onnx_export.ensure_onnx(broken=...)`)."""
    loads = _fake_gguf(tmp_path, monkeypatch)
    path = Path(resolve_model("smollm2", cache_dir=str(tmp_path)).path)
    calls = []

    def load(p: str):
        calls.append(p)
        if len(calls) == 1:
            (path / "config.json").unlink()  # changed after the load, before the repair
            raise OSError("bad weights")
        return "model"

    with caplog.at_level("WARNING", logger="services.common.model_store"):
        _, got = model_store.load_resolved("smollm2", str(tmp_path), None, load)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert got == "model" and len(warned) == 1 and "cannot be loaded" in warned[0], warned
    assert len(loads) == 2


def test_transformers_gguf_bar_writes_nothing_when_stderr_is_no_terminal(tmp_path: Path,
                                                                         monkeypatch):
    """transformers' GGUF loader draws its own tqdm bar ("Converting and de-quantizing GGUF
    tensors...", tqdm.auto imported into its module): `logs.quiet_library_progress_bars`
    does not reach it, and a (re-)conversion wrote its carriage-return lines amid the
    JSON-lines log. Off while stderr is no terminal; the module's bar is put back after."""
    import io
    import sys

    import transformers
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    drawn = gguf_utils.tqdm

    def load(*args, **kwargs):
        for _ in gguf_utils.tqdm(range(3), desc="Converting and de-quantizing GGUF tensors..."):
            pass
        return SimpleNamespace()

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", load)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", load)
    monkeypatch.setattr(model_store, "gguf_pre_type", lambda g: None)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    model_store._load_gguf(tmp_path / "x.gguf")
    assert err.getvalue() == "" and gguf_utils.tqdm is drawn


def test_two_overlapping_conversions_leave_transformers_gguf_bar_as_it_was(monkeypatch):
    """Two conversions in one process (two cache folders: each its own file lock) overlap:
    the first to finish put the bar back under the second, whose tensors then drew it, and
    the second put back the first's disabled bar, which stayed for the process's life."""
    import io
    import sys

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    drawn = gguf_utils.tqdm
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    first, second = model_store._quiet_gguf_bar(), model_store._quiet_gguf_bar()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert gguf_utils.tqdm is not drawn  # the second still converts: still off
    second.__exit__(None, None, None)
    assert gguf_utils.tqdm is drawn


def test_weights_damaged_in_place_at_their_size_are_converted_again_where_loaded(
        tmp_path: Path, monkeypatch, caplog):
    """The marker recorded no digest of the weights: weights zeroed in place at their size
    loaded, and the model answered garbage without a word. kvpool (`check_weights`) now
    compares their sha256 first and converts again once under the WARNING the other files
    get; the orchestrator, which loads only the tokenizer, does not read them. A marker from
    before the digest gets it after a load that passed; a mismatch again after converting is
    one ModelStoreError naming the file (kvpool: "bad configuration", exit 2)."""
    loads = _fake_gguf(tmp_path, monkeypatch)

    def load(p: str) -> bytes:
        return (Path(p) / "model.safetensors").read_bytes()  # loads whatever is there

    path = Path(resolve_model("smollm2", cache_dir=str(tmp_path)).path)
    marker = json.loads((path / model_store._DONE_MARKER).read_text())
    assert list(marker[model_store._WEIGHTS_DIGESTS]) == ["model.safetensors"]

    def zero() -> None:
        with open(path / "model.safetensors", "r+b") as f:
            f.seek(1000)
            f.write(b"\0" * 64)  # same size

    zero()
    _, data = model_store.load_resolved("smollm2", str(tmp_path), None, load)
    assert data != b"w" * 4096 and loads == [1]  # the tokenizer's caller reads no weights
    with caplog.at_level("WARNING", logger="services.common.model_store"):
        _, data = model_store.load_resolved("smollm2", str(tmp_path), None, load,
                                            check_weights=True)
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert data == b"w" * 4096 and loads == [1, 1]
    assert len(warned) == 1 and "model.safetensors changed since it was converted" in \
        warned[0] and str(path) in warned[0], warned
    # An older marker (no weights digest) passes, and gets it once the load passed.
    marker = json.loads((path / model_store._DONE_MARKER).read_text())
    del marker[model_store._WEIGHTS_DIGESTS]
    (path / model_store._DONE_MARKER).write_text(json.dumps(marker))
    model_store.load_resolved("smollm2", str(tmp_path), None, load, check_weights=True)
    assert loads == [1, 1]
    marker = json.loads((path / model_store._DONE_MARKER).read_text())
    assert model_store._WEIGHTS_DIGESTS in marker
    assert not list(path.glob("*.tmp"))
    zero()
    model_store.load_resolved("smollm2", str(tmp_path), None, load, check_weights=True)
    assert loads == [1, 1, 1]
    # Damaged again by the disk right after converting: one error, not a loop.
    real_publish = model_store._publish

    def publish_then_damage(tmp: Path, target: Path) -> None:
        real_publish(tmp, target)
        zero()

    monkeypatch.setattr(model_store, "_publish", publish_then_damage)
    zero()
    with pytest.raises(model_store.ModelStoreError,
                       match=r"converted again and still does not match its marker: "
                             r"model\.safetensors changed since it was converted"):
        model_store.load_resolved("smollm2", str(tmp_path), None, load, check_weights=True)
    assert loads == [1, 1, 1, 1]
