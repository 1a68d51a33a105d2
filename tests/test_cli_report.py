"""The CLI's one-line CacheReport: says which tier answered and what was reused (pure logic);
and what `stats` tells beside its JSON."""

import pytest
from tiercache.v1 import common_pb2

from clients.python.cli import format_report


def test_model_answer_with_draft_names_replica_cache_and_draft():
    r = common_pb2.CacheReport(prompt_tokens=61, cached_tokens=32, replica_id="kvpool-1",
                               ttft_ms=193.6, draft_tokens_proposed=56, draft_tokens_accepted=10,
                               semantic_entry_id="ns.e1")
    assert format_report(r) == ("[model | prompt 61 tok, cached 32, replica kvpool-1, ttft 194 ms,"
                                " draft 10/56 accepted, entry ns.e1]")


def test_a_prefix_the_replica_had_partly_evicted_shows_what_the_index_expected():
    r = common_pb2.CacheReport(prompt_tokens=1040, cached_tokens=512, index_matched_tokens=1024,
                               replica_id="kvpool-1", ttft_ms=900)
    assert format_report(r) == ("[model | prompt 1040 tok, cached 512 (index expected 1024), "
                                "replica kvpool-1, ttft 900 ms]")
    # The whole prompt held: the replica still computes its last token; nothing to say.
    r.prompt_tokens, r.cached_tokens, r.index_matched_tokens = 64, 63, 64
    assert format_report(r) == "[model | prompt 64 tok, cached 63, replica kvpool-1, ttft 900 ms]"


def test_accepted_tokens_from_prompt_lookup_are_told_apart():
    r = common_pb2.CacheReport(prompt_tokens=61, replica_id="kvpool-1", ttft_ms=10,
                               draft_tokens_proposed=56, draft_tokens_accepted=10,
                               lookup_tokens_accepted=4)
    assert format_report(r) == ("[model | prompt 61 tok, cached 0, replica kvpool-1, ttft 10 ms,"
                                " draft 10/56 accepted (4 by prompt lookup)]")


def test_semantic_hit_has_no_replica_and_no_draft():
    r = common_pb2.CacheReport(semantic_hit=True, ttft_ms=9.6, semantic_entry_id="ns.e2")
    assert format_report(r) == ("[semantic hit | prompt 0 tok, cached 0, replica -, ttft 10 ms,"
                                " entry ns.e2]")


def test_a_coalesced_answer_names_the_request_whose_model_run_gave_it():
    r = common_pb2.CacheReport(prompt_tokens=40, cached_tokens=40, replica_id="kvpool-0",
                               ttft_ms=269.0, route="coalesced", coalesced_with="req-1")
    assert format_report(r) == ("[model | route coalesced, prompt 40 tok, cached 40, replica "
                                "kvpool-0, ttft 269 ms, coalesced with req-1]")


def test_cold_answer_mentions_neither_draft_nor_entry():
    r = common_pb2.CacheReport(prompt_tokens=40, replica_id="kvpool-0", ttft_ms=269.0)
    assert format_report(r) == "[model | prompt 40 tok, cached 0, replica kvpool-0, ttft 269 ms]"


class FakeClient:
    """Streams the given answers, one per call (pure logic: no server)."""

    def __init__(self, *answers: str) -> None:
        self.answers = list(answers)
        self.sent = []

    def stream(self, messages, **kw):
        from clients.python.client import Chunk

        self.sent.append([dict(m) for m in messages])
        from tiercache.v1 import orchestrator_pb2

        yield Chunk(self.answers.pop(0), [], None)
        yield Chunk("", [], orchestrator_pb2.GenerateFinal())


def chat_args(text: str):
    import argparse

    return argparse.Namespace(text=text, session="s1", system="", max_tokens=8, temperature=0.0,
                              top_p=0.0, seed=0, quiet=True, tier="", threshold=0.0,
                              no_semantic=False, no_prefix_cache=False, new=False)


