"""Start the full stack (semantic, prefix, 2 kvpool replicas, orchestrator) for e2e tests."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from services.launcher import ServiceProcess
from tests import waits
from tests.e2e.conftest import free_ports, start, start_all
from tests.index_sync import wait_index_matches_pools

INTERNAL = "internal-e2e-secret"
INTERNAL_MD = [("authorization", f"Bearer {INTERNAL}")]
ADMIN_TOKEN = "tok-admin"
TOKENS = {"tok-a": {"tenant": "a"}, "tok-b": {"tenant": "b"},
          "tok-small": {"tenant": "small", "max_prompt_tokens": 60, "max_tokens": 6,
                        "max_concurrent": 1},
          # Tenants no other test sends for: what EraseTenant removes of one is all its own.
          "tok-erase-a": {"tenant": "erase-a"}, "tok-erase-b": {"tenant": "erase-b"},
          # Cluster-wide Stats describe every tenant's traffic: operators only.
          ADMIN_TOKEN: {"tenant": "ops", "admin": True}}


@dataclass
class FullStack:
    semantic: ServiceProcess
    prefix: ServiceProcess
    kv: list[ServiceProcess]
    orch: ServiceProcess

    def all(self) -> list[ServiceProcess]:
        return [self.orch, *self.kv, self.prefix, self.semantic]

    def stop(self) -> None:
        for p in self.all():
            p.stop()

    def restart(self, p: ServiceProcess, timeout: float = 240.0) -> None:
        """Start a (killed) service again on the same port with the same config."""
        p.kill()
        p.start().wait(timeout)

    @contextlib.contextmanager
    def revived(self, p: ServiceProcess) -> Iterator[ServiceProcess]:
        """Whatever the test asserts, `p` runs again afterwards: a fault test that failed
        before its own restart left the shared stack without it, and every later test
        (fuzz, security, soak) failed for that."""
        try:
            yield p
        finally:
            if p.proc is None or p.proc.poll() is not None:
                self.restart(p)

    def revive_dead(self) -> None:
        """Start again every service a test killed or stopped."""
        for p in self.all():
            if p.proc is None or p.proc.poll() is not None:
                self.restart(p)


def start_full_stack(tmp: Path, name: str, lease_s: float = 3.0, orch_env: dict | None = None,
                     *, tokens: dict | None = None, internal: str = INTERNAL,
                     kv_env: dict | None = None) -> FullStack:
    """semantic, prefix, two kvpool replicas and the orchestrator, with an internal credential
    on every hop; logs are named `<name>-<service>`."""
    tokens_file = tmp / "tokens.json"
    tokens_file.write_text(json.dumps(TOKENS if tokens is None else tokens))
    started: list = []
    try:
        # The tiers and the replicas at once (a replica registers with the index when both
        # are up); the orchestrator after them, so that its first poll finds them serving.
        sem_port, prefix_port = free_ports(2)
        prefix_address = f"127.0.0.1:{prefix_port}"
        started.extend(start_all([
            ("semantic", {"TIERCACHE_SEMANTIC_DB_PATH": str(tmp / "semantic.db"),
                          "TIERCACHE_SEMANTIC_INTERNAL_TOKEN": internal}, f"{name}-semantic"),
            ("prefix", {"TIERCACHE_PREFIX_LEASE_SECONDS": str(lease_s),
                        "TIERCACHE_PREFIX_INTERNAL_TOKEN": internal}, f"{name}-prefix"),
            *[("kvpool", {"TIERCACHE_KVPOOL_REPLICA_ID": f"kv-{i}",
                          "TIERCACHE_KVPOOL_PREFIX_ADDRESS": prefix_address,
                          "TIERCACHE_KVPOOL_HEARTBEAT_SECONDS": "0.5",
                          "TIERCACHE_KVPOOL_NUM_BLOCKS": "512",
                          "TIERCACHE_KVPOOL_TORCH_THREADS": "1",
                          "TIERCACHE_KVPOOL_INTERNAL_TOKEN": internal, **(kv_env or {})},
               f"{name}-kv{i}") for i in range(2)]], ports=(sem_port, prefix_port)))
        sem, prefix, *kv = started
        assert prefix.address == prefix_address
        orch = start("orchestrator", {
            "TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES": ",".join(k.address for k in kv),
            "TIERCACHE_ORCHESTRATOR_SEMANTIC_ADDRESS": sem.address,
            "TIERCACHE_ORCHESTRATOR_PREFIX_ADDRESSES": prefix.address,
            "TIERCACHE_ORCHESTRATOR_TOKENS_FILE": str(tokens_file),
            "TIERCACHE_ORCHESTRATOR_REPLICA_POLL_S": "0.5",
            "TIERCACHE_ORCHESTRATOR_INTERNAL_TOKEN": internal,
            # Background warm-up would make cached-token counts depend on timing here; it has
            # its own tests.
            "TIERCACHE_ORCHESTRATOR_WARM_INTERVAL_S": "0",
            "TIERCACHE_ORCHESTRATOR_PREFIX_TIMEOUT_S": "1.0",
            **(orch_env or {})}, key=f"{name}-orchestrator")
        started.append(orch)
    except BaseException:
        # A later service that fails to start (or a skip) would otherwise leave the earlier
        # ones running: they have their own sessions and outlive pytest.
        for p in reversed(started):
            p.stop()
        raise
    return FullStack(sem, prefix, kv, orch)


def admin_stats(stack: FullStack):
    """The orchestrator's cluster-wide Stats, read with the operators' token."""
    from clients.python.client import TierCacheClient

    with TierCacheClient(stack.orch.address, token=ADMIN_TOKEN, timeout=30) as c:
        return c.stats()


def replica_stats(stack: FullStack, metadata: list | None = None) -> list:
    """Every replica's own Stats (`metadata`: the stack's internal credential, default this
    module's INTERNAL_MD)."""
    import grpc
    from tiercache.v1 import kvpool_pb2, kvpool_pb2_grpc

    out = []
    for k in stack.kv:
        with grpc.insecure_channel(k.address) as ch:
            out.append(kvpool_pb2_grpc.KvPoolStub(ch).Stats(
                kvpool_pb2.KvStatsRequest(), timeout=10, metadata=metadata or INTERNAL_MD))
    return out


