"""Write docs/metrics.md: every Prometheus metric the four services export, from their code.

    python scripts/metrics_doc.py            # rewrite docs/metrics.md
    python scripts/metrics_doc.py --check    # exit 1 if docs/metrics.md is out of date

Metrics are defined through `services.common.metrics` (one cache of them per process); this
imports every module of `services` (its `__main__`s aside), builds the ones made per instance
(kvpool's `KvMetrics`, the semantic cache's), and lists each with its type, labels and help text.
`tests/test_metrics_doc.py` keeps the file current.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import docgen  # noqa: E402 - beside this script (puts this checkout first on the path)

OUT = ROOT / "docs" / "metrics.md"
SECTIONS = (("rpc", "Every service"), ("kvpool", "kvpool"), ("prefix", "prefix"),
            ("semantic", "semantic"), ("orchestrator", "orchestrator"))

HEADER = """# Metrics

Every Prometheus metric the services export, generated from their code by
`python scripts/metrics_doc.py` (`tests/test_metrics_doc.py` fails when this file is out of
date). Each service serves them on its metrics port (`TIERCACHE_<SERVICE>_METRICS_PORT`; the
Kubernetes manifests use 9101-9104, `make run` none unless set) at `/metrics`, with the
process's own (`process_*`, `python_*`). Counters are exported with a `_total` suffix and a
`_created` series; histograms as `_bucket`, `_sum` and `_count`. Alerts worth having are in
[deploy.md](deploy.md); what each figure means for capacity in [capacity.md](capacity.md).
"""


def modules() -> list[str]:
    """Every module of `services` but the `__main__`s, found by file (services/semantic has no
    __init__.py, which pkgutil's walk skips). Not a list kept by hand: a metric defined in a
    module missing from one was left out of the page, and its test passed."""
    names = []
    for p in sorted((ROOT / "services").rglob("*.py")):
        parts = p.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def collect() -> list[tuple[str, str, str, tuple[str, ...], tuple[float, ...]]]:
    """(name, type, help, labels, buckets) of every metric defined, by name."""
    for m in modules():
        importlib.import_module(m)
    from services.common import metrics
    from services.kvpool.metrics import KvMetrics
    from services.semantic.cache import _metrics

    KvMetrics()
    _metrics()
    out = []
    for (kind, _), m in sorted(metrics._cache.items(), key=lambda kv: kv[0][1]):
        bounds = tuple(b for b in getattr(m, "_upper_bounds", ()) if b != float("inf"))
        out.append((m._name, kind.lower(), m._documentation, tuple(m._labelnames), bounds))
    return sorted(out)


def _section(name: str) -> str | None:
    for key, _ in SECTIONS:
        if name == f"tiercache_{key}" or name.startswith(f"tiercache_{key}_"):
            return key
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    rows = collect()
    parts = [HEADER]
    for key, title in SECTIONS:
        mine = [r for r in rows if _section(r[0]) == key]
        parts.append(f"\n## {title}\n\n| metric | type | labels | meaning |\n|---|---|---|---|\n")
        for name, kind, doc, labels, bounds in mine:
            shown = name + ("_total" if kind == "counter" and not name.endswith("_total")
                            else "")
            meaning = _cell(doc)
            if bounds:
                meaning += f" (buckets {', '.join(f'{b:g}' for b in bounds)})"
            parts.append(f"| `{shown}` | {kind} | {', '.join(labels) or '-'} | {meaning} |\n")
    missing = [r[0] for r in rows if _section(r[0]) is None]
    if missing:
        raise SystemExit(f"metrics outside every section: {', '.join(missing)}")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    return docgen.main(argv, OUT, render, "metrics", __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
