"""Drafts over the real KvPool gRPC API (tiny model): Final figures, Stats totals, bad input."""

from __future__ import annotations

import grpc
import pytest
from tiercache.v1 import common_pb2, kvpool_pb2

from tests.kvpool.conftest import TINY_VOCAB, reference_greedy
from tests.kvpool.test_kvpool_server import PROMPT, served  # noqa: F401 - fixture


def gen(stub, draft: list[int], max_tokens: int = 24):
    req = kvpool_pb2.KvGenerateRequest(
        token_ids=PROMPT, draft_token_ids=draft,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    toks, final = [], None
    for msg in stub.Generate(req, timeout=20):
        toks.extend(msg.token_ids)
        if msg.HasField("final"):
            final = msg.final
    return toks, final


def test_draft_over_grpc_reports_proposed_accepted_and_totals(served, tiny_model) -> None:  # noqa: F811
    ref = reference_greedy(tiny_model, PROMPT, 24)
    toks, plain = gen(served.stub, [])
    assert toks == ref and plain.draft_tokens_proposed == 0 and plain.forward_passes == 23
    toks, fin = gen(served.stub, ref)
    assert toks == ref
    assert fin.draft_tokens_accepted == fin.draft_tokens_proposed > 0
    assert fin.forward_passes == 23 - fin.draft_tokens_accepted
    st = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    assert st.draft_tokens_proposed_total == fin.draft_tokens_proposed
    assert st.draft_tokens_accepted_total == fin.draft_tokens_accepted


def test_bad_draft_token_is_invalid_argument_and_changes_nothing(served) -> None:  # noqa: F811
    before = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    with pytest.raises(grpc.RpcError) as err:
        gen(served.stub, [1, TINY_VOCAB + 5])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "draft_token_ids" in err.value.details()
    after = served.stub.Stats(kvpool_pb2.KvStatsRequest(), timeout=5)
    assert after.requests_total == before.requests_total
    assert after.draft_tokens_proposed_total == before.draft_tokens_proposed_total


def test_the_final_message_says_which_accepted_tokens_came_from_prompt_lookup(
        served, tiny_model) -> None:  # noqa: F811
    """What the cached answer itself covered is draft - lookup: without the split on the wire,
    the orchestrator's report counted prompt-lookup guesses as cache-assisted drafting."""
    ref = reference_greedy(tiny_model, PROMPT, 24)
    _, perfect = gen(served.stub, ref)
    assert perfect.draft_tokens_accepted > 0 and perfect.lookup_tokens_accepted == 0
    unrelated = [t for t in range(TINY_VOCAB) if t not in ref][:24]
    _, fin = gen(served.stub, unrelated)
    assert fin.lookup_tokens_accepted == fin.draft_tokens_accepted > 0
