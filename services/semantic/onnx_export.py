"""One-time export of a sentence-transformers folder to an ONNX graph with pooling inside.

    ensure_onnx(model_dir, cache_dir, "all-MiniLM-L6-v2")
      -> <cache_dir>/onnx/all-MiniLM-L6-v2/model.onnx   (+ meta.json, tokenizer.json)
    ensure_onnx(model_dir, cache_dir, "all-MiniLM-L6-v2", exporter="dynamo")
      -> <cache_dir>/onnx/all-MiniLM-L6-v2.dynamo/model.onnx

The graph takes `input_ids`, `attention_mask` (and `token_type_ids` where the model has them)
and returns one output `[batch, dim]` (`embedding`; `sentence_embedding` from the dynamo
exporter): the transformer, then the folder's pooling (mean or CLS),
then L2 normalisation when the folder has a Normalize module, so its output equals
sentence-transformers' (the embedder then makes every vector unit length, Normalize module or
not: the index searches by inner product). Folders with other modules (Dense, as in LaBSE or
distiluse) are refused at start, naming the module. The export runs once per model folder
(fingerprinted by its files' content): concurrent processes serialise on a lock file
and the result appears atomically (written to a temporary folder, then renamed), so a reader
never sees a half-written model.

Two exporters (`SemanticConfig.onnx_exporter`): "torchscript", torch's legacy tracer (the
default), and "dynamo", the `torch.export`-based exporter that torch recommends since 2.9 and
that needs `onnxscript`. Both give the same vectors (largest difference 1.4e-7 over 256 QQP
questions), but on the 2-core Xeon host ONNX Runtime ran the dynamo graph 4-20% slower (batch-1
p50 2.51-2.55 vs 2.36-2.39 ms, and 2.20 vs 2.12 ms; batch 32, 304-305 vs 343-363 and 319 vs 401
sentences/s; three runs of `python -m benchmarks.semantic --parts exporters`, the last the one
in benchmarks/results/semantic.json): its fusions of attention and layer norms
match the traced graph's patterns (an ad hoc run of its transformer optimiser fused 6 attention
blocks in the traced graph, none in the dynamo one). Hence the default; "dynamo" is the way
on once a torch release drops the tracer. Each exporter has its own folder, so processes that
differ in it never undo each other's export; the vectors, and so the stored entries, do not
depend on it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from services.common.files import file_digest, fsync_path, hash_file, remove_aside
from services.common.logs import step_progress
from services.common.model_store import readable_weights

log = logging.getLogger(__name__)

OPSET = 17
EXPORTERS = ("torchscript", "dynamo")
# The dynamo exporter's opset: the lowest its translation library (onnxscript) emits.
DYNAMO_OPSET = 18
EXPORT_FORMAT = 1  # bump when the graph layout changes; old exports are then redone
# The export's files besides model.onnx that the embedder loads: meta.json records their sizes
# and digests (`_file_record`), and `_is_current` checks them.
TOKENIZER_FILES = ("tokenizer.json",)


@dataclass(frozen=True)
class SentenceModelSpec:
    """What the sentence-transformers folder says about tokenising and pooling."""

    model_dir: Path
    max_seq_length: int
    pooling: str  # "mean" or "cls"
    normalize: bool
    dim: int

    @classmethod
    def read(cls, model_dir: str | os.PathLike) -> SentenceModelSpec:
        """Reads `modules.json`, `sentence_bert_config.json` and the pooling config.

        Raises:
            ValueError: the folder is not a sentence-transformers model we can run.
        """
        d = Path(model_dir)
        if not (d / "config.json").is_file() or not (d / "tokenizer.json").is_file():
            # Named with the setting, as a malformed file is below: the line said only the path.
            raise ValueError(f"{d}: needs config.json and tokenizer.json (a fast tokenizer); "
                             "point TIERCACHE_SEMANTIC_MODEL_DIR at a sentence-transformers "
                             "folder, or unset it for the packaged all-MiniLM-L6-v2")
        try:
            return cls._read(d)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            # A file that is not the JSON it should be said only "JSONDecodeError: Expecting
            # value: line 1 column 1" (or raised a KeyError), naming neither it nor the setting.
            if isinstance(e, ValueError) and str(e).startswith(f"{d}:"):
                raise
            raise ValueError(f"{d}: a model file is malformed ({type(e).__name__}: {e}); check "
                             "or replace the folder (TIERCACHE_SEMANTIC_MODEL_DIR)") from e

    @classmethod
    def _read(cls, d: Path) -> SentenceModelSpec:
        max_len = 256
        sbc = d / "sentence_bert_config.json"
        if sbc.is_file():
            max_len = int(json.loads(sbc.read_text()).get("max_seq_length") or max_len)
        hidden = int(json.loads((d / "config.json").read_text()).get("hidden_size", 0))
        pooling, normalize, dim = "mean", False, hidden
        modules = d / "modules.json"
        if modules.is_file():
            for m in json.loads(modules.read_text()):
                kind = m.get("type", "")
                if kind.endswith("Pooling"):
                    pc = json.loads((d / m["path"] / "config.json").read_text())
                    dim = int(pc.get("word_embedding_dimension", dim))
                    if pc.get("pooling_mode_cls_token"):
                        pooling = "cls"
                    elif pc.get("pooling_mode_mean_tokens"):
                        pooling = "mean"
                    else:
                        raise ValueError(f"{d}: only mean or CLS pooling is supported")
                elif kind.endswith("Normalize"):
                    normalize = True
                elif kind.endswith(("Transformer", "Pooling")):
                    pass
                else:
                    raise ValueError(f"{d}: unsupported sentence-transformers module {kind}")
        return cls(d, max_len, pooling, normalize, dim)

    def fingerprint(self, exporter: str = "torchscript") -> str:
        """Keys the ONNX export: the export's own format, exporter and opset, and
        `weights_fingerprint`."""
        h = hashlib.blake2b(digest_size=8)
        fmt = (f"{EXPORT_FORMAT}|{OPSET}" if exporter == "torchscript"
               else f"{EXPORT_FORMAT}|{exporter}|{DYNAMO_OPSET}")
        h.update(f"{fmt}|{self.weights_fingerprint()}".encode())
        return h.hexdigest()

    def weights_fingerprint(self) -> str:
        """Changes when what the vectors depend on changes: config, tokenizer, weights,
        pooling, normalisation, window (hashes every file but documentation: ~0.2 s for
        MiniLM's 90 MB, once per start). Stored vectors are tagged with it, and a change
        re-embeds every entry at start, so a new README (or a new export format) must not
        count: at the 200,000-entry cap that took most of an hour."""
        h = hashlib.blake2b(digest_size=8)
        h.update(f"{self.pooling}|{self.normalize}|{self.max_seq_length}".encode())
        for name in sorted(os.listdir(self.model_dir)):
            p = self.model_dir / name
            if p.is_file() and not _is_documentation(name):
                h.update(name.encode())
                # Content, weights included: a fine-tuned checkpoint has the same size.
                hash_file(h, p)
        return h.hexdigest()


def _is_documentation(name: str) -> bool:
    """Files of a model folder that no vector depends on."""
    low = name.lower()
    return (low.startswith(("readme", "license", "licence", ".git"))
            or low.endswith((".md", ".png", ".jpg", ".jpeg", ".gif"))
            or low in ("data_config.json", "config_sentence_transformers.json"))


def _export(spec: SentenceModelSpec, out_dir: Path, exporter: str = "torchscript") -> None:
    """Exports the transformer + pooling + normalisation into `out_dir/model.onnx`."""
    import torch
    from transformers import AutoModel

    steps = step_progress(4, f"ONNX export of {spec.model_dir.name}", log)
    # Eager attention: the SDPA path drops an all-ones mask at trace time, which would bake
    # "no padding" into the graph.
    with readable_weights(spec.model_dir, "TIERCACHE_SEMANTIC_MODEL_DIR", ValueError):
        model = AutoModel.from_pretrained(str(spec.model_dir),
                                          attn_implementation="eager").eval()
    steps.update(1)
    ids = torch.ones(2, 8, dtype=torch.long)
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, 5:] = 0  # a padded row, so the traced graph really applies the mask
    args: tuple = (ids, mask)
    names = ["input_ids", "attention_mask"]
    if getattr(model.config, "type_vocab_size", 0) > 1:
        args = (ids, mask, torch.zeros(2, 8, dtype=torch.long))
        names.append("token_type_ids")
    steps.update(1)
    if exporter == "dynamo":
        _export_dynamo(_pooled(model, spec), args, names, out_dir / "model.onnx")
    else:
        _export_torchscript(model, spec, args, names, out_dir)
    steps.update(1)
    shutil.copy2(spec.model_dir / "tokenizer.json", out_dir / "tokenizer.json")
    _write_meta(spec, out_dir, exporter, names)
    # On disk before the folder is renamed into place: after a power loss the rename could
    # survive with an empty model.onnx, which no later start would ever export again.
    for name in ("model.onnx", "tokenizer.json", "meta.json"):
        with open(out_dir / name, "rb") as f:
            os.fsync(f.fileno())
    steps.update(1)
    steps.close()


def _pooled(model, spec: SentenceModelSpec):
    """`model` with the folder's pooling (mean or CLS) and normalisation after it, in eval
    mode: the module `_export` hands to the ONNX exporter."""
    import torch

    pooling, normalize = spec.pooling, spec.normalize

    class Pooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            kw = {"token_type_ids": token_type_ids} if token_type_ids is not None else {}
            hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, **kw)[0]
            if pooling == "cls":
                emb = hidden[:, 0]
            else:
                m = attention_mask.unsqueeze(-1).to(hidden.dtype)
                emb = (hidden * m).sum(1) / m.sum(1).clamp(min=1e-9)
            if normalize:
                emb = torch.nn.functional.normalize(emb, p=2.0, dim=1)
            return emb

    return Pooled().eval()


def _export_torchscript(model, spec: SentenceModelSpec, args: tuple, names: list[str],
                        out_dir: Path) -> None:
    """`torch.onnx.export(dynamo=False)`, torch's legacy tracer, of `_pooled(model, spec)` into
    `out_dir/model.onnx`: batch and sequence length dynamic.

    Raises:
        OSError: writing the graph failed (the cache's disk), naming the cache folder.
        RuntimeError: the exporter failed, naming the dynamo exporter as the way on.
    """
    import torch

    axes = {n: {0: "batch", 1: "seq"} for n in names}
    axes["embedding"] = {0: "batch"}
    try:
        with torch.inference_mode():
            torch.onnx.export(_pooled(model, spec), args, str(out_dir / "model.onnx"),
                              input_names=names, output_names=["embedding"],
                              dynamic_axes=axes, opset_version=OPSET, dynamo=False)
    except OSError as e:
        # The cache's disk (full, read-only), not the exporter: said as such, not as a
        # reason to switch exporters (and as an OSError, one line at start).
        raise OSError(e.errno, f"writing the ONNX export of {spec.model_dir} into "
                      f"{out_dir.parent}: {e.strerror or e} (TIERCACHE_SEMANTIC_CACHE_DIR)"
                      ) from e
    except Exception as e:  # noqa: BLE001 - re-raised, with the way out named
        raise RuntimeError(
            f"the TorchScript ONNX exporter failed on {spec.model_dir} "
            f"({type(e).__name__}: {e}); torch has deprecated it: if this torch release "
            "no longer has it, set TIERCACHE_SEMANTIC_ONNX_EXPORTER=dynamo") from e


def _write_meta(spec: SentenceModelSpec, out_dir: Path, exporter: str, names: list[str]) -> None:
    """Writes `out_dir/meta.json`: what the export was made from (fingerprints, the model
    folder), what the graph takes and does (inputs, pooling), and the sizes and digests of its
    files that `_is_current` checks."""
    meta = {"fingerprint": spec.fingerprint(exporter), "weights": spec.weights_fingerprint(),
            "exporter": exporter,
            "max_seq_length": spec.max_seq_length, "dim": spec.dim, "pooling": spec.pooling,
            "normalize": spec.normalize, "inputs": names,
            "source": os.path.realpath(spec.model_dir),
            "model_bytes": (out_dir / "model.onnx").stat().st_size,
            # Its content too (~0.2 s at a start for MiniLM's 90 MB): a graph damaged inside
            # its weights loaded, and every vector was NaN, every lookup a silent miss.
            "model_blake2b": file_digest(out_dir / "model.onnx"),
            "files": {n: _file_record(out_dir / n) for n in TOKENIZER_FILES}}
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))


def _export_dynamo(module, args: tuple, names: list[str], path: Path) -> None:
    """`torch.onnx.export(dynamo=True)`: batch and sequence length dynamic, weights inside the
    one file (90 MB for MiniLM; the 2 GB protobuf limit is far off), so the rest of the cache
    (sizes, fsync, rename) handles it as the traced export.

    Raises:
        RuntimeError: onnxscript, which this exporter needs, is not installed.
    """
    import importlib.util

    import torch

    if importlib.util.find_spec("onnxscript") is None:
        raise RuntimeError("TIERCACHE_SEMANTIC_ONNX_EXPORTER=dynamo needs the onnxscript "
                           "package (pip install onnxscript), which is not installed")
    dim = torch.export.Dim.DYNAMIC
    shapes = {n: {0: dim, 1: dim} for n in names}
    with torch.inference_mode():
        # The output is not called "embedding" here: that name is taken inside the dynamo
        # graph (the embedding lookup's value) and ONNX Runtime refuses the duplicate. The
        # embedder reads the graph's only output, whatever its name.
        torch.onnx.export(module, args, str(path), input_names=names,
                          output_names=["sentence_embedding"], dynamic_shapes=shapes,
                          opset_version=DYNAMO_OPSET, dynamo=True, external_data=False,
                          verbose=False)


def _file_record(path: Path) -> dict:
    """What meta.json records of a small file of the export: its size and blake2b digest
    (tokenizer.json is ~0.7 MB: read in a few ms at each start)."""
    return {"bytes": path.stat().st_size, "blake2b": file_digest(path)}


def _is_current(d: Path, fingerprint: str) -> bool:
    """An export of this fingerprint, whole (a model.onnx of another size than the export
    wrote was cut short: exported again), with its tokenizer as exported.

    A tokenizer.json cut short, zeroed or gone made every start exit on the tokenizer's parse
    error, and nothing exported it again. An export from before sizes and digests were
    recorded (no "files" in meta.json) is accepted here: re-exporting every existing cache
    would cost each a start of tens of seconds; the embedder exports it again only if its
    tokenizer fails to load (`OnnxEmbedder`)."""
    return not _export_problem(d, fingerprint)


def _export_problem(d: Path, fingerprint: str) -> str:
    """Why the folder `d` holds no usable export of `fingerprint`, as a few words naming the
    file at fault; "" when it does (`_is_current`'s checks). A damaged export was made again
    under the first start's own words, "exporting ... (once)", at INFO: the operator never
    learnt that the cache had been damaged, nor which file."""
    if not d.exists():
        return "not exported yet"
    for name in ("meta.json", "model.onnx"):
        if not (d / name).is_file():
            return f"{name} is missing"
    try:
        meta = json.loads((d / "meta.json").read_text())
        size = (d / "model.onnx").stat().st_size
        if meta.get("fingerprint") != fingerprint:
            return "an export of another model, exporter or release (fingerprint)"
        if meta.get("model_bytes", size) != size:
            return f"model.onnx is {size} bytes, {meta['model_bytes']} when exported (cut short)"
        want = meta.get("model_blake2b")  # none in an export from before it was recorded
        if want is not None and file_digest(d / "model.onnx") != want:
            return "model.onnx changed since it was exported (damaged in place)"
        files = meta.get("files")
        if files is None:  # an older export: see _is_current
            return ""
        for name, want in files.items():
            if not (d / name).is_file():
                return f"{name} is missing"
            if _file_record(d / name) != want:
                return f"{name} changed since it was exported (cut short or damaged)"
        return ""
    except (OSError, ValueError, AttributeError, TypeError, LookupError) as exc:
        return f"meta.json or a file it names cannot be read ({type(exc).__name__}: {exc})"


def export_identity(d: Path) -> tuple[int, int, int, int] | None:
    """Which model.onnx file the export folder `d` holds (device, inode, size, mtime), None
    if none: what `ensure_onnx(broken=...)` takes."""
    try:
        st = (d / "model.onnx").stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _remove_leftovers(root: Path, name: str) -> None:
    """Deletes the temporary folders of exports killed part-way (`.{name}.XXXXXXXX`, and
    `.{name}.old.XXXXXXXX` of one killed while deleting a stale export): SIGKILL, an OOM kill,
    or SIGTERM while starting leave them, and nothing else ever removed them (tens of MB
    each, for good). The caller holds the lock: no export of `name` is running. Folders
    only: the lock file `.{name}.lock` stays."""
    leftover = re.compile(rf"\.{re.escape(name)}\.(?:old\.)?[a-z0-9_]{{8}}")
    for p in root.iterdir():
        if leftover.fullmatch(p.name) and p.is_dir() and not p.is_symlink():
            log.info("removing %s, left by an export that did not finish", p)
            shutil.rmtree(p, ignore_errors=True)


def export_folder(cache_dir: str | os.PathLike, name: str, exporter: str = "torchscript") -> Path:
    """Where `ensure_onnx` keeps `name`'s export by `exporter`."""
    return Path(cache_dir) / "onnx" / (name if exporter == "torchscript" else f"{name}.{exporter}")


def _source(d: Path) -> str | None:
    """The model folder (resolved) that the export in `d` was made from; None if unknown."""
    try:
        source = json.loads((d / "meta.json").read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None
    return os.path.realpath(source) if isinstance(source, str) and source else None


def _own_folder(plain: Path, spec: SentenceModelSpec, fingerprint: str) -> Path:
    """`plain`, unless it holds the export of another model folder of the same name (/a/model
    and /b/model are both "model") with other contents: then a folder of its own beside it,
    named with a digest of its path. Sharing one, each start of either replaced the other's
    export. An export of the same contents is used wherever it was made from (a venv or a
    checkout at a new path)."""
    other = _source(plain)
    if other is None or other == os.path.realpath(spec.model_dir) or _is_current(plain,
                                                                                 fingerprint):
        return plain
    return _folder_of_its_own(plain, spec)


def _folder_of_its_own(plain: Path, spec: SentenceModelSpec) -> Path:
    """The folder beside `plain` named after the model folder's path (`_own_folder`)."""
    digest = hashlib.sha256(os.path.realpath(spec.model_dir).encode()).hexdigest()[:8]
    return plain.with_name(f"{plain.name}-{digest}")


# Exports this process has started: an export made by the very call that then fails to load
# it is not made again (`OnnxEmbedder`).
exports_done = 0
_exports_lock = threading.Lock()


def ensure_onnx(model_dir: str | os.PathLike, cache_dir: str | os.PathLike, name: str, *,
                broken: tuple[int, int, int, int] | None = None,
                exporter: str = "torchscript") -> Path:
    """Returns the folder holding `model.onnx` for `model_dir`, exporting it first if needed.

    Safe to call from several processes at once: one exports, the others wait on the lock and
    then find the finished folder.

    Args:
        broken: `export_identity` of an export that could not be loaded (damaged, though of
            the size meta.json records): it is removed and exported again, unless another
            process has replaced it meanwhile.
        exporter: one of `EXPORTERS` (see the module's docstring).

    Raises:
        ValueError: an unknown exporter, or a folder we cannot run (`SentenceModelSpec.read`).
    """
    if exporter not in EXPORTERS:
        raise ValueError(f"unknown ONNX exporter {exporter!r}: one of {', '.join(EXPORTERS)}")
    spec = SentenceModelSpec.read(model_dir)
    fp = spec.fingerprint(exporter)
    plain = export_folder(cache_dir, name, exporter)
    target = _own_folder(plain, spec, fp)
    if target != plain:
        if broken is None and _is_current(target, fp):
            return target
        # Chosen without the lock of `plain`, which may have been between two exports then:
        # another process repairing an export of the same contents (made from another path)
        # had renamed it aside, and a start meanwhile exported a second copy into a folder
        # of its own (tens of seconds, and a folder kept for good). Decided under that lock.
        target = plain
    done = _ensure_at(target, spec, exporter, fp, broken)
    if done is None:
        # Another model folder of this name exported there: not ours to replace (its
        # process may be loading it).
        done = _ensure_at(_folder_of_its_own(plain, spec), spec, exporter, fp, broken)
    assert done is not None  # a folder named after our own path holds no other's export
    return done


def _ensure_at(target: Path, spec: SentenceModelSpec, exporter: str, fp: str,
               broken: tuple[int, int, int, int] | None) -> Path | None:
    """`ensure_onnx` into `target` (`fp`: the spec's fingerprint for `exporter`); None when
    `target` turned out to hold another model folder's export."""
    root, key = target.parent, target.name  # key: the folder's name, as its lock's
    if broken is None:
        problem = _export_problem(target, fp)
        if not problem:
            return target
        if problem != "not exported yet":
            # A cache folder damaged (a node crash, a full disk, a bad copy) or stale: said
            # once, naming the file, before the tens of seconds of exporting it again; before
            # the lock, so that a cache folder the service cannot write still says why it had
            # to. (One that could not be loaded is said under the lock, as it is removed.)
            log.warning("the ONNX export %s cannot be used (%s): exporting it again", target,
                        problem)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if broken is not None and export_identity(target) == broken:
            log.warning("removing the export %s, which could not be loaded", target)
            remove_aside(target, f".{key}.old.")
        if _is_current(target, fp):  # another process finished while we waited
            return target
        if _own_folder(target, spec, fp) != target:
            return None
        _remove_leftovers(root, key)
        log.info("exporting %s to ONNX under %s (once)", spec.model_dir, target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
        try:
            global exports_done
            with _exports_lock:  # two embedders built at once in one process
                exports_done += 1
            _export(spec, tmp, exporter)
            if target.exists():
                # Stale export (other fingerprint): move it aside, then swap in the new one.
                remove_aside(target, f".{key}.old.")
            os.chmod(tmp, 0o755)
            os.rename(tmp, target)
            fsync_path(root)  # the rename itself, durable
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target
