"""The CLI's one-line CacheReport: says which tier answered and what was reused (pure logic)."""

from tiercache.v1 import common_pb2

from clients.python.cli import format_report


def test_model_answer_with_draft_names_replica_cache_and_draft():
    r = common_pb2.CacheReport(prompt_tokens=61, cached_tokens=32, replica_id="kvpool-1",
                               ttft_ms=193.6, draft_tokens_proposed=56, draft_tokens_accepted=10,
                               semantic_entry_id="ns.e1")
    assert format_report(r) == ("[model | prompt 61 tok, cached 32, replica kvpool-1, ttft 194 ms,"
                                " draft 10/56 accepted, entry ns.e1]")


def test_semantic_hit_has_no_replica_and_no_draft():
    r = common_pb2.CacheReport(semantic_hit=True, ttft_ms=9.6, semantic_entry_id="ns.e2")
    assert format_report(r) == ("[semantic hit | prompt 0 tok, cached 0, replica -, ttft 10 ms,"
                                " entry ns.e2]")


def test_cold_answer_mentions_neither_draft_nor_entry():
    r = common_pb2.CacheReport(prompt_tokens=40, replica_id="kvpool-0", ttft_ms=269.0)
    assert format_report(r) == "[model | prompt 40 tok, cached 0, replica kvpool-0, ttft 269 ms]"
