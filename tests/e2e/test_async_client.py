"""The asyncio client (clients/python/aio.py) on a live orchestrator + kvpool with the real
SmolLM2: concurrent calls on one channel give the greedy ids of the same requests sent one by
one (sync client, every cache off), and a cancelled task or a timeout frees the replica's KV
blocks at once (the server saw the call end), read through the client's own Stats.

Kept short (it runs in CI on 2 cores): answers of 3 tokens; the long answers are cut after
their first tokens."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from clients.python.aio import AsyncTierCacheClient
from clients.python.client import TierCacheClient
from tests.e2e.conftest import CACHES_OFF, start

pytestmark = [pytest.mark.e2e, pytest.mark.model]

QUESTIONS = [f"Give one word for the number {i}." for i in range(8)]
LONG = dict(max_tokens=400, ignore_eos=True, cache_policy=CACHES_OFF)  # ~30 s on a 2-core CPU


@pytest.fixture(scope="module")
def address():
    kv = start("kvpool", {"TIERCACHE_KVPOOL_REPLICA_ID": "kv-aio",
                          "TIERCACHE_KVPOOL_TORCH_THREADS": "1"}, key="aio-kvpool")
    try:
        orch = start("orchestrator", {"TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESSES": kv.address,
                                      "TIERCACHE_ORCHESTRATOR_MAX_TOKENS_LIMIT": "512",
                                      # Stats shows each replica as of its last poll.
                                      "TIERCACHE_ORCHESTRATOR_REPLICA_POLL_S": "0.1"},
                     key="aio-orchestrator")
        try:
            yield orch.address
        finally:
            orch.stop()
    finally:
        kv.stop()


async def replica(c: AsyncTierCacheClient, pred, what: str, timeout: float = 10.0):
    """The replica's figures (through the orchestrator's Stats) once `pred` holds."""
    end = time.monotonic() + timeout
    while True:
        (r,) = (await c.stats()).replicas
        if pred(r):
            return r
        assert time.monotonic() < end, f"not within {timeout} s: {what} ({r})"
        await asyncio.sleep(0.05)


def test_concurrent_calls_on_one_channel_give_the_ids_of_sequential_calls(address):
    with TierCacheClient(address, timeout=120) as c:
        want = {q: c.generate(q, max_tokens=3, return_token_ids=True,
                              cache_policy=CACHES_OFF).token_ids for q in QUESTIONS}

    async def main():
        async with AsyncTierCacheClient(address, timeout=120) as c:
            return await asyncio.gather(*(
                c.generate(QUESTIONS[i % 8], max_tokens=3, return_token_ids=True)
                for i in range(32)))
    got = asyncio.run(main())
    assert [r.token_ids for r in got] == [want[QUESTIONS[i % 8]] for i in range(32)]
    assert all(r.finish_reason == "FINISH_REASON_LENGTH" for r in got)


def test_a_cancelled_task_or_a_timeout_frees_the_replicas_blocks(address):
    async def main():
        async with AsyncTierCacheClient(address, timeout=120) as c:
            await replica(c, lambda r: not r.running and not r.blocks_in_use, "idle")
            task = asyncio.create_task(c.generate("Tell a long story about a dragon.", **LONG))
            await replica(c, lambda r: r.running and r.blocks_in_use, "generating")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await replica(c, lambda r: not r.running and not r.blocks_in_use, "freed")

            with pytest.raises(grpc.RpcError) as e:
                await c.generate("Tell a long story about a cat.", timeout=2.0, **LONG)
            assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert 0 < e.value.chunks_received and e.value.request_id
            await replica(c, lambda r: not r.running and not r.blocks_in_use, "freed")
    asyncio.run(main())
