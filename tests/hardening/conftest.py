"""Fixtures of the hardening suite: in-process servers (port 0) for kvpool (tiny model), prefix
and semantic, and one full stack of real processes shared by the orchestrator, fault, soak and
security tests (it is restarted in place by the fault tests, never left broken)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from tiercache.v1 import (
    kvpool_pb2,
    kvpool_pb2_grpc,
    orchestrator_pb2,
    prefix_pb2,
    semantic_pb2,
)

from tests.e2e.conftest import LOG_DIR
from tests.e2e.stack import FullStack, start_full_stack, wait_pools_idle

INTERNAL = "internal-hardening-secret-7f3a"
INTERNAL_MD = [("authorization", f"Bearer {INTERNAL}")]
ADMIN = "tok-admin-9c41"
TOKENS = {
    "tok-a-5d2e": {"tenant": "a"},
    "tok-b-81f0": {"tenant": "b"},
    ADMIN: {"tenant": "ops", "admin": True},
    # One request per 2 s with bursts of 3: the rate-limit test exhausts it in one burst
    # (slow enough that a loaded machine cannot refill it between the burst's calls).
    "tok-rate-44c9": {"tenant": "rate", "rate_per_s": 0.5, "burst": 3},
    "tok-one-2b7e": {"tenant": "one", "max_concurrent": 1},
}
TOK_A, TOK_B, TOK_RATE, TOK_ONE = "tok-a-5d2e", "tok-b-81f0", "tok-rate-44c9", "tok-one-2b7e"
SECRETS = (INTERNAL, *TOKENS)


def md(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


# ---- raw calls: any bytes, any method, status back --------------------------------------------

@dataclass
class Outcome:
    code: grpc.StatusCode
    details: str
    responses: list[bytes]


def call(channel: grpc.Channel, method: str, payload: bytes, *, stream: bool = False,
         metadata=None, timeout: float = 30.0) -> Outcome:
    """Send `payload` as the serialized request of `method`; never raises for a status."""
    try:
        if stream:
            mc = channel.unary_stream(method)
            out = list(mc(payload, metadata=metadata, timeout=timeout))
        else:
            mc = channel.unary_unary(method)
            out = [mc(payload, metadata=metadata, timeout=timeout)]
        return Outcome(grpc.StatusCode.OK, "", out)
    except grpc.RpcError as e:
        return Outcome(e.code(), e.details() or "", [])


def string_field(number: int, raw: bytes) -> bytes:
    """Wire bytes of a length-delimited field (used to smuggle invalid UTF-8 into a string)."""
    def varint(n: int) -> bytes:
        out = bytearray()
        while True:
            b = n & 0x7F
            n >>= 7
            out.append(b | (0x80 if n else 0))
            if not n:
                return bytes(out)
    return varint((number << 3) | 2) + varint(len(raw)) + raw


BAD_UTF8 = b"ok\xff\xfe\xc3("


# ---- in-process servers ------------------------------------------------------------------------

@dataclass
class InProc:
    channel: grpc.Channel
    stop: object
    extra: object = None


@pytest.fixture(scope="module")
def kv_inproc() -> Iterator[InProc]:
    from services.common.bootstrap import create_server
    from services.kvpool.app import build_replica
    from services.kvpool.config import KvPoolConfig
    from services.kvpool.server import KvPoolServicer
    from tests.kvpool.conftest import TINY_ID, make_tiny_model

    cfg = KvPoolConfig(address="127.0.0.1:0", metrics_port=-1, num_blocks=64, block_size=4,
                       max_batch_size=4, max_prefill_chunk=16, max_new_tokens_limit=64,
                       replica_id="kv-hard", pin_ttl_max_seconds=30, internal_token=INTERNAL)
    servicer = KvPoolServicer(cfg)
    handle = create_server(service="kvpool", address=cfg.address, internal_token=INTERNAL,
                           services=[(kvpool_pb2_grpc.add_KvPoolServicer_to_server, servicer,
                                      "tiercache.v1.KvPool")])
    replica = build_replica(cfg, model=make_tiny_model(), model_id=TINY_ID, metrics=False)
    servicer.attach(replica.engine, replica.info)
    handle.set_serving()
    ch = grpc.insecure_channel(handle.address)

    def stop() -> None:
        ch.close()
        handle.stop(0)
        replica.engine.stop()

    yield InProc(ch, stop, replica.engine)
    stop()


@pytest.fixture(scope="module")
def prefix_inproc() -> Iterator[InProc]:
    from services.prefix.config import PrefixConfig
    from services.prefix.server import serve

    svc = serve(PrefixConfig(address="127.0.0.1:0", internal_token=INTERNAL, block_size=4,
                             max_events=64, max_blocks=256, verify_hashes=True))
    ch = grpc.insecure_channel(svc.address)
    yield InProc(ch, svc.stop, svc.servicer.index)
    ch.close()
    svc.stop()


@pytest.fixture(scope="module")
def semantic_inproc(tmp_path_factory) -> Iterator[InProc]:
    from services.semantic.config import SemanticConfig
    from services.semantic.server import serve

    db = tmp_path_factory.mktemp("sem-hard") / "s.db"
    cfg = SemanticConfig(address="127.0.0.1:0", metrics_port=-1, db_path=str(db),
                         internal_token=INTERNAL)
    cfg.validate()
    svc = serve(cfg)
    ch = grpc.insecure_channel(svc.handle.address)
    yield InProc(ch, svc.stop, svc)
    ch.close()
    svc.stop(0)


# ---- the shared process stack -----------------------------------------------------------------

@dataclass
class Stack(FullStack):
    """The e2e FullStack plus what the hardening tests need to poke at it."""

    tmp: Path = Path()

    def stop(self) -> None:
        for p in self.all():
            if p.proc is not None and p.proc.poll() is None:
                try:
                    os.kill(p.proc.pid, 18)  # SIGCONT: a test may have left one stopped
                except ProcessLookupError:
                    pass
            p.stop()

    def kv_stats(self) -> list[kvpool_pb2.KvStatsResponse]:
        """Stats of every live replica (a killed one is skipped)."""
        out = []
        for k in self.kv:
            if k.proc is None or k.proc.poll() is not None:
                continue
            with grpc.insecure_channel(k.address) as ch:
                stub = kvpool_pb2_grpc.KvPoolStub(ch)
                out.append(stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=10,
                                      metadata=INTERNAL_MD))
        return out

    def wait_kv_idle(self, timeout: float = 60.0) -> list[kvpool_pb2.KvStatsResponse]:
        """Every live replica has no running sequence and no referenced block, and has lost
        none (or fail): `wait_pools_idle`."""
        return wait_pools_idle(self.kv_stats, timeout)

    def admin_stats(self, timeout: float = 30.0) -> orchestrator_pb2.StatsResponse:
        from tiercache.v1 import orchestrator_pb2_grpc

        with grpc.insecure_channel(self.orch.address) as ch:
            return orchestrator_pb2_grpc.OrchestratorStub(ch).Stats(
                orchestrator_pb2.StatsRequest(), timeout=timeout, metadata=md(ADMIN))

    def prefix_stats(self) -> prefix_pb2.PrefixStatsResponse:
        from tiercache.v1 import prefix_pb2_grpc

        with grpc.insecure_channel(self.prefix.address) as ch:
            return prefix_pb2_grpc.PrefixIndexStub(ch).Stats(
                prefix_pb2.PrefixStatsRequest(), timeout=10, metadata=INTERNAL_MD)

    def semantic_stats(self) -> semantic_pb2.SemanticStatsResponse:
        from tiercache.v1 import semantic_pb2_grpc

        with grpc.insecure_channel(self.semantic.address) as ch:
            return semantic_pb2_grpc.SemanticCacheStub(ch).Stats(
                semantic_pb2.SemanticStatsRequest(), timeout=10, metadata=INTERNAL_MD)

    def logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in LOG_DIR.glob("hard-*.log"))


LEASE_S = 3.0


def start_stack(tmp: Path) -> Stack:
    for old in LOG_DIR.glob("hard-*.log"):
        old.unlink()
    s = start_full_stack(
        tmp, "hard", lease_s=LEASE_S, tokens=TOKENS, internal=INTERNAL,
        kv_env={"TIERCACHE_KVPOOL_NUM_BLOCKS": "256"},
        orch_env={
            # Small limits keep the fuzzing cheap: anything larger is refused before the model.
            "TIERCACHE_ORCHESTRATOR_MAX_TOKENS_LIMIT": "16",
            "TIERCACHE_ORCHESTRATOR_DEFAULT_MAX_TOKENS": "4",
            "TIERCACHE_ORCHESTRATOR_MAX_PROMPT_TOKENS": "512",
            "TIERCACHE_ORCHESTRATOR_MAX_MESSAGE_CHARS": "4000"})
    return Stack(s.semantic, s.prefix, s.kv, s.orch, tmp=tmp)


@pytest.fixture(scope="package")  # stopped when tests/hardening is done, not at session end
def stack(tmp_path_factory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("hardening-stack"))
    yield s
    s.stop()
