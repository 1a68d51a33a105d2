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

Process variables without the `TIERCACHE_` prefix, read by the libraries (or, where said, the
services) and set by the image (`deploy/docker/Dockerfile`), the manifests
(`deploy/k8s/base/config/common.env`, the pods' `env:`) or the service itself:
"""


# Process variables without the TIERCACHE_ prefix (HEADER's table): name, default, meaning.
PROCESS_VARS = (
    ("`HOME`",
     "the user's home; image `/home/tiercache`, manifests `/tmp`",
     "Where `~` leads: the cache folder when `TIERCACHE_CACHE_DIR` is unset "
     "(`~/.cache/tiercache`), a `~` in path settings, the CLI's sessions, and libraries' "
     "own caches. The manifests point it at the `/tmp` volume: the root filesystem is "
     "read-only."),
    ("`GRPC_DNS_RESOLVER`",
     "gRPC's own (c-ares); manifests `native`",
     "gRPC's name resolver for addresses to dial. `native` resolves with the system "
     "resolver, so short names such as `kvpool-0.kvpool` go through the pod's DNS search "
     "path."),
    ("`OMP_NUM_THREADS`",
     "unset: every core of the node; manifests the pod's CPU limit",
     "OpenMP threads of torch (kvpool's default `torch_threads` 0 and the orchestrator) "
     "and faiss; the semantic shard's bulk HNSW builds at start use this many (else every"
     " core). Unset in a pod, they oversubscribe its CPU quota and are throttled."),
    ("`OMP_WAIT_POLICY`",
     "`PASSIVE`, set by `python -m services.kvpool` unless given",
     "OpenMP workers sleep between parallel regions instead of spinning: right for "
     "replicas sharing cores (`services/kvpool/README.md`, Threads)."),
    ("`ONEDNN_PRIMITIVE_CACHE_CAPACITY`",
     "`256`, set by `python -m services.kvpool` unless given (oneDNN's own: 1,024)",
     "Compiled oneDNN kernels kept (~0.65 MiB each, four per new prefill length): at "
     "1,024 a replica's RSS rose 20 MiB a minute under steady traffic, 10.6 at 256 "
     "([deploy.md](deploy.md), Memory)."),
    ("`HF_HUB_DISABLE_PROGRESS_BARS`",
     "`1`, set by every service unless given",
     "Hugging Face progress bars off: their carriage returns broke the JSON log lines."),
    ("`GRPC_VERBOSITY`",
     "`ERROR`, set by every service unless given",
     "What gRPC's core writes to stderr, outside the JSON log lines: at `ERROR`, not one "
     "plain-text line per refused TLS handshake. `INFO` shows why a handshake failed "
     "([deploy.md](deploy.md), TLS)."),
    ("`HF_HOME`, `HF_HUB_OFFLINE`, `TRANSFORMERS_OFFLINE`",
     "image `/var/cache/tiercache/hf`, `1`, `1` (else the libraries' defaults: "
     "`~/.cache/huggingface`, online)",
     "The Hugging Face cache folder, and no downloads: every model the services use is "
     "local (the image's converted SmolLM2, the packaged all-MiniLM-L6-v2)."),
    ("`PYTHONPATH`, `PYTHONUNBUFFERED`, `PYTHONDONTWRITEBYTECODE`",
     "image `/app:/app/gen`, `1`, `1`",
     "The code and its generated gRPC modules on the path; log lines written at once; no "
     "`.pyc` written (the image compiles them at build)."),
    ("`POD_NAME`, `POD_IP`",
     "set by kvpool's manifest",
     "Not read by the service: the manifest makes `TIERCACHE_KVPOOL_REPLICA_ID` (the pod "
     "name) and `TIERCACHE_KVPOOL_ADVERTISE_ADDRESS` (`<pod IP>:50054`) from them."),
)


def _default(f: dataclasses.Field) -> str:
    shown = _shown_default(f)  # as --help shows it, but an empty string as ""
    return '""' if shown == "none" else shown


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def render() -> str:
    parts = [HEADER, "\n| variable | default | what it does |\n|---|---|---|\n"]
    parts += [f"| {name} | {default} | {meaning} |\n" for name, default, meaning in PROCESS_VARS]
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
