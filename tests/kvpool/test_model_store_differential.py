"""A differential review of the packaged model's conversion cache (services/common/model_store.py):
seeded random sequences of resolves, loads, concurrent and killed conversions, and damage to the
cache, each answer compared with a reference model of the module's docs after every step.

The slow step is stood in for: `_load_gguf` returns a model and tokenizer whose
`save_pretrained` write small files (a real safetensors file among them) derived from the GGUF's
bytes and the transformers version, so "from the current source" is checkable byte by byte.
Everything around it is the real code: `source_id`, the file lock, the temp folder, marker,
chmod, fsync, `_publish`, `is_converted`, `load_resolved`. Concurrent and killed conversions run
in real processes (the flock matters); a kill is a SIGKILL the process sends itself at a chosen
point (loading, half-way through the weights, between tokenizer files, before each fsync, before
or inside `remove_aside`, after the rename).

The model (from the module docstring, `is_converted`'s and `load_resolved`'s): the next resolve
converts iff the folder is gone, its marker unreadable, of another source (GGUF content or
transformers major), or a file the marker lists is gone or of another size, or (a marker with
digests) a file other than the weights changed in content; a marker without digests is judged
by sizes only, one without sizes by each safetensors file being as long as its header says
(both documented as accepted, so damage they miss is reused). `load_resolved`, with a loader
that fails on any file not as the current source gives it, converts again once and then loads a
whole folder. Concurrent resolvers convert once; a process waiting on the lock of one that was
killed goes on (never a hang). After a kill the folder is as before the conversion (killed
before `remove_aside` renamed it), gone (killed inside or just after it), or the new one (killed
after the rename). A conversion leaves no `.<name>.tmp-*` / `.<name>.old-*` behind and every
file 0644 (folder 0755); leftovers never exceed those of the last killed conversion plus the
strays planted since; the models folder holds nothing else but the lock file. With the cache
folder read-only (a process without CAP_DAC_OVERRIDE), a whole conversion is reused and one to
be redone is an error naming a path under the cache folder. Where the docs are silent (a marker
damaged in place but still JSON) only the invariants are asserted: reuse or convert, whole.

Run in the review: 510 seeds of 40 steps (about 1,500 kill steps, 700 concurrent rounds of
2-3 processes, 780 read-only resolves). Found and fixed (test_model_store_rules.py
guards it deterministically): a marker from before sizes were recorded, over a folder whose
weights were deleted, was trusted (the header check passed on no file at all) and the folder
reused without weights. Left as documented: weights damaged in place at their size are reused
by `resolve_model` (`load_resolved` converts them again), damage to other files under an older
marker is reused, and a file added to the published folder is not noticed (the docs are silent).

Bugs injected to check the harness has teeth (failing seeds of 20): digests not compared 7; no
second look under the lock 12; leftovers not removed 20; the source id without the
transformers version 2; `load_resolved` converting again without `broken=` 5.

More seeds: TIERCACHE_MODEL_STORE_DIFF_SEEDS=400 (default 5 here, 40 steps each).
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
from services.common import model_store
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
SEEDS = int(os.environ.get("TIERCACHE_MODEL_STORE_DIFF_SEEDS", "5"))
STEPS = int(os.environ.get("TIERCACHE_MODEL_STORE_DIFF_STEPS", "40"))
NAME = model_store.SMOLLM2_MODEL_ID
WEIGHTS = "model.safetensors"
CHILD_TIMEOUT = 60.0
GGUFS = [b"gguf v1", b"gguf v2 " * 3, b"gguf v3!", b"gguf v4 " * 50]
KILLS = ["load", "weights-half", "tokenizer", "aside-before", "aside-mid", "aside-after",
         *[f"fsync-{n}" for n in range(1, 9)]]


# ---- the stand-in for the slow GGUF parse (used in this process and in the children) ---------

def fake_files(gguf: bytes, tv: str) -> dict[str, bytes]:
    """What converting `gguf` under transformers `tv` writes (the marker aside)."""
    h = hashlib.blake2b(gguf + tv.encode(), digest_size=8).hexdigest()
    n = 64 * (2 + int(h[0], 16) % 3)  # three weight sizes: versions often share one
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    data = (h.encode() * n)[:n]
    return {"config.json": json.dumps({"model_type": "llama", "src": h}).encode(),
            WEIGHTS: len(header).to_bytes(8, "little") + header + data,
            "tokenizer.json": json.dumps({"tok": h}).encode(),
            "chat_template.jinja": ("{{ messages }}" + h).encode(),
            "generation_config.json": b'{"eos_token_id": 2}'}


def install_fakes(gguf: Path, log: Path, kill: str | None = None, hold: float = 0.0,
                  started: Path | None = None):
    """Patches model_store for the stand-in conversion; returns the undo."""
    undo = saving([(model_store, "_load_gguf"), (model_store, "packaged_gguf_path"),
                  (model_store, "fsync_path"), (model_store, "remove_aside"),
                  (files_mod, "shutil")])
    fsyncs = [0]

    class Model:
        config = None

        def save_pretrained(self, folder, safe_serialization=True) -> None:
            out = fake_files(self.src, self.tv)
            (Path(folder) / "config.json").write_bytes(out["config.json"])
            if kill == "weights-half":
                (Path(folder) / WEIGHTS).write_bytes(out[WEIGHTS][: len(out[WEIGHTS]) // 2])
                die()
            (Path(folder) / WEIGHTS).write_bytes(out[WEIGHTS])

    class Tokenizer:
        def save_pretrained(self, folder) -> None:
            out = fake_files(self.src, self.tv)
            (Path(folder) / "tokenizer.json").write_bytes(out["tokenizer.json"])
            if kill == "tokenizer":
                die()
            for name in ("chat_template.jinja", "generation_config.json"):
                (Path(folder) / name).write_bytes(out[name])

    def load(g: Path):
        starting(log, started, hold)
        if kill == "load":
            die()
        import transformers

        m, t = Model(), Tokenizer()
        m.src = t.src = Path(g).read_bytes()
        m.tv = t.tv = transformers.__version__.split(".")[0]
        return m, t

    real_fsync = files_mod.fsync_path

    def fsync_path(p) -> None:
        fsyncs[0] += 1
        if kill == f"fsync-{fsyncs[0]}":
            die()
        real_fsync(p)

    model_store._load_gguf = load
    model_store.packaged_gguf_path = lambda: gguf
    model_store.fsync_path = fsync_path
    model_store.remove_aside = killable_remove_aside(kill)

    return undo


def strict_loader(gguf: bytes, tv: str, failed: list[str] | None = None):
    """A load that fails on any file not as converting the current source writes it (each
    failure noted in `failed`)."""
    want = fake_files(gguf, tv)

    def load(path: str) -> str:
        for name, data in want.items():
            try:
                got = (Path(path) / name).read_bytes()
            except OSError:
                got = None
            if got != data:
                if failed is not None:
                    failed.append(name)
                raise ValueError(f"{name} is damaged, stale or gone")
        return "loaded"

    return load


CHILD = r"""
import json, sys, types
a = json.loads(sys.argv[1])
# source_id reads only transformers' version: the library itself is not needed here
sys.modules["transformers"] = types.SimpleNamespace(__version__=a["tv"])
from pathlib import Path
from services.common import model_store
from tests.kvpool.test_model_store_differential import install_fakes, strict_loader
install_fakes(Path(a["gguf"]), Path(a["log"]), a["kill"], a["hold"],
              Path(a["started"]) if a["started"] else None)
