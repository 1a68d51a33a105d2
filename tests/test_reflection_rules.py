"""Rules of server reflection (services/common/reflection.py) a differential review found
unguarded (tests/test_grpc_client_differential.py)."""

from __future__ import annotations

import grpc
from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from tiercache.v1 import prefix_pb2_grpc

from services.common.bootstrap import create_server


def _ask_file_containing(symbols: list[str]) -> list:
    """One reflection stream to a fresh PrefixIndex server: file_containing_symbol for each
    of `symbols`, the answers in order."""
    h = create_server(service="refl-rules", address="127.0.0.1:0", services=[(
        prefix_pb2_grpc.add_PrefixIndexServicer_to_server, prefix_pb2_grpc.PrefixIndexServicer(),
        "tiercache.v1.PrefixIndex")])
    try:
        with grpc.insecure_channel(f"127.0.0.1:{h.port}") as ch:
            return list(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol=s)
                      for s in symbols]), timeout=10))
    finally:
        h.stop(0)


def test_a_methods_name_resolves_to_the_file_declaring_its_service(monkeypatch):
    """The reflection protocol names methods as symbols (`grpcurl describe
    tiercache.v1.PrefixIndex.Match` asks for one); protobuf's upb pool finds none, and every
    method was NOT_FOUND ("Symbol not found"), health's included. An unknown method of a
    known service is still NOT_FOUND."""
    for var in ("TIERCACHE_TLS_CA", "TIERCACHE_TLS_CERT", "TIERCACHE_TLS_KEY"):
        monkeypatch.delenv(var, raising=False)
    asks = ["tiercache.v1.PrefixIndex.Match", "grpc.health.v1.Health.Check",
            "tiercache.v1.PrefixIndex.Nope", "tiercache.v1.MatchRequest.Nope"]
    got = _ask_file_containing(asks)
    first = [descriptor_pb2.FileDescriptorProto.FromString(
        r.file_descriptor_response.file_descriptor_proto[0])
        if r.WhichOneof("message_response") == "file_descriptor_response" else None
        for r in got]
    assert first[0] is not None and first[0].name == "tiercache/v1/prefix.proto"
    assert first[0].source_code_info.location  # with the .proto comments
    assert first[1] is not None and first[1].name == "grpc_health/v1/health.proto"
    assert first[2:] == [None, None]
    not_found = grpc.StatusCode.NOT_FOUND.value[0]
    assert [r.error_response.error_code for r in got[2:]] == [not_found, not_found]


def test_without_the_descriptor_set_a_methods_name_still_resolves(monkeypatch, tmp_path):
    """With no descriptor set (not generated: source_info_pool() is None) the server handed
    the stock pool to the reflection servicer, and every method's name was NOT_FOUND again,
    though the compiled descriptors hold them; now only the comments are missing."""
    import importlib.util

    from services.common import reflection

    for var in ("TIERCACHE_TLS_CA", "TIERCACHE_TLS_CERT", "TIERCACHE_TLS_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(reflection, "DESCRIPTOR_SET", tmp_path / "none.pb")
    monkeypatch.setattr(importlib.util, "find_spec", lambda *a, **k: None)
    assert reflection.source_info_pool() is None
    asks = ["tiercache.v1.PrefixIndex.Match", "tiercache.v1.PrefixIndex.Nope"]
    got = _ask_file_containing(asks)
    assert got[0].WhichOneof("message_response") == "file_descriptor_response"
    first = descriptor_pb2.FileDescriptorProto.FromString(
        got[0].file_descriptor_response.file_descriptor_proto[0])
    assert first.name == "tiercache/v1/prefix.proto" and not first.source_code_info.location
    assert got[1].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]
