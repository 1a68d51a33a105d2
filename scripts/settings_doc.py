"""Write docs/settings.md: every setting of the four services, from their config classes.

    python scripts/settings_doc.py            # rewrite docs/settings.md
    python scripts/settings_doc.py --check    # exit 1 if docs/settings.md is out of date

Each field of a service's config dataclass is a setting: `TIERCACHE_<SERVICE>_<FIELD>` or the
flag `--field-name` (`services/common/config.py`). Its default comes from the class, and its
description from the comment written with it in the source (the lines just above the field,
or the comment after it). `tests/test_settings_doc.py` keeps the file current.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
import docgen  # noqa: E402 - beside this script (puts this checkout first on the path)

from services.common.config import _shown_default, field_notes  # noqa: E402 - this checkout's

OUT = ROOT / "docs" / "settings.md"
CLASSES = (("orchestrator", "services.orchestrator.config", "OrchestratorConfig"),
           ("semantic", "services.semantic.config", "SemanticConfig"),
           ("prefix", "services.prefix.config", "PrefixConfig"),
           ("kvpool", "services.kvpool.config", "KvPoolConfig"))

HEADER = """# Settings

Every setting of the four services, generated from their config classes by
`python scripts/settings_doc.py` (`tests/test_settings_doc.py` fails when this file is out of
date). A setting `foo_bar` of service `svc` is read from `TIERCACHE_SVC_FOO_BAR`, and a flag
`--foo-bar` given to `python -m services.svc` wins over it (`--help` lists them, each with
the first sentence of its meaning below). Values are checked at start: a bad one stops the
service with exit 2 and a line naming the variable (or flag), as does a `TIERCACHE_` variable
that is no setting. Shared settings, read by
every service that needs them: `TIERCACHE_TLS_CERT` / `_KEY` / `_CA` / `_CLIENT_CERT` /
`_CLIENT_KEY` (TLS, [reliability.md](reliability.md); per service
`TIERCACHE_<SERVICE>_TLS_CERT` / `_KEY` replace the server's pair and
`TIERCACHE_<SERVICE>_TLS_CLIENT_AUTH=none` stops that server requiring client certificates
under the CA, [deploy.md](deploy.md)), `TIERCACHE_HASH_KEY` (the cluster's
block-hash and entry-signing key, [deploy.md](deploy.md)), `TIERCACHE_CACHE_DIR` (models and
the semantic database, default `~/.cache/tiercache`), `TIERCACHE_LOG_LEVEL`,
`TIERCACHE_DRAIN_DELAY_S`, `TIERCACHE_PURE_PYTHON_HASH` (`1`: hashlib in place of the C block
hasher, the same digests). The launcher (`make run`) reads `TIERCACHE_REPLICAS` and sets
`TIERCACHE_PARENT_PID` on its services (each stops when that process is gone); the CLI
`TIERCACHE_ADDRESS`, `TIERCACHE_TOKEN`, `TIERCACHE_CLI_HOME` and the TLS client variables
(`TIERCACHE_TLS_CA`, `_CLIENT_CERT`, `_CLIENT_KEY`); the benchmarks and
`python -m services.semantic.fit_verifier` read their labelled data from `TIERCACHE_DATA_DIR`
(default `../shared/data` beside the repository); the tests read `TIERCACHE_TEST_DEVICE`
(`cuda` for `tests/device`) and `TIERCACHE_TEST_LOGS` (the e2e log folder, then kept).
"""


def _default(f: dataclasses.Field) -> str:
    shown = _shown_default(f)  # as --help shows it, but an empty string as ""
    return '""' if shown == "none" else shown


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def render() -> str:
    parts = [HEADER]
    for service, module, name in CLASSES:
        cls = getattr(importlib.import_module(module), name)
        notes = field_notes(cls)
        parts.append(f"\n## {service}\n\n| variable | default | meaning |\n|---|---|---|\n")
        for f in dataclasses.fields(cls):
            var = f"TIERCACHE_{service.upper()}_{f.name.upper()}"
            parts.append(f"| `{var}` | `{_cell(_default(f))}` | {_cell(notes.get(f.name, ''))} |\n")
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    return docgen.main(argv, OUT, render, "settings", __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
