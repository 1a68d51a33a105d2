"""The orchestrator's Stats handler over given cache tiers (no replicas, no model), served
over gRPC on loopback: what `tiercache stats` shows of those tiers."""

from __future__ import annotations

import contextlib
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
                           semantic=semantic, prefix=prefix)
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