def test_an_empty_answer_leaves_the_session_usable(tmp_path, monkeypatch, capsys):
    """An empty assistant turn would make every later request of the session invalid."""
    import json

    from clients.python.cli import _history_path, cmd_chat

    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path))
    c = FakeClient("Paris.", "\n", "About 2.1 million.")
    assert cmd_chat(c, chat_args("Capital of France?")) == 0
    assert cmd_chat(c, chat_args("Say nothing.")) == 0
    assert "session 's1' left unchanged" in capsys.readouterr().err
    assert cmd_chat(c, chat_args("Population?")) == 0
    assert [m["content"] for m in c.sent[2]] == ["Capital of France?", "Paris.", "Population?"]
    saved = json.loads(_history_path("s1").read_text())
    assert [m["role"] for m in saved] == ["user", "assistant", "user", "assistant"]
    assert all(m["content"] for m in saved)


def test_a_session_says_it_continues_and_new_starts_it_over(tmp_path, monkeypatch, capsys):
    """An earlier user's session of the same name went out silently as the question's history,
    and --system on it was dropped without a word."""
    import argparse

    from clients.python.cli import cmd_chat

    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path))
    c = FakeClient("Paris.", "Seine.", "Hi.")
    assert cmd_chat(c, chat_args("Capital of France?")) == 0
    assert capsys.readouterr().err == ""  # a new session: nothing to say
    again = argparse.Namespace(**{**vars(chat_args("Its river?")), "quiet": False,
                                  "system": "Be terse."})
    assert cmd_chat(c, again) == 0
    err = capsys.readouterr().err
    assert "continuing session 's1' (1 earlier turn; --new starts it over)" in err
    assert "--system ignored" in err
    assert [m["role"] for m in c.sent[1]] == ["user", "assistant", "user"]
    fresh = argparse.Namespace(**{**vars(chat_args("Hello")), "new": True, "system": "Be terse."})
    assert cmd_chat(c, fresh) == 0
    assert c.sent[2] == [{"role": "system", "content": "Be terse."},
                         {"role": "user", "content": "Hello"}]


def test_chat_flags_set_the_cache_policy(tmp_path, monkeypatch):
    """The CLI could not pick a semantic tier nor skip a cache: `--tier relaxed "hi"` read
    "relaxed" as the question."""
    from clients.python import cli

    seen = []

    class Client(FakeClient):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def stream(self, messages, **kw):
            seen.append(kw.get("cache_policy"))
            yield from super().stream(messages, **kw)

    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path))
    monkeypatch.setattr(cli, "TierCacheClient", lambda *a, **kw: Client("a", "b"))
    assert cli.main(["chat", "-q", "--tier", "relaxed", "--no-prefix-cache", "hi"]) == 0
    assert cli.main(["chat", "-q", "hi"]) == 0
    p = seen[0]
    assert (p.semantic_tier, p.skip_prefix_cache, p.skip_semantic_lookup) == ("relaxed", True,
                                                                              False)
    assert seen[1] is None  # the server's defaults


def test_the_report_names_the_route_and_the_similarity():
    hit = common_pb2.CacheReport(semantic_hit=True, semantic_similarity=0.9712, route="semantic")
    assert format_report(hit).startswith("[semantic hit 0.971 | route semantic, prompt 0 tok")
    near = common_pb2.CacheReport(semantic_similarity=0.91, route="prefix", prompt_tokens=9)
    assert format_report(near).startswith("[model (nearest entry 0.910) | route prefix, ")
    down = common_pb2.CacheReport(route="ring", degradations=["semantic_skipped", "index_down"])
    assert format_report(down).endswith(", degraded: semantic_skipped index_down]")


