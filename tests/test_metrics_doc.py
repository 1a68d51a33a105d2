"""docs/metrics.md lists every metric the services define (a metrics review: most were
documented nowhere), and is regenerated when one is added or changed."""

from pathlib import Path

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent


def _script():
    return load_script("metrics_doc")


def test_docs_metrics_md_is_current():
    doc = _script()
    assert doc.main(["--check"]) == 0, "run: python scripts/metrics_doc.py"


def test_every_defined_metric_is_in_the_file_under_its_exported_name():
    doc = _script()
    text = (ROOT / "docs/metrics.md").read_text(encoding="utf-8")
    rows = doc.collect()
    assert len(rows) >= 50
    for name, kind, *_ in rows:
        shown = name + ("_total" if kind == "counter" and not name.endswith("_total") else "")
        assert f"| `{shown}` | {kind} |" in text, shown
    # Removed by the review: a duplicate count, and a state that was the pool's size.
    assert "semantic_hits_too_short" not in text and "tiercache_kvpool_capacity_blocks" in text
