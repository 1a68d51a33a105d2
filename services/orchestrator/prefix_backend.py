"""The prefix index as the orchestrator uses it: Match, TopPrefixes, Stats, with health."""

from __future__ import annotations

import grpc
from tiercache.v1 import prefix_pb2, prefix_pb2_grpc

from services.common.grpc_client import call_metadata, make_channel
from services.orchestrator.backends import Health


class PrefixBackend:
    def __init__(self, addresses: tuple[str, ...], internal_token: str, timeout_s: float,
                 block_size: int) -> None:
        if len(addresses) != 1:
            raise ValueError("TIERCACHE_ORCHESTRATOR_PREFIX_ADDRESSES: sharding not wired yet")
        self.stub = prefix_pb2_grpc.PrefixIndexStub(make_channel(addresses[0]))
        self.health = Health("prefix", ",".join(addresses))
        self.timeout_s = timeout_s
        self.token = internal_token
        self.block_size = block_size

    def _call(self, method, req):
        try:
            r = getattr(self.stub, method)(req, timeout=self.timeout_s,
                                           metadata=call_metadata(self.token))
            self.health.ok()
            return r
        except grpc.RpcError as e:
            self.health.fail(e)
            raise

    def match(self, block_hashes: list[bytes], model_id: str) -> dict[str, int]:
        r = self._call("Match", prefix_pb2.MatchRequest(model_id=model_id,
                                                        block_hashes=block_hashes))
        return {m.replica_id: m.matched_tokens for m in r.matches if m.matched_blocks}

    def top_prefixes(self, k: int, model_id: str):
        return self._call("TopPrefixes", prefix_pb2.TopPrefixesRequest(k=k, model_id=model_id)
                          ).prefixes

    def stats(self):
        return self._call("Stats", prefix_pb2.PrefixStatsRequest())