@pytest.mark.parametrize("argv,message", [
    (["warm", "--top-k", "-1"], "argument --top-k: must be in [0, 4294967295], got -1"),
    (["warm", "--ttl", "-5"], "argument --ttl: must be in [0, 4294967295], got -5"),
    (["chat", "--max-tokens", "3000000000", "hi"],
     "argument --max-tokens: must be in [0, 2147483647], got 3000000000"),
    (["chat", "--max-tokens", "many", "hi"], "argument --max-tokens: not an integer: 'many'")])
def test_out_of_range_numbers_are_usage_errors(argv, message, capsys):
    """Before: protobuf's ValueError escaped as a traceback (exit 1) after dialling."""
    from clients.python.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--address", "127.0.0.1:1", *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_the_cli_says_when_a_tiers_figures_leave_out_shards(capsys):
    """The figures of a sharded tier are those of the shards that answered: the JSON has the
    count, and a person reading it is told on stderr when some are missing."""
    from tiercache.v1 import common_pb2, orchestrator_pb2, prefix_pb2, semantic_pb2

    from clients.python import cli

    class Client:
        def __init__(self, resp):
            self.resp = resp

        def stats(self):
            return self.resp

    part = orchestrator_pb2.StatsResponse(
        model_id="m",
        prefix=prefix_pb2.PrefixStatsResponse(nodes=3, shards_total=2, shards_answered=1),
        semantic=semantic_pb2.SemanticStatsResponse(shards_total=2, shards_answered=2))
    assert cli.cmd_stats(Client(part), None) == 0
    out = capsys.readouterr()
    assert '"shardsAnswered": 1' in out.out and '"shardsTotal": 2' in out.out
    assert out.err == "prefix: 1 of 2 shards answered; its figures leave out the others'\n"
    whole = orchestrator_pb2.StatsResponse(
        model_id="m",
        prefix=prefix_pb2.PrefixStatsResponse(nodes=3, shards_total=2, shards_answered=2))
    assert cli.cmd_stats(Client(whole), None) == 0
    assert capsys.readouterr().err == ""
    # No shard answered (one semantic service stopped, or both of two): the orchestrator
    # leaves the tier's figures unset, and the JSON simply lacks the key. Said on stderr too;
    # a tier that is not configured (no dependency line) is not.
    none = orchestrator_pb2.StatsResponse(
        model_id="m",
        prefix=prefix_pb2.PrefixStatsResponse(nodes=3, shards_total=1, shards_answered=1),
        dependencies=[common_pb2.DependencyHealth(name="semantic", address="a:1",
                                                  healthy=False, last_error="Deadline")])
    assert cli.cmd_stats(Client(none), None) == 0
    out = capsys.readouterr()
    assert '"semantic"' not in out.out.replace('"name": "semantic"', "")
    assert out.err == "semantic: no figures (it did not answer; see its line in dependencies)\n"


@pytest.mark.parametrize(("max_tokens", "why"), [
    (8, "(--max-tokens)"), (0, "(the server's default max_tokens, or the room the model's")])
def test_an_answer_cut_at_its_token_limit_is_said_so(tmp_path, monkeypatch, capsys, max_tokens,
                                                    why):
    """An answer cut at max_tokens (finish reason LENGTH) looked like the model's whole
    answer: a half sentence and no word that it stopped there. A note after the report line
    says so and where the limit came from; an answer the model ended says nothing; -q leaves
    the note out with the report."""
    from tiercache.v1 import orchestrator_pb2

    from clients.python.cli import cmd_chat

    monkeypatch.setenv("TIERCACHE_CLI_HOME", str(tmp_path))

    class Cut(FakeClient):
        def __init__(self, reason) -> None:
            super().__init__("The capital of France is")
            self.reason = reason

        def stream(self, messages, **kw):
            from clients.python.client import Chunk

            yield Chunk(self.answers.pop(0), [], None)
            yield Chunk("", [], orchestrator_pb2.GenerateFinal(
                finish_reason=self.reason, usage=common_pb2.Usage(completion_tokens=6)))

    args = chat_args("Capital of France?")
    args.quiet, args.max_tokens, args.session = False, max_tokens, None
    assert cmd_chat(Cut(common_pb2.FINISH_REASON_LENGTH), args) == 0
    err = capsys.readouterr().err
    assert f"note: the answer was cut at 6 tokens {why}" in err, err
    assert cmd_chat(Cut(common_pb2.FINISH_REASON_EOS), args) == 0
    assert "cut at" not in capsys.readouterr().err
    args.quiet = True
    assert cmd_chat(Cut(common_pb2.FINISH_REASON_LENGTH), args) == 0
    assert capsys.readouterr().err == ""


