"""Waiting for the prefix index to agree with the replicas' pools, for tests over real stacks."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable


def wait_index_matches_pools(read_pools: Callable[[], Iterable], read_index: Callable[[], object],
                             timeout: float = 30.0) -> None:
    """Until the prefix index lists, for every live replica, as many blocks as its idle pool
    holds (cached + pinned). Replicas publish what they cache asynchronously (batched, up to
    ~0.2 s after a prefill), so a request sent right after a Warm or a fault could be routed,
    or judged, before the index knew of it.

    `read_pools()`: the live replicas' KvStatsResponses; `read_index()`: the index's
    PrefixStatsResponse.
    """
    end = time.monotonic() + timeout
    while True:
        pools = {s.replica_id: s.blocks_cached + s.blocks_pinned for s in read_pools()}
        index = {r.replica_id: r.held_blocks for r in read_index().replicas}
        if index == pools:
            return
        assert time.monotonic() < end, (
            f"the index did not catch up with the pools: index {index}, pools {pools}")
        time.sleep(0.1)
