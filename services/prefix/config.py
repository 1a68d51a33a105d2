"""Configuration of the prefix index (`TIERCACHE_PREFIX_*` env vars, `--flags`)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import moved, require, require_listen_address


@dataclass(frozen=True)
class PrefixConfig:
    """Settings of one prefix-index process (one shard when sharded)."""

    # host:port the index listens on (0 = any free port).
    address: str = "127.0.0.1:50053"
    metrics_port: int = -1  # Prometheus /metrics and /healthz port; -1 = off, 0 = any free port
    # Credential callers (replicas, orchestrators) must send; "" = none required.
    internal_token: str = ""
    block_size: int = 16  # tokens per block; replicas must use the same
    lease_seconds: float = 10.0  # a replica that does not heartbeat within this is dropped
    max_nodes: int = 1_000_000  # node budget (~208 B each)
    prune_to: float = 0.9  # prune down to this fraction of max_nodes
    prune_step: int = 8000  # work units per call while pruning (~10 ms; see PruneRun)
    eviction_policy: str = "hybrid"  # "hybrid" (LFU shallow, LRU deep) or "lru"
    shallow_tokens: int = 128  # blocks starting before this token are ranked by hits
    # Deep leaves hit fewer times than this are pruned first (unless used within
    # cold_after_ticks).
    min_deep_hits: int = 1
    # Grace of a deep leaf under min_deep_hits: used within this many index ticks (a store
    # batch or a match each, never a probe), it is not pruned first, as a newest turn has had
    # no chance of a hit yet (~60 s at 100 requests/s). 0 = no grace.
    cold_after_ticks: int = 20000
    # Every hit count is halved once per this many seconds (by the lease sweeper), so that a
    # burst long ago stops outranking steady use in TopPrefixes and LFU pruning. 0 = never.
    hit_half_life_seconds: float = 3600.0
    max_events: int = 65536  # events per PublishEvents batch (a resync sends one per block)
    # Blocks per batch, and per Match request; lowered (said at start) to what one gRPC
    # message carries at large block sizes (3,043 at 1,024 tokens a block).
    max_blocks: int = 65536
    # Recompute every stored block's hash (Register's probe already refuses a replica hashing
    # with another key or model).
    verify_hashes: bool = False
    grace_seconds: float = 5.0  # drain time on SIGTERM

    def validate(self) -> None:
        svc = "prefix"
        require_listen_address(self.address, svc)
        require(-1 <= self.metrics_port <= 65535, svc, "metrics_port",
                "must be -1 (off), 0 or a port")
        # As kvpool's (the block hasher's native chain takes at most 2^20, and the replicas'
        # blocks are this size).
        require(1 <= self.block_size <= 1024, svc, "block_size", "must be in 1..1024")
        # Under 0.1 s the sweeper's period (at least 0.05 s) passed half a lease, and every
        # call between sweeps was taken for a pause of the process: leases were cut short.
        require(self.lease_seconds >= 0.1, svc, "lease_seconds", "must be >= 0.1")
        # Sent in uint64 / uint32 fields (Stats, Register): larger failed those calls INTERNAL.
        require(0 < self.max_nodes < 2**64, svc, "max_nodes", "must be in 1..2^64-1")
        # At most 0.99: pruning to (nearly) the budget itself frees a node or a few per
        # publish and rescans every leaf each time, under the index lock (13.6 ms a publish at
        # 60k nodes with 1.0, 0.35 ms with 0.9).
        require(0.0 < self.prune_to <= 0.99, svc, "prune_to", "must be in (0, 0.99]")
        require(self.prune_step > 0, svc, "prune_step", "must be > 0")
        require(self.eviction_policy in ("hybrid", "lru"), svc, "eviction_policy",
                "expected 'hybrid' or 'lru'")
        require(self.shallow_tokens >= 0, svc, "shallow_tokens", "must be >= 0")
        require(self.min_deep_hits >= 0, svc, "min_deep_hits", "must be >= 0")
        require(self.cold_after_ticks >= 0, svc, "cold_after_ticks", "must be >= 0")
        require(self.hit_half_life_seconds >= 0, svc, "hit_half_life_seconds",
                "must be >= 0 (0 = hit counts never decay)")
        # Each halving drops a pruning run under way (it ranked the old counts): one every
        # sweep would never let a run finish, and pruning would fall back to full passes.
        require(self.hit_half_life_seconds == 0
                or self.hit_half_life_seconds >= self.lease_seconds, svc,
                moved(self, "hit_half_life_seconds", "lease_seconds"),
                f"hit_half_life_seconds ({self.hit_half_life_seconds:g}) must be 0 (off) or at "
                f"least lease_seconds ({self.lease_seconds:g})")
        require(0 < self.max_events < 2**32, svc, "max_events", "must be in 1..2^32-1")
        require(0 < self.max_blocks < 2**32, svc, "max_blocks", "must be in 1..2^32-1")
        require(self.grace_seconds >= 0, svc, "grace_seconds", "must be >= 0")