def test_the_report_names_the_threshold_applied_and_a_refusal_above_it():
    """"nearest entry 0.962" did not say what it was held to, nor whether the guard or the
    verifier refused a candidate past its threshold: the report's semantic_threshold, tier
    and guard fields are shown (left out where no lookup was made)."""
    near = common_pb2.CacheReport(semantic_similarity=0.962, semantic_threshold=0.97,
                                  semantic_tier="strict", route="prefix")
    assert format_report(near).startswith(
        "[model (nearest entry 0.962, strict threshold 0.970) | route prefix, ")
    refused = common_pb2.CacheReport(semantic_similarity=0.981, semantic_threshold=0.95,
                                     semantic_tier="standard", semantic_guard_rejected=True,
                                     semantic_guard_reason="numbers differ: 3 vs 4")
    assert format_report(refused).startswith(
        "[model (nearest entry 0.981, standard threshold 0.950, refused: numbers differ: 3 vs "
        "4) | prompt 0 tok")
    hit = common_pb2.CacheReport(semantic_hit=True, semantic_similarity=0.94,
                                 semantic_threshold=0.93, semantic_tier="standard",
                                 semantic_guard_rejected=True, semantic_guard_reason="negation")
    assert format_report(hit).startswith(
        "[semantic hit 0.940 (standard threshold 0.930, a closer entry refused: negation) | ")


def test_no_threshold_is_shown_when_no_entry_was_compared():
    """An empty namespace (no candidate: similarity 0) still comes with the tier's threshold:
    "[model (standard threshold 0.950) | ..." read as if an entry had been held to it and
    missed. Nothing was compared, so nothing is said, as before the threshold was shown."""
    empty = common_pb2.CacheReport(semantic_threshold=0.95, semantic_tier="standard",
                                   route="prefix")
    assert format_report(empty).startswith("[model | route prefix, ")


def test_the_report_says_why_a_hit_was_not_served_and_a_threshold_from_the_request():
    """A hit the orchestrator declined (too short, sampled, ignore_eos) read "model (nearest
    entry 0.981, standard threshold 0.950)": a similarity past the threshold, no refusal, and
    the model, with nothing saying why. And `--threshold 0.9` read "standard threshold 0.900",
    as if the tier's. semantic_not_served and semantic_threshold_from_request are shown."""
    declined = common_pb2.CacheReport(semantic_similarity=0.981, semantic_threshold=0.95,
                                      semantic_tier="standard", semantic_not_served="too_short")
    assert format_report(declined).startswith(
        "[model (nearest entry 0.981, standard threshold 0.950, hit not served: the stored "
        "answer is shorter than asked) | prompt 0 tok")
    declined.semantic_not_served = "sampled"
    assert "hit not served: a sampled request (serve_sampled off)) |" in format_report(declined)
    declined.semantic_not_served = "ignore_eos"
    assert ("hit not served: ignore_eos, and the stored answer ended at end of sequence) |"
            in format_report(declined))
    declined.semantic_not_served = "new_reason"
    assert "hit not served: new_reason) |" in format_report(declined)
    own = common_pb2.CacheReport(semantic_similarity=0.93, semantic_threshold=0.9,
                                 semantic_tier="standard", semantic_threshold_from_request=True,
                                 semantic_hit=True)
    assert format_report(own).startswith("[semantic hit 0.930 (the request's threshold 0.900) | ")