try:
    if a["op"] == "load":
        src = Path(a["gguf"]).read_bytes()
        r, got = model_store.load_resolved("smollm2", a["cache"], None,
                                           strict_loader(src, a["tv"].split(".")[0]))
    else:
        r = model_store.resolve_model("smollm2", cache_dir=a["cache"])
    print(json.dumps({"path": r.path}))
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


def _child(op: str, cache: Path, gguf: Path, log: Path, tv: str, kill: str | None = None,
           hold: float = 0.0, started: Path | None = None, readonly: bool = False):
    arg = {"op": op, "cache": str(cache), "gguf": str(gguf), "log": str(log),
           "tv": tv, "kill": kill, "hold": hold,
           "started": str(started) if started else ""}
    return python_child(CHILD, arg, readonly)


# ---- the reference model -----------------------------------------------------------------

class Model:
    """The cache as the docs describe it: what the published folder was converted from, what
    its marker still records, and which of its damage the marker's kind can see."""

    def __init__(self) -> None:
        self.src = GGUFS[0]
        self.tv = "5"  # transformers major
        self.pub: tuple[bytes, str] | None = None  # (gguf, tv) of the published conversion
        self.marker = "ok"  # ok | nodigests | old | bad | fuzz
        self.header_hit = False  # weights damaged in place inside their safetensors header
        self.strays = 0  # leftovers planted since the last conversion
        self.killed_left = 0  # leftovers a killed conversion may have left

    def written(self) -> dict[str, bytes]:
        assert self.pub is not None
        return fake_files(*self.pub)

    def decision(self, target: Path) -> str:
        """"convert", "reuse" or "either" for the next resolve_model."""
        if not target.is_dir() or self.pub is None or self.marker == "bad":
            return "convert"
        if self.marker == "fuzz":
            return "either"
        if self.pub != (self.src, self.tv):
            return "convert"
        written = self.written()
        if self.marker == "old":
            w = target / WEIGHTS
            if not w.is_file() or w.stat().st_size != len(written[WEIGHTS]):
                return "convert"
            return "either" if self.header_hit else "reuse"
        for name, data in written.items():
            p = target / name
            if not p.is_file() or p.stat().st_size != len(data):
                return "convert"
            if self.marker == "ok" and name != WEIGHTS and p.read_bytes() != data:
                return "convert"
        return "reuse"

    def whole(self, target: Path) -> bool:
        want = fake_files(self.src, self.tv)
        return target.is_dir() and _snapshot(target, marker=False) == want

    def converted(self) -> None:
        self.pub, self.marker, self.header_hit = (self.src, self.tv), "ok", False
        self.strays = self.killed_left = 0


