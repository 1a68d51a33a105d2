"""Streams ended at their deadline while their handler is stuck sending to a client that
stopped reading (real gRPC servers on loopback, a client with a small receive window)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tiercache.v1 import orchestrator_pb2_grpc

from services.common.bootstrap import create_server
from services.common.metrics import RPC_TOTAL
from services.common.reaper import StreamReaper
from services.orchestrator.config import STREAM_HEADROOM, OrchestratorConfig
from services.orchestrator.pipeline import TextDelta
from services.orchestrator.server import OrchestratorServicer
from services.orchestrator.tenants import TenantRegistry
from tests.orchestrator.test_stream_cap import Renderer, request
from tests.waits import wait_until

# Any HTTP/2 client may offer a window this small: the server's sends then wait on it.
SMALL_WINDOW = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


_wait_for = partial(wait_until, timeout=10.0, what="timed out", every=0.05)


def test_a_stream_stuck_sending_is_ended_at_its_deadline_with_the_reason():
    reaper = StreamReaper(on_reap=lambda details: reaped.append(details))
    reaped: list[str] = []
    closed = threading.Event()

    class Flood(health_pb2_grpc.HealthServicer):
        def Watch(self, req, context):  # noqa: N802
            reaper.arm(time.monotonic() + 1.0, context, "not read within 1 s")
            try:
                while True:
                    yield health_pb2.HealthCheckResponse(status=1)
            finally:
                closed.set()

    server = grpc.server(ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(Flood(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=SMALL_WINDOW)
    try:
        stream = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
        next(stream)  # then not read: the server's sends fill the window and wait
        assert closed.wait(10), "the handler was never ended"
        with pytest.raises(grpc.RpcError) as e:
            for _ in stream:
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert e.value.details() == "not read within 1 s" and reaped == ["not read within 1 s"]
    finally:
        channel.close()
        server.stop(0)


def test_a_disarmed_call_is_left_alone():
    ended: list[str] = []

    class Ctx:
        def cancel(self):
            ended.append("x")

    reaper = StreamReaper()
    token = reaper.arm(time.monotonic() + 0.2, Ctx(), "late")
    reaper.disarm(token)
    reaper.arm(time.monotonic() + 0.3, Ctx(), "kept")
    _wait_for(lambda: ended == ["x"])
    time.sleep(0.3)
    assert ended == ["x"] and reaper.armed() == 0


def test_a_client_that_stops_reading_gives_back_its_slots_at_request_timeout():
    """Its Generate held the server's stream slot, a worker and the tenant's one slot far
    past request_timeout_s (5 s here took 140 s: the connection's age plus its grace)."""

    class Flood:
        tok = range(1000)
        replicas = type("R", (), {"max_context": staticmethod(lambda: 0)})()
        semantic = type("S", (), {"enabled": False})()

        def __init__(self) -> None:
            self.renderer = Renderer()

        def generate(self, **kw):
            while True:  # an answer far longer than the client's window
                yield TextDelta("x" * 4096, [])

    cfg = OrchestratorConfig(kvpool_addresses=("h:1",), max_workers=STREAM_HEADROOM + 4,
                             request_timeout_s=1.0)
    cfg.validate()
    s = OrchestratorServicer(cfg)
    s.attach(Flood(), TenantRegistry.build(tokens_file="", tokens="", key=b"k",
                                           max_prompt_tokens=100, max_tokens=100,
                                           max_concurrent=1))
    handle = create_server(service="orchestrator", address="127.0.0.1:0", services=[
        (orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, s,
         "tiercache.v1.Orchestrator")])
    handle.set_serving()
    stuck = grpc.insecure_channel(handle.address, options=SMALL_WINDOW)
    other = grpc.insecure_channel(handle.address)

    def count(code: str) -> float:
        return RPC_TOTAL.labels("orchestrator", "Generate", code)._value.get()

    before = {c: count(c) for c in ("CANCELLED", "DEADLINE_EXCEEDED")}
    try:
        held = orchestrator_pb2_grpc.OrchestratorStub(stuck).Generate(request())  # no deadline
        assert next(held).text  # started; then never read again
        _wait_for(lambda: s._streams == 0)  # ended by the reaper about 2 s in
        probe = orchestrator_pb2_grpc.OrchestratorStub(other).Generate(request(), timeout=10)
        assert next(probe).text  # the tenant's one slot is free again
        probe.cancel()
        with pytest.raises(grpc.RpcError) as e:
            for _ in held:
                pass
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "was not read within 1 s" in e.value.details()
        # Counted as the client was told: the reaped stream was counted CANCELLED (its
        # handler saw the call closed, with no gRPC deadline of the client's to compare).
        _wait_for(lambda: count("DEADLINE_EXCEEDED") == before["DEADLINE_EXCEEDED"] + 1)
        _wait_for(lambda: count("CANCELLED") == before["CANCELLED"] + 1)  # the probe alone
    finally:
        stuck.close()
        other.close()
        handle.stop(0)


@pytest.mark.parametrize(("left", "marked", "code"), [
    (None, False, "CANCELLED"), (30.0, False, "CANCELLED"), (0.1, False, "DEADLINE_EXCEEDED"),
    (-1.0, False, "DEADLINE_EXCEEDED"), (None, True, "DEADLINE_EXCEEDED")])
def test_why_a_call_ended_under_its_handler(left, marked, code):
    """A client whose deadline passed while the server was stuck sending to it ends the
    stream a little before the server's copy of the deadline: it was counted CANCELLED."""
    from services.common.bootstrap import rpc_ended
    from services.common.reaper import end_call

    class Ctx:
        def time_remaining(self):
            return left

        def cancel(self):
            pass

    ctx = Ctx()
    if marked:
        end_call(ctx, grpc.StatusCode.DEADLINE_EXCEEDED, "reaped")
    assert rpc_ended(ctx).code == code


def test_disarmed_entries_do_not_pile_up_behind_a_stalled_one():
    """kvpool arms the reaper once per message sent: behind one stalled stream's entry, every
    later disarmed entry stayed in the heap (200,001 after 200,000 messages)."""

    class Ctx:
        def cancel(self):
            pass

    reaper = StreamReaper()
    reaper.arm(time.monotonic() + 3600, Ctx(), "stalled")
    for _ in range(5000):
        reaper.disarm(reaper.arm(time.monotonic() + 60, Ctx(), "sent"))
    assert reaper.armed() == 1 and len(reaper._heap) <= 2 + 64