def wait_until(pred, timeout: float, what: str, every: float = 0.1):
    """`pred()`'s first truthy value, asked every `every` s; fails after `timeout` s."""
    return waits.wait_until(pred, timeout, f"not within {timeout} s: {what}", every)


def wait_pools_idle(read_pools: Callable[[], list], timeout: float) -> list:
    """The replicas' Stats (`read_pools()`) once none runs or queues a sequence or references
    a block; each pool's free + cached + pinned blocks are then its total (none lost). Fails
    after `timeout` s with the last Stats read."""
    seen: list = []

    def idle() -> bool:
        seen[:] = read_pools()
        return all(s.running == s.waiting == s.blocks_in_use == 0 for s in seen)

    waits.wait_until(idle, timeout, lambda: f"replicas not idle within {timeout} s: {seen}", 0.1)
    for s in seen:
        if s.blocks_free + s.blocks_cached + s.blocks_pinned != s.blocks_total:
            raise AssertionError(f"blocks lost on {s.replica_id}: {s}")
    return seen


def wait_index_caught_up(stack: FullStack, timeout: float = 30.0,
                         metadata: list | None = None) -> None:
    """Until the index agrees with every replica's idle pool (`wait_index_matches_pools`).
    `metadata`: the stack's internal credential (default: this module's INTERNAL_MD)."""
    metadata = metadata or INTERNAL_MD
    import grpc
    from tiercache.v1 import prefix_pb2, prefix_pb2_grpc

    def pools() -> list:
        return replica_stats(stack, metadata)

    def index():
        with grpc.insecure_channel(stack.prefix.address) as ch:
            return prefix_pb2_grpc.PrefixIndexStub(ch).Stats(prefix_pb2.PrefixStatsRequest(),
                                                             timeout=10, metadata=metadata)

    wait_index_matches_pools(pools, index, timeout)
