"""A differential review of the ONNX export cache (services/semantic/onnx_export.py): seeded
random sequences of `ensure_onnx` calls (two model folders of one name, both exporters),
loads that find the export damaged and ask again with `broken=`, concurrent and killed exports,
damage to the cache and to the model folders, each answer compared with a reference model of
the module's docs after every step.

The export itself is stood in for (as the rules tests do): `_export` writes a model.onnx whose
bytes follow the model folder's files (documentation aside) and the exporter, copies the
folder's tokenizer.json and writes meta.json with the fields the real one records (checked
against a real export's meta.json where the session has one). The rest is the real code:
fingerprints, `_own_folder`, the lock, `_remove_leftovers`, `_is_current`, `remove_aside`, the
rename. Concurrent and killed exports run in real processes; a kill is a SIGKILL the process
sends itself at a chosen point (starting the export, half-way through model.onnx, before
meta.json, before or inside `remove_aside`, after the rename).

The model (from the module docstring, `_is_current`'s, `_own_folder`'s and `ensure_onnx`'s): an
export is reused iff its meta.json reads, is of the folder's fingerprint (which follows every
file but documentation, and the exporter), model.onnx has the recorded size and (when
recorded) digest, and the recorded tokenizer files are as exported; an export from before
digests (no model digest, no "files") is judged by model.onnx's size only. Each exporter has
its own folder; a model folder whose name's folder holds another folder's export of other
contents gets a folder of its own (`<name>-<digest of its path>`); the same contents are used
wherever exported from. `broken=` the identity of what failed to load: exported again once,
unless another process replaced it. Concurrent callers export once; one waiting on the lock of
a killed exporter goes on. After a kill the folder is as before (killed before it was renamed
aside), gone (inside or after `remove_aside`, or after a `broken=` removal), or the new one
(after the rename). An export leaves no `.<key>.XXXXXXXX` / `.<key>.old.XXXXXXXX` of its key;
leftovers never exceed those of the last killed export plus the strays planted since. With the
cache read-only (no CAP_DAC_OVERRIDE), a current export is reused and one to redo is an error
naming a path under the cache. Where the docs are silent (meta.json damaged in place but still
JSON) only the invariants are asserted: whichever folder is answered is whole.

Run in the review: 600 seeds of 40 steps (about 1,900 killed exports, 900 concurrent rounds
of 2-3 processes, 950 read-only ensures). Found and fixed (test_onnx_export_rules.py guards it
deterministically): a start for /b/model while a process for /a/model (same files) repaired
the export at their name had it renamed aside: `_own_folder` read its source (/a), then found
no current export, and the start exported a second copy into a folder of its own, kept for
good, instead of waiting on the lock for the repair. The model's own errors on the way (an
expectation computed after the step) are fixed in the model.

Bugs injected to check the harness has teeth (failing seeds of 20): the tokenizer record not
compared 8; leftovers not removed 17; no second look under the lock 14; a `broken=` export not
removed 2; the model digest not compared 2; never a folder of its own 18.

More seeds: TIERCACHE_ONNX_EXPORT_DIFF_SEEDS=400 (default 8 here, 40 steps each).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import stat
import tempfile
from pathlib import Path

from services.common import files as files_mod
from services.semantic import onnx_export
from tests.procs import (
    CAN_READONLY,
    die,
    json_answers,
    killable_remove_aside,
    lines_in,
    python_child,
    read_only,
    run_seeds,
    saving,
    starting,
    take_step,
    wait_started,
)

ROOT = Path(__file__).resolve().parents[2]
SEEDS = int(os.environ.get("TIERCACHE_ONNX_EXPORT_DIFF_SEEDS", "8"))
STEPS = int(os.environ.get("TIERCACHE_ONNX_EXPORT_DIFF_STEPS", "40"))
NAME = "m"
CHILD_TIMEOUT = 60.0
WEIGHTS = [b"w1" * 40, b"w2" * 40, b"w3" * 90]
TOKENIZERS = [b'{"v": 1}', b'{"v": 22}']
KILLS = ["start", "onnx-half", "before-meta", "aside-before", "aside-mid", "aside-after",
         "after-rename"]


# ---- the stand-in for the export (used in this process and in the children) ----------------

def graph_bytes(weights: bytes, tokenizer: bytes, exporter: str) -> bytes:
    """The model.onnx the stand-in writes: a function of what the vectors depend on."""
    h = hashlib.blake2b(weights + b"|" + tokenizer + exporter.encode(), digest_size=8)
    n = 48 * (2 + h.digest()[0] % 3)
    return (h.hexdigest().encode() * n)[:n]


def install_fakes(log: Path, kill: str | None = None, hold: float = 0.0,
                  started: Path | None = None):
    """Patches onnx_export for the stand-in export; returns the undo."""
    undo = saving([(onnx_export, "_export"), (onnx_export, "fsync_path"),
                  (onnx_export, "remove_aside"), (files_mod, "shutil")])

    def export(spec, out: Path, exporter: str = "torchscript") -> None:
        starting(log, started, hold)
        if kill == "start":
            die()
        d = Path(spec.model_dir)
        data = graph_bytes((d / "model.safetensors").read_bytes(),
                           (d / "tokenizer.json").read_bytes(), exporter)
        if kill == "onnx-half":
            (out / "model.onnx").write_bytes(data[: len(data) // 2])
            die()
        (out / "model.onnx").write_bytes(data)
        shutil.copy2(d / "tokenizer.json", out / "tokenizer.json")
        if kill == "before-meta":
            die()
        meta = {"fingerprint": spec.fingerprint(exporter), "weights": spec.weights_fingerprint(),
                "exporter": exporter, "max_seq_length": spec.max_seq_length, "dim": spec.dim,
                "pooling": spec.pooling, "normalize": spec.normalize,
                "inputs": ["input_ids", "attention_mask"],
                "source": os.path.realpath(spec.model_dir), "model_bytes": len(data),
                "model_blake2b": files_mod.file_digest(out / "model.onnx"),
                "files": {n: onnx_export._file_record(out / n)
                          for n in onnx_export.TOKENIZER_FILES}}
        (out / "meta.json").write_text(json.dumps(meta, indent=1))

    real_fsync = files_mod.fsync_path

    def fsync_path(p) -> None:  # after the rename: the cache folder
        if kill == "after-rename":
            die()
        real_fsync(p)

    onnx_export._export = export
    onnx_export.fsync_path = fsync_path
    onnx_export.remove_aside = killable_remove_aside(kill)

    return undo


def loads(folder: Path, model_dir: Path, exporter: str) -> bool:
    """What a load needs: the graph and tokenizer as exporting `model_dir` now gives them."""
    try:
        return ((folder / "model.onnx").read_bytes() == graph_bytes(
            (model_dir / "model.safetensors").read_bytes(),
            (model_dir / "tokenizer.json").read_bytes(), exporter)
            and (folder / "tokenizer.json").read_bytes()
            == (model_dir / "tokenizer.json").read_bytes()
            and json.loads((folder / "meta.json").read_text())["exporter"] == exporter)
    except (OSError, ValueError, KeyError, TypeError):
        return False


def embed_like(model_dir: Path, cache: Path, exporter: str) -> Path:
    """What `OnnxEmbedder` does with the cache: ensure, load, and once more with `broken=`."""
    folder = onnx_export.ensure_onnx(model_dir, cache, NAME, exporter=exporter)
    if loads(folder, model_dir, exporter):
        return folder
    ident = onnx_export.export_identity(folder)
    return onnx_export.ensure_onnx(model_dir, cache, NAME, broken=ident, exporter=exporter)


CHILD = r"""
import json, sys
a = json.loads(sys.argv[1])
from pathlib import Path
from tests.semantic.test_onnx_export_differential import embed_like, install_fakes
from services.semantic import onnx_export
install_fakes(Path(a["log"]), a["kill"], a["hold"], Path(a["started"]) if a["started"] else None)
try:
    if a["op"] == "embed":
        got = embed_like(Path(a["model"]), Path(a["cache"]), a["exporter"])
    else:
        got = onnx_export.ensure_onnx(a["model"], a["cache"], "m", exporter=a["exporter"])
    print(json.dumps({"path": str(got)}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def _child(op: str, model: Path, cache: Path, exporter: str, log: Path, kill: str | None = None,
           hold: float = 0.0, started: Path | None = None, readonly: bool = False):
    arg = {"op": op, "model": str(model), "cache": str(cache), "exporter": exporter,
           "log": str(log), "kill": kill, "hold": hold,
           "started": str(started) if started else ""}
    return python_child(CHILD, arg, readonly)


# ---- the reference model -----------------------------------------------------------------

class Pub:
    """What the model knows of one published export folder."""

    def __init__(self, key: tuple, source: str, exporter: str, written: dict) -> None:
        self.key, self.source, self.exporter, self.written = key, source, exporter, written
        self.meta = "ok"  # ok | nofiles | nodigest | bad | fuzz


class Model:
    def __init__(self, dirs: dict[str, Path]) -> None:
        self.dirs = dirs
        self.content = {s: [0, 0, 0] for s in dirs}  # weights, tokenizer, readme variants
        self.pubs: dict[str, Pub] = {}  # folder name -> what it holds
        self.strays: dict[str, int] = {}
        self.killed_left: dict[str, int] = {}

    def key(self, side: str, exporter: str) -> tuple:
        w, t, _ = self.content[side]
        return (w, t, exporter)

    def expected(self, side: str, exporter: str) -> dict[str, bytes]:
        w, t, _ = self.content[side]
        return {"model.onnx": graph_bytes(WEIGHTS[w], TOKENIZERS[t], exporter),
                "tokenizer.json": TOKENIZERS[t]}

    def current(self, folder: Path, side: str, exporter: str) -> str:
        """"yes", "no" or "either": whether `_is_current` holds, by the docs."""
        p = self.pubs.get(folder.name)
        if p is None or not folder.is_dir() or p.meta == "bad":
            return "no"
        if p.meta == "fuzz":
            return "either"
        if p.key != self.key(side, exporter):
            return "no"
        onnx = folder / "model.onnx"
        if not onnx.is_file() or onnx.stat().st_size != len(p.written["model.onnx"]):
            return "no"
        if p.meta in ("ok", "nofiles") and onnx.read_bytes() != p.written["model.onnx"]:
            return "no"
        if p.meta == "ok":
            tok = folder / "tokenizer.json"
            if not tok.is_file() or tok.read_bytes() != p.written["tokenizer.json"]:
                return "no"
        return "yes"

    def target(self, root: Path, side: str, exporter: str) -> tuple[Path, bool]:
        """The folder ensure_onnx answers, and whether the model is sure of it."""
        plain = root / (NAME if exporter == "torchscript" else f"{NAME}.{exporter}")
        mine = os.path.realpath(self.dirs[side])
        own = plain.with_name(f"{plain.name}-{hashlib.sha256(mine.encode()).hexdigest()[:8]}")
        p = self.pubs.get(plain.name)
        if p is None or not plain.is_dir() or p.meta == "bad":
            return plain, True  # no source it could be another's
        if p.meta == "fuzz":
            return plain, False
        if p.source == mine or self.current(plain, side, exporter) == "yes":
            return plain, True
        return own, True

    def whole(self, folder: Path, side: str, exporter: str) -> bool:
        return loads(folder, self.dirs[side], exporter)


def _snapshot(folder: Path) -> dict[str, bytes] | None:
    if not folder.is_dir():
        return None
    return {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}


def _leftovers(root: Path, key: str) -> list[str]:
    import re

    pat = re.compile(rf"\.{re.escape(key)}\.(?:old\.)?[a-z0-9_]{{8}}")
    return sorted(p.name for p in root.iterdir() if pat.fullmatch(p.name)) \
        if root.is_dir() else []



class Run:
    def __init__(self, seed: int, base: Path, children: bool = True) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.base = base
        self.cache = base / "cache"
        self.root = self.cache / "onnx"
        self.log = base / "exports.log"
        dirs = {"a": base / "a" / "model", "b": base / "b" / "model"}
        self.m = Model(dirs)
        for side in dirs:
            self.write_model(side)
        self.children = children
        self.trail: list[str] = []
        self.counts: dict[str, int] = {}

    def write_model(self, side: str) -> None:
        d = self.m.dirs[side]
        d.mkdir(parents=True, exist_ok=True)
        w, t, r = self.m.content[side]
        (d / "config.json").write_text('{"hidden_size": 8}')
        (d / "model.safetensors").write_bytes(WEIGHTS[w])
        (d / "tokenizer.json").write_bytes(TOKENIZERS[t])
        (d / "README.md").write_text(f"readme {r}")

    def ctx(self) -> str:
        return f"seed {self.seed}: " + " / ".join(self.trail[-12:])

    def pick(self) -> tuple[str, str]:
        side = self.rng.choice(["a", "b"])
        exporter = "dynamo" if self.rng.random() < 0.2 else "torchscript"
        self.trail[-1] += f"({side},{exporter[:5]})"
        return side, exporter

    def published(self, folder: Path, side: str, exporter: str) -> None:
        """`folder` was just exported for `side`: check it and record it."""
        c = self.ctx()
        assert self.m.whole(folder, side, exporter), c
        assert _leftovers(self.root, folder.name) == [], (c, _leftovers(self.root, folder.name))
        assert stat.S_IMODE(folder.stat().st_mode) == 0o755, c
        meta = json.loads((folder / "meta.json").read_text())
        assert meta["source"] == os.path.realpath(self.m.dirs[side]), c
        self.m.pubs[folder.name] = Pub(self.m.key(side, exporter), meta["source"], exporter,
                                       self.m.expected(side, exporter))
        self.m.strays[folder.name] = self.m.killed_left[folder.name] = 0

    def keys(self) -> set[str]:
        """Every folder name an export of this run may have."""
        out = set()
        for plain in (NAME, f"{NAME}.dynamo"):
            out.add(plain)
            for d in self.m.dirs.values():
                digest = hashlib.sha256(os.path.realpath(d).encode()).hexdigest()[:8]
                out.add(f"{plain}-{digest}")
        return out

    def check_invariants(self) -> None:
        c = self.ctx()
        if not self.root.is_dir():
            return
        names = {p.name for p in self.root.iterdir()}
        keys = self.keys()
        seen = set()
        for key in keys:
            left = _leftovers(self.root, key)
            seen.update(left)
            assert len(left) <= self.m.strays.get(key, 0) + self.m.killed_left.get(key, 0), (
                c, key, left)
        for n in names - seen:
            assert n in keys or (n.startswith(".") and n.endswith(".lock")
                                 and n[1:-5] in keys), (c, n)
        # bounded: per exporter the plain folder and one per model folder path
        assert len([n for n in names if not n.startswith(".")]) <= 6, (c, names)

    # -- operations --
    def ensure_here(self, embed: bool = False) -> None:
        side, exporter = self.pick()
        want, sure = self.m.target(self.root, side, exporter)
        cur = self.m.current(want, side, exporter)
        pre = _snapshot(want)
        whole = self.m.whole(want, side, exporter)
        before = lines_in(self.log)
        if embed:
            got = embed_like(self.m.dirs[side], self.cache, exporter)
        else:
            got = onnx_export.ensure_onnx(self.m.dirs[side], self.cache, NAME, exporter=exporter)
        n = lines_in(self.log) - before
        c = self.ctx()
        if sure:
            assert got == want, (c, got, want)
        else:
            assert got.parent == self.root and got.name.startswith(want.name), (c, got)
            if got != want:
                cur, pre, whole = "either", _snapshot(got), True
        if cur == "yes":
            assert n == (0 if whole or not embed else 1), (c, n, whole)
        elif cur == "no":
            assert n == 1, (c, n)
        else:
            assert n in (0, 1), (c, n)
        if embed or n:
            assert self.m.whole(got, side, exporter), (c, "not whole")
        if n:
            self.published(got, side, exporter)
        else:
            assert _snapshot(got) == pre, (c, "reused but changed")
        self.check_invariants()

    def embed_here(self) -> None:
        self.ensure_here(embed=True)

    def concurrent(self) -> None:
        side, exporter = self.pick()
        want, sure = self.m.target(self.root, side, exporter)
        cur = self.m.current(want, side, exporter)
        if not sure or cur == "either":
            return self.ensure_here()
        k = self.rng.choice([2, 3])
        ops = [self.rng.choice(["ensure", "embed"]) for _ in range(k)]
        self.trail[-1] += f"{ops}"
        pre = _snapshot(want)
        needs = cur == "no" or ("embed" in ops and not self.m.whole(want, side, exporter))
        before = lines_in(self.log)
        outs = json_answers([_child(op, self.m.dirs[side], self.cache, exporter, self.log,
                                    hold=0.2) for op in ops], self.ctx(), CHILD_TIMEOUT)
        n = lines_in(self.log) - before
        for o in outs:
            assert o == {"path": str(want)}, (self.ctx(), o)
        assert n == (1 if needs else 0), (self.ctx(), n)
        if n:
            self.published(want, side, exporter)
        else:
            assert _snapshot(want) == pre, self.ctx()
        self.check_invariants()

    def killed(self) -> None:
        side, exporter = self.pick()
        want, sure = self.m.target(self.root, side, exporter)
        cur = self.m.current(want, side, exporter)
        op = self.rng.choice(["ensure", "embed"])
        whole = self.m.whole(want, side, exporter)
        if not sure or cur == "either" or (cur == "yes" and (op == "ensure" or whole)):
            return self.ensure_here()  # nothing would export: no kill to inject
        broken = cur == "yes"  # the export is redone through `broken=`: removed first
        kill = self.rng.choice(KILLS)
        if kill.startswith("aside") and not want.exists():
            kill = "after-rename"
        waiter = cur == "no" and self.rng.random() < 0.5
        self.trail[-1] += f"({op} killed at {kill}{', a waiter' if waiter else ''})"
        started = self.base / f"started-{len(self.trail)}"
        pre = _snapshot(want)
        before = lines_in(self.log)
        procs = [_child(op, self.m.dirs[side], self.cache, exporter, self.log, kill=kill,
                        hold=0.3 if waiter else 0.0, started=started)]
        if waiter:
            wait_started(started, procs[0], CHILD_TIMEOUT, self.ctx())
            procs.append(_child("ensure", self.m.dirs[side], self.cache, exporter, self.log))
        outs = json_answers(procs, self.ctx(), CHILD_TIMEOUT)
        c = self.ctx()
        assert outs[0] is None, (c, "not killed", outs[0])
        self.m.killed_left[want.name] = 2
        n = lines_in(self.log) - before
        if kill == "after-rename":
            assert self.m.whole(want, side, exporter), c
        elif kill in ("aside-mid", "aside-after") or (broken and kill != "aside-before"):
            assert not want.exists() or (waiter and self.m.whole(want, side, exporter)), c
            if not waiter:
                self.m.pubs.pop(want.name, None)
        else:
            assert waiter or _snapshot(want) == pre, c
        if waiter:
            assert outs[1] == {"path": str(want)}, (c, outs[1])
            assert n == (1 if kill == "after-rename" else 2), (c, n)
        else:  # a `broken=` export is killed while its folder is removed, before exporting
            assert n == (0 if broken and kill.startswith("aside") else 1), (c, n)
        if waiter or kill == "after-rename":
            killed_left = 0 if waiter else 2
            self.published(want, side, exporter)
            self.m.killed_left[want.name] = killed_left
        self.check_invariants()

    def readonly(self) -> None:
        side, exporter = self.pick()
        want, sure = self.m.target(self.root, side, exporter)
        cur = self.m.current(want, side, exporter)
        self.root.mkdir(parents=True, exist_ok=True)
        pre = _snapshot(want)
        with read_only(self.cache, self.root):
            before = lines_in(self.log)
            [out] = json_answers([_child("ensure", self.m.dirs[side], self.cache, exporter,
                                         self.log, readonly=True)], self.ctx(), CHILD_TIMEOUT)
        c = self.ctx()
        assert lines_in(self.log) == before, c
        if out.get("path"):
            assert cur in ("yes", "either") and (out["path"] == str(want) or not sure), (c, out)
        else:
            assert cur in ("no", "either") or not sure, (c, out)
            assert out["error"] in ("PermissionError", "ValueError"), (c, out)
            assert str(self.root) in out["message"], (c, out)
        assert _snapshot(want) == pre, c
        self.check_invariants()

    # -- damage and changes --
    def damage(self) -> None:
        folders = [p for p in self.root.iterdir() if not p.name.startswith(".") and p.is_dir()] \
            if self.root.is_dir() else []
        if not folders:
            return
        folder = self.rng.choice(sorted(folders))
        if self.rng.random() < 0.1:
            shutil.rmtree(folder)
            self.m.pubs.pop(folder.name, None)
            self.trail[-1] += f"(rm {folder.name})"
            return
        files = sorted(p for p in folder.iterdir() if p.is_file())
        if not files:
            return
        f = self.rng.choice(files)
        kind = self.rng.choice(["truncate", "grow", "flip", "delete"])
        self.trail[-1] += f"({kind} {folder.name}/{f.name})"
        data = f.read_bytes()
        pub = self.m.pubs.get(folder.name)
        is_meta = f.name == "meta.json"
        if kind == "delete":
            f.unlink()
        elif kind == "truncate":
            f.write_bytes(data[: self.rng.randrange(len(data))] if data else b"")
        elif kind == "grow":
            f.write_bytes(data + b"\0" * self.rng.randint(1, 9))
        elif data:
            at = self.rng.randrange(len(data))
            new = bytearray(data)
            for i in range(at, min(at + self.rng.randint(1, 4), len(data))):
                new[i] = self.rng.choice([0, 0x30 + self.rng.randrange(10), 0xFF, ord('"')])
            f.write_bytes(bytes(new))
            if is_meta and bytes(new) != data and pub is not None and pub.meta != "bad":
                pub.meta = "fuzz"
            return
        if is_meta and pub is not None:
            pub.meta = "bad"

    def older_meta(self) -> None:
        folders = [n for n, p in self.m.pubs.items() if p.meta in ("ok", "nofiles")
                   and (self.root / n / "meta.json").is_file()]
        if not folders:
            return
        name = self.rng.choice(sorted(folders))
        path = self.root / name / "meta.json"
        meta = json.loads(path.read_text())
        meta.pop("files", None)
        kind = "nofiles"
        if self.rng.random() < 0.5:
            meta.pop("model_blake2b", None)
            kind = "nodigest"
        path.write_text(json.dumps(meta))
        self.m.pubs[name].meta = kind
        self.trail[-1] += f"({name} {kind})"

    def stray(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        key = self.rng.choice([NAME, f"{NAME}.dynamo"])
        kind = self.rng.choice(["tmp", "old", "lock"])
        if kind == "lock":
            (self.root / f".{key}.lock").write_text("stale")
            return
        d = Path(tempfile.mkdtemp(prefix=f".{key}.{'old.' if kind == 'old' else ''}",
                                  dir=self.root))
        (d / "model.onnx").write_bytes(b"\0" * 64)
        self.m.strays[key] = self.m.strays.get(key, 0) + 1

    def source(self) -> None:
        side = self.rng.choice(["a", "b"])
        what = self.rng.choice(["weights", "weights", "tokenizer", "readme", "copy"])
        if what == "copy":
            other = "b" if side == "a" else "a"
            self.m.content[side] = list(self.m.content[other])
        else:
            i = ["weights", "tokenizer", "readme"].index(what)
            self.m.content[side][i] = self.rng.randrange([3, 2, 3][i])
        self.write_model(side)
        self.trail[-1] += f"({side} {what} -> {self.m.content[side]})"

    def step(self) -> None:
        ops = [("ensure", self.ensure_here, 5), ("embed", self.embed_here, 4),
               ("damage", self.damage, 6), ("older", self.older_meta, 1),
               ("stray", self.stray, 2), ("source", self.source, 3)]
        if self.children:
            ops += [("concurrent", self.concurrent, 1), ("kill", self.killed, 2),
                    ("readonly", self.readonly, 1 if CAN_READONLY else 0)]
        take_step(self, ops)


def run_seed(seed: int, base: Path, steps: int, children: bool = True) -> dict[str, int]:
    run = Run(seed, base, children)
    undo = install_fakes(run.log)
    try:
        for _ in range(steps):
            run.step()
        for side in ("a", "b"):  # whatever the sequence left, both load
            run.trail.append(f"final embed {side}")
            want, _ = run.m.target(run.root, side, "torchscript")
            got = embed_like(run.m.dirs[side], run.cache, "torchscript")
            assert run.m.whole(got, side, "torchscript"), run.ctx()
    finally:
        undo()
        for p in (run.cache, run.root):
            if p.exists():
                p.chmod(0o755)
    return run.counts


def test_the_export_cache_answers_as_the_model_after_every_step():
    """Seeded sequences of ensures, loads, damage, strays, model folder changes, and (in real
    processes) concurrent, killed and read-only ensures: every answer as the model says."""
    base = Path(tempfile.mkdtemp(prefix="tiercache-onnx-diff-"))
    total = run_seeds(run_seed, base, SEEDS, STEPS)
    assert total.get("kill", 0) and total.get("concurrent", 0) and total.get("damage", 0), total


def test_the_stand_in_writes_the_meta_fields_a_real_export_does():
    """The stand-in's meta.json has the real export's fields (the session's export, when the
    semantic tests made one), so `_is_current` is tried on what it really reads."""
    import pytest

    from services.semantic.config import SemanticConfig, default_cache_dir

    cfg = SemanticConfig()
    real = onnx_export.export_folder(default_cache_dir(), cfg.resolved_model_name()) / "meta.json"
    if not real.is_file():
        pytest.skip("no real export in the cache yet (the semantic tests make one)")
    base = Path(tempfile.mkdtemp(prefix="tiercache-onnx-diff-"))
    try:
        run = Run(0, base, children=False)
        undo = install_fakes(run.log)
        try:
            got = onnx_export.ensure_onnx(run.m.dirs["a"], run.cache, NAME)
        finally:
            undo()
        mine = json.loads((got / "meta.json").read_text())
        theirs = json.loads(real.read_text())
        if "files" in theirs:
            assert set(mine) == set(theirs), (sorted(mine), sorted(theirs))
            assert set(mine["files"]) == set(theirs["files"])
    finally:
        shutil.rmtree(base, ignore_errors=True)
