"""docs/settings.md lists every setting of the four services with its real default and the
comment written with it (a config review: ~40 settings were documented nowhere), and is
regenerated when one is added or changed."""

import dataclasses
import importlib
from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


def _script():
    return load_script("settings_doc")


def test_docs_settings_md_is_current():
    assert _script().main(["--check"]) == 0, "run: python scripts/settings_doc.py"


def test_every_setting_is_listed_with_its_default_and_a_description():
    doc = _script()
    text = (ROOT / "docs/settings.md").read_text(encoding="utf-8")
    for service, module, name in doc.CLASSES:
        cls = getattr(importlib.import_module(module), name)
        for f in dataclasses.fields(cls):
            var = f"TIERCACHE_{service.upper()}_{f.name.upper()}"
            row = next((ln for ln in text.splitlines() if ln.startswith(f"| `{var}` |")), None)
            assert row is not None, var
            assert row.split("|")[3].strip(), f"{var}: no comment with the field in {module}"
    assert "| `TIERCACHE_KVPOOL_KV_CACHE_BYTES` | `536870912` |" in text


def test_every_shared_name_the_services_accept_is_named():
    """A `TIERCACHE_` name outside every service's prefix is accepted at start only when it is
    in SHARED_NAMES; each of those is named in the page's opening paragraph, so a reader finds
    what it does (TIERCACHE_DATA_DIR and TIERCACHE_PURE_PYTHON_HASH were accepted and named
    nowhere in it)."""
    from services.common.config import SHARED_NAMES

    head = (ROOT / "docs/settings.md").read_text(encoding="utf-8").split("\n## ")[0]
    missing = sorted(n for n in SHARED_NAMES if f"TIERCACHE_{n}`" not in head
                     and not (n.startswith("TLS_") and f"`_{n[4:]}`" in head))
    assert not missing, f"not in docs/settings.md's opening paragraph: {missing}"


def test_every_process_variable_the_manifests_image_or_services_set_is_named():
    """HOME, GRPC_DNS_RESOLVER, OMP_NUM_THREADS (the manifests), the image's ENV and what
    `python -m services.kvpool` sets unless given (ONEDNN_PRIMITIVE_CACHE_CAPACITY,
    OMP_WAIT_POLICY) were explained only in manifest and source comments: each is named, with
    what it does and its default, in docs/settings.md's opening part."""
    import re

    names = set()
    for path in (ROOT / "deploy/k8s").rglob("*.env"):  # the manifests' config maps
        for line in path.read_text().splitlines():
            if line.strip() and not line.startswith("#"):
                names.add(line.split("=", 1)[0].strip())
    for path in (ROOT / "deploy/k8s").rglob("*.yaml"):  # the base, overlays and components
        names |= set(re.findall(r"^\s*- name: ([A-Z][A-Z0-9_]+)\s*(?:#.*)?$", path.read_text(),
                                re.MULTILINE))
    docker = (ROOT / "deploy/docker/Dockerfile").read_text().split("AS runtime")[1]
    for env_block in re.findall(r"^ENV ((?:.*\\\n)*.*)", docker, re.MULTILINE):  # the runtime's
        names |= set(re.findall(r"\b([A-Z][A-Z0-9_]+)=", env_block)) - {"PATH"}
    for path in (ROOT / "services").rglob("*.py"):
        # Set unless given, or read (semantic's bulk builds read OMP_NUM_THREADS).
        names |= set(re.findall(r'os\.(?:environ(?:\.setdefault|\.get)?|getenv)[(\[]"([A-Z0-9_]+)"',
                                path.read_text()))
    names = {n for n in names if not n.startswith("TIERCACHE_")}
    assert {"HOME", "GRPC_DNS_RESOLVER", "OMP_NUM_THREADS",
            "ONEDNN_PRIMITIVE_CACHE_CAPACITY", "OMP_WAIT_POLICY"} <= names
    head = (ROOT / "docs/settings.md").read_text(encoding="utf-8").split("\n## ")[0]
    missing = sorted(n for n in names if f"`{n}`" not in head)
    assert not missing, f"not in docs/settings.md's opening part: {missing}"
