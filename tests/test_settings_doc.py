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
