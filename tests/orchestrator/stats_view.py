"""The orchestrator's Stats handler over given cache tiers (no replicas, no model), served
over gRPC on loopback: what `tiercache stats` shows of those tiers."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from types import SimpleNamespace

from tiercache.v1 import orchestrator_pb2_grpc

from services.common.bootstrap import create_server
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.pipeline import OrchestratorStats
from services.orchestrator.server import OrchestratorServicer
from services.orchestrator.tenants import TenantRegistry


@contextlib.contextmanager
def stats_server(semantic, prefix=None) -> Iterator[str]:
    """The address of an orchestrator whose Stats reads `semantic` (a SemanticBackend) and
    `prefix` (a PrefixBackend or None); no tokens, so the caller is the admin."""
    cfg = OrchestratorConfig(kvpool_addresses=("h:1",))
    cfg.validate()
    s = OrchestratorServicer(cfg)
    orch = SimpleNamespace(stats=OrchestratorStats(), replicas=SimpleNamespace(replicas=[]),
                           semantic=semantic, prefix=prefix, model_id="m")
    s.attach(orch, TenantRegistry.build(tokens_file="", tokens="", key=b"k",
                                        max_prompt_tokens=100, max_tokens=100,
                                        max_concurrent=4))
    handle = create_server(service="orchestrator", address="127.0.0.1:0",
                           services=[(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server,
                                      s, "tiercache.v1.Orchestrator")],
                           authenticate=s.authenticate_call)
    handle.set_serving()
    try:
        yield handle.address
    finally:
        handle.stop(0)


def stats_via_cli(capsys, monkeypatch, semantic, prefix=None) -> tuple[dict, str]:
    """What `tiercache stats` prints of such an orchestrator: its JSON on stdout, and stderr.
    `capsys` and `monkeypatch` are the test's fixtures (the client's token and TLS variables
    are cleared: the server wants neither)."""
    from clients.python import cli

    for v in ("TIERCACHE_TOKEN", "TIERCACHE_TLS_CA", "TIERCACHE_TLS_CLIENT_CERT",
              "TIERCACHE_TLS_CLIENT_KEY"):
        monkeypatch.delenv(v, raising=False)
    capsys.readouterr()
    with stats_server(semantic, prefix) as addr:
        assert cli.main(["--address", addr, "--timeout", "30", "stats"]) == 0
    out = capsys.readouterr()
    return json.loads(out.out), out.err
