"""`tiercache warm`'s exit status (pure logic: a fake client answering WarmResponses)."""

from __future__ import annotations

import argparse
import json

import pytest
from tiercache.v1 import orchestrator_pb2

from clients.python.cli import cmd_warm


class FakeWarmClient:
    def __init__(self, resp: orchestrator_pb2.WarmResponse) -> None:
        self.resp = resp
        self.calls: list[tuple] = []

    def warm(self, prompts, **kw):
        self.calls.append((prompts, kw))
        return self.resp


def warm_args(system: str = "You are terse.", raw: bool = False) -> argparse.Namespace:
    return argparse.Namespace(system=system, top_k=0, owners=False, ttl=0, raw=raw)


def result(rid: str, error: str = "") -> orchestrator_pb2.WarmResult:
    return orchestrator_pb2.WarmResult(replica_id=rid, prompt_tokens=10, computed_tokens=10,
                                       error=error)


def test_warm_exits_0_when_every_replica_was_warmed(capsys):
    c = FakeWarmClient(orchestrator_pb2.WarmResponse(results=[result("A"), result("B")]))
    assert cmd_warm(c, warm_args()) == 0
    assert c.calls == [(["You are terse."], dict(top_k=0, owners_only=False, pin_ttl_seconds=0,
                                                 raw=False))]
    shown = json.loads(capsys.readouterr().out)
    assert [r["replicaId"] for r in shown["results"]] == ["A", "B"]


@pytest.mark.parametrize("errors", [("", "kvpool B: UNAVAILABLE"), ("boom", ""),
                                    ("x", "y")])
def test_warm_exits_1_when_any_replica_failed(capsys, errors):
    resp = orchestrator_pb2.WarmResponse(
        results=[result(rid, err) for rid, err in zip("AB", errors, strict=True)])
    assert cmd_warm(FakeWarmClient(resp), warm_args()) == 1


@pytest.mark.parametrize("system", ["You are terse.", ""])
def test_warm_exits_1_when_nothing_was_warmed(capsys, system):
    assert cmd_warm(FakeWarmClient(orchestrator_pb2.WarmResponse()), warm_args(system)) == 1
    assert "nothing was warmed" in capsys.readouterr().err


def test_the_client_warms_a_raw_prompt_and_sends_the_callers_request_id():
    """A base model (no chat template) could not be warmed through the client or the CLI:
    every string became a system message; and a caller could not name its calls."""
    from clients.python.client import TierCacheClient

    seen = []

    class Stub:
        def Warm(self, req, timeout=None, metadata=None):  # noqa: N802
            seen.append((req, dict(metadata)))
            return orchestrator_pb2.WarmResponse()

    c = TierCacheClient("127.0.0.1:1")
    c.stub = Stub()
    try:
        c.warm(["<|im_start|>system\nYou are terse."], raw=True, request_id="job-7")
        c.warm(["You are terse."])
    finally:
        c.close()
    (raw, md), (chat, md2) = seen
    assert raw.prompts[0].prompt.startswith("<|im_start|>") and not raw.prompts[0].messages
    assert md["x-request-id"] == "job-7"
    assert chat.prompts[0].messages[0].role == "system" and not chat.prompts[0].prompt
    assert md2["x-request-id"] and md2["x-request-id"] != "job-7"


def test_json_output_keeps_zero_values(capsys):
    """proto3 JSON leaves zero values out: prompt 0's result had no promptIndex, and a fresh
    server's stats printed {}."""
    c = FakeWarmClient(orchestrator_pb2.WarmResponse(results=[result("A")]))
    assert cmd_warm(c, warm_args()) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["results"][0]["promptIndex"] == 0
    from clients.python.cli import _as_dict

    assert int(_as_dict(orchestrator_pb2.StatsResponse())["requestsTotal"]) == 0