def _snapshot(folder: Path, marker: bool = True) -> dict[str, bytes]:
    return {f.relative_to(folder).as_posix(): f.read_bytes() for f in sorted(folder.rglob("*"))
            if f.is_file() and (marker or f.name != model_store._DONE_MARKER)}


def _leftovers(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir()
                  if p.name.startswith((f".{NAME}.tmp-", f".{NAME}.old-")))



class Run:
    def __init__(self, seed: int, base: Path, children: bool = True) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.base = base
        self.cache = base / "cache"
        self.models = self.cache / "models"
        self.target = self.models / NAME
        self.gguf = base / "pkg" / "x.gguf"
        self.gguf.parent.mkdir(parents=True, exist_ok=True)
        self.log = base / "conversions.log"
        self.m = Model()
        self.gguf.write_bytes(self.m.src)
        self.children = children
        self.trail: list[str] = []
        self.counts: dict[str, int] = {}

    # -- helpers --
    def ctx(self) -> str:
        return f"seed {self.seed}: " + " / ".join(self.trail[-12:])

    def tvs(self) -> str:
        return {"5": _REAL_TV, "99": "99.0.0"}[self.m.tv]

    def check_after(self, decision: str, converted: int, pre: dict | None) -> None:
        c = self.ctx()
        if decision == "convert":
            assert converted == 1, (c, converted)
        elif decision == "reuse":
            assert converted == 0, (c, converted)
        else:
            assert converted in (0, 1), (c, converted)
        if converted:
            assert self.m.whole(self.target), c
            self.check_marker_and_modes()
            assert _leftovers(self.models) == [], (c, _leftovers(self.models))
            self.m.converted()
        else:
            assert pre is not None and _snapshot(self.target) == pre, (c, "reused but changed")
        self.check_invariants()

    def check_marker_and_modes(self) -> None:
        c = self.ctx()
        assert stat.S_IMODE(self.target.stat().st_mode) == 0o755, c
        for f in self.target.iterdir():
            assert stat.S_IMODE(f.stat().st_mode) == 0o644, (c, f)
        assert model_store.is_converted(self.target, model_store.source_id(self.gguf)), c

    def check_invariants(self) -> None:
        c = self.ctx()
        if not self.models.exists():
            return
        others = {p.name for p in self.models.iterdir()} - set(_leftovers(self.models))
        assert others <= {NAME, f".{NAME}.lock"}, (c, others)
        assert len(_leftovers(self.models)) <= self.m.strays + self.m.killed_left, (
            c, _leftovers(self.models), self.m.strays, self.m.killed_left)

    def pre(self) -> dict | None:
        return _snapshot(self.target) if self.target.is_dir() else None

    # -- operations --
    def resolve_here(self) -> None:
        d, pre = self.m.decision(self.target), self.pre()
        before = lines_in(self.log)
        got = model_store.resolve_model("smollm2", cache_dir=str(self.cache))
        assert got.path == str(self.target) and got.model_id == NAME, self.ctx()
        self.check_after(d, lines_in(self.log) - before, pre)

    def load_here(self) -> None:
        d, pre = self.m.decision(self.target), self.pre()
        before = lines_in(self.log)
        whole_if_reused = d == "reuse" and self.m.whole(self.target)
        failed: list[str] = []
        got, what = model_store.load_resolved("smollm2", str(self.cache), None,
                                              strict_loader(self.m.src, self.m.tv, failed))
        n = lines_in(self.log) - before
        assert what == "loaded" and got.path == str(self.target), self.ctx()
        if d == "reuse":  # converted again once iff the folder did not load
            assert n == (0 if whole_if_reused else 1), (self.ctx(), n)
            assert len(failed) == n, (self.ctx(), failed)
        else:  # converted before anything loads it, not only once the load failed
            assert n in ((1,) if d == "convert" else (0, 1)), (self.ctx(), n)
            assert failed == [] or d == "either", (self.ctx(), failed)
        assert self.m.whole(self.target), self.ctx()
        if n:
            assert _leftovers(self.models) == [], self.ctx()
            self.check_marker_and_modes()
            self.m.converted()
        else:
            assert _snapshot(self.target) == pre, self.ctx()
        self.check_invariants()

    def concurrent(self) -> None:
        d, pre = self.m.decision(self.target), self.pre()
        if d == "either":
            return self.resolve_here()
        k = self.rng.choice([2, 3])
        ops = [self.rng.choice(["resolve", "load"]) for _ in range(k)]
        self.trail[-1] += f"{ops}"
        needs_load = "load" in ops and not self.m.whole(self.target)
        before = lines_in(self.log)
        procs = [_child(op, self.cache, self.gguf, self.log, self.tvs(), hold=0.2)
                 for op in ops]
        outs = json_answers(procs, self.ctx(), CHILD_TIMEOUT)
        n = lines_in(self.log) - before
        for o in outs:
            assert o == {"path": str(self.target)}, (self.ctx(), o)
        if d == "convert" or needs_load:
            assert n == 1, (self.ctx(), n, "concurrent conversions")
            assert self.m.whole(self.target) and _leftovers(self.models) == [], self.ctx()
            self.check_marker_and_modes()
            self.m.converted()
        else:
            assert n == 0, (self.ctx(), n)
            assert _snapshot(self.target) == pre, self.ctx()
        self.check_invariants()

    def killed(self) -> None:
        d, pre = self.m.decision(self.target), self.pre()
        op = self.rng.choice(["resolve", "load"])
        if d == "either" or (d == "reuse" and (op == "resolve" or self.m.whole(self.target))):
            return self.resolve_here()  # nothing would convert: no kill to inject
        kill = self.rng.choice(KILLS)
        if not self.target.exists() and kill.startswith("aside"):
            kill = "fsync-8"  # nothing to rename aside
        waiter = d == "convert" and self.rng.random() < 0.5
        self.trail[-1] += f"({op} killed at {kill}{', a waiter' if waiter else ''})"
        started = self.base / f"started-{len(self.trail)}"
        before = lines_in(self.log)
        procs = [_child(op, self.cache, self.gguf, self.log, self.tvs(), kill=kill,
                        hold=0.3 if waiter else 0.0, started=started)]
        if waiter:
            wait_started(started, procs[0], CHILD_TIMEOUT, self.ctx())
            procs.append(_child("resolve", self.cache, self.gguf, self.log, self.tvs()))
        outs = json_answers(procs, self.ctx(), CHILD_TIMEOUT)
        c = self.ctx()
        assert outs[0] is None, (c, "not killed", outs[0])
        self.m.killed_left = 2  # its temp folder, and the stale one renamed aside
        # The folder after the kill, as the model has it.
        if kill == "fsync-8":
            assert self.m.whole(self.target), c
            self.m.converted()
        elif kill in ("aside-mid", "aside-after"):
            assert not self.target.exists() or (waiter and self.m.whole(self.target)), c
            if not waiter:
                self.m.pub = None
        else:
            assert waiter or self.pre() == pre, c
        n = lines_in(self.log) - before
        if waiter:
            assert outs[1] == {"path": str(self.target)}, (c, outs[1])
            # the waiter took the lock once the killed one died, and converted iff needed
            assert n == (1 if kill == "fsync-8" else 2), (c, n)
            assert self.m.whole(self.target) and _leftovers(self.models) == [], c
            self.check_marker_and_modes()
            self.m.converted()
        else:
            assert n == 1, (c, n)
        self.check_invariants()

    def readonly(self) -> None:
        d, pre = self.m.decision(self.target), self.pre()
        self.models.mkdir(parents=True, exist_ok=True)
        with read_only(self.cache, self.models):
            before = lines_in(self.log)
            [out] = json_answers([_child("resolve", self.cache, self.gguf, self.log, self.tvs(),
                                         readonly=True)], self.ctx(), CHILD_TIMEOUT)
        c = self.ctx()
        assert lines_in(self.log) == before, c
        if out.get("path"):
            assert d in ("reuse", "either") and out["path"] == str(self.target), (c, out)
        else:
            assert d in ("convert", "either"), (c, out)
            assert out["error"] in ("PermissionError", "ModelStoreError"), (c, out)
            assert str(self.models) in out["message"], (c, out)
        assert self.pre() == pre, c
        self.check_invariants()

    # -- damage --
    def damage(self) -> None:
        files = sorted(p for p in self.target.iterdir() if p.is_file()) \
            if self.target.is_dir() else []
        if not files:
            return
        f = self.rng.choice(files)
        kind = self.rng.choice(["truncate", "grow", "flip", "delete"])
        self.trail[-1] += f"({kind} {f.name})"
        data = f.read_bytes()
        is_marker = f.name == model_store._DONE_MARKER
        if kind == "delete":
            f.unlink()
            if is_marker:
                self.m.marker = "bad"
            return
        if kind == "truncate":
            f.write_bytes(data[: self.rng.randrange(len(data))] if data else b"")
            if is_marker:
                self.m.marker = "bad"
            return
        if kind == "grow":
            f.write_bytes(data + b"\0" * self.rng.randint(1, 9))
            if is_marker:
                self.m.marker = "bad"  # trailing NULs: no JSON
            return
        if not data:
            return
        at = self.rng.randrange(len(data))
        n = self.rng.randint(1, 4)
        new = bytearray(data)
        for i in range(at, min(at + n, len(data))):
            new[i] = self.rng.choice([0, 0x30 + self.rng.randrange(10), 0xFF, ord('"')])
        f.write_bytes(bytes(new))
        if bytes(new) == data:
            return
        if is_marker:
            self.m.marker = "fuzz"  # may still be JSON: the docs are silent
        elif f.name == WEIGHTS and at < 8 + int.from_bytes(data[:8], "little"):
            self.m.header_hit = True

    def marker_kind(self) -> None:
        p = self.target / model_store._DONE_MARKER
        if self.m.marker not in ("ok", "nodigests") or not p.is_file():
            return
        meta = json.loads(p.read_text())
        meta.pop("digests", None)
        kind = "nodigests"
        if self.rng.random() < 0.5:
            meta.pop("files", None)
            kind = "old"
        p.write_text(json.dumps(meta))
        self.m.marker = kind
        self.trail[-1] += f"({kind})"

    def stray(self) -> None:
        self.models.mkdir(parents=True, exist_ok=True)
        kind = self.rng.choice(["tmp", "old", "lock"])
        if kind == "lock":
            (self.models / f".{NAME}.lock").write_text("stale")
            return
        d = Path(tempfile.mkdtemp(prefix=f".{NAME}.{kind}-", dir=self.models))
        (d / WEIGHTS).write_bytes(b"\0" * 100)
        if self.rng.random() < 0.5:
            (d / "sub").mkdir()
            (d / "sub" / "x").write_text("x")
        self.m.strays += 1

    def source(self) -> None:
        if self.rng.random() < 0.15:
            self.m.tv = "99" if self.m.tv == "5" else "5"
            self.trail[-1] += f"(transformers {self.m.tv})"
        else:
            self.m.src = self.rng.choice(GGUFS)
            self.gguf.write_bytes(self.m.src)
            self.trail[-1] += f"(gguf {GGUFS.index(self.m.src) + 1})"

    def drop_folder(self) -> None:
        if self.target.exists():
            shutil.rmtree(self.target)
        self.m.pub = None

    def step(self) -> None:
        ops = [("resolve", self.resolve_here, 5), ("load", self.load_here, 4),
               ("damage", self.damage, 6), ("marker", self.marker_kind, 1),
               ("stray", self.stray, 2), ("source", self.source, 2),
               ("drop", self.drop_folder, 1)]
        if self.children:
            ops += [("concurrent", self.concurrent, 1), ("kill", self.killed, 2),
                    ("readonly", self.readonly, 1 if CAN_READONLY else 0)]
        take_step(self, ops)


