"""What the client tests' scripted Orchestrator servers share: serving one on a free local port,
the unary methods routed to one handler, and the client's environment cleared."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import grpc
from tiercache.v1 import orchestrator_pb2_grpc

# What the client and the CLI read from the environment (a developer's own must not leak in).
CLIENT_ENV = ("TIERCACHE_TOKEN", "TIERCACHE_ADDRESS", "TIERCACHE_TLS_CA",
              "TIERCACHE_TLS_CLIENT_CERT", "TIERCACHE_TLS_CLIENT_KEY")


@contextmanager
def serving(servicer, workers: int) -> Iterator[int]:
    """`servicer` as an Orchestrator on 127.0.0.1 (its port yielded), stopped at the end."""
    srv = grpc.server(ThreadPoolExecutor(workers))
    orchestrator_pb2_grpc.add_OrchestratorServicer_to_server(servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        yield port
    finally:
        srv.stop(0)


class UnaryScripted(orchestrator_pb2_grpc.OrchestratorServicer):
    """Warm, Feedback and Stats answered by the subclass's `_unary(method, request, context)`."""

    def _unary(self, method, request, context):
        raise NotImplementedError

    def Warm(self, request, context):  # noqa: N802
        return self._unary("Warm", request, context)

    def Feedback(self, request, context):  # noqa: N802
        return self._unary("Feedback", request, context)

    def Stats(self, request, context):  # noqa: N802
        return self._unary("Stats", request, context)


def clear_client_env(monkeypatch, home) -> None:
    """The CLI's home at `home` and none of CLIENT_ENV set (both restored after the test)."""
    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(home))
    for name in CLIENT_ENV:
        monkeypatch.delenv(name, raising=False)