_REAL_TV = ""


def run_seed(seed: int, base: Path, steps: int, children: bool = True) -> dict[str, int]:
    """One seeded sequence; returns how many of each operation ran."""
    global _REAL_TV
    import transformers

    real = transformers.__version__
    _REAL_TV = real if real.split(".")[0] == "5" else "5.0.0"
    run = Run(seed, base, children)
    undo = install_fakes(run.gguf, run.log)
    try:
        for _ in range(steps):
            transformers.__version__ = run.tvs()
            run.step()
        # whatever the sequence left, the next load gives a whole folder of the current source
        run.trail.append("final load")
        transformers.__version__ = run.tvs()
        run.load_here()
    finally:
        transformers.__version__ = real
        undo()
        for p in (run.cache, run.models):
            if p.exists():
                p.chmod(0o755)
    return run.counts


def _base() -> Path:
    # Readable along the whole path: the read-only step's child runs without root's overrides.
    d = Path(tempfile.mkdtemp(prefix="tiercache-store-diff-"))
    d.chmod(0o755)
    return d


def test_the_conversion_cache_answers_as_the_model_after_every_step():
    """Seeded sequences of resolves, loads, damage, strays, source changes, and (in real
    processes) concurrent, killed and read-only resolves: every decision and folder as the
    model says."""
    base = _base()
    total = run_seeds(run_seed, base, SEEDS, STEPS)
    assert total.get("kill", 0) and total.get("concurrent", 0) and total.get("damage", 0), total
