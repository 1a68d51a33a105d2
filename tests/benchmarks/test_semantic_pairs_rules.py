"""Rules of `python -m benchmarks.semantic_pairs` (a user's own labelled pairs scored by a
running shard): which rows of a CSV / TSV are pairs, what each tier's figures count, and that
every namespace it stores is invalidated (a fake stub stands in for the shard)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.semantic_pairs import Tally, main, read_pairs, score


def test_the_last_three_columns_are_the_pair_and_a_header_is_skipped(tmp_path):
    """QQP's CSV (header, quoted commas) and PAWS's TSV (an id column first, no header) both
    read; a row with another label or too few columns is counted as skipped."""
    qqp = tmp_path / "q.csv"
    qqp.write_text('question1,question2,is_duplicate\n"Hi, you?",Hello you?,1\na,b,0\n'
                   "x,y,maybe\n")
    assert read_pairs(qqp) == ([("Hi, you?", "Hello you?", 1), ("a", "b", 0)], 1)
    paws = tmp_path / "p.tsv"
    paws.write_text('1\tNew "York" to Florida\tFlorida to New York\t0\n2\tx\ty\t3\n'
                    "only two\t1\n")
    assert read_pairs(paws) == ([('New "York" to Florida', "Florida to New York", 0)], 2)


class Stub:
    """A shard deciding by a table: incoming text -> (hit, guard_rejected, reason)."""

    def __init__(self, table, fail_on: str = "") -> None:
        self.table, self.fail_on = table, fail_on
        self.stored: list[str] = []
        self.invalidated: list[str] = []
        self.tiers: list[tuple[str, float]] = []

    def Store(self, req, metadata=()):
        self.stored.append(req.namespace.tenant)

    def Lookup(self, req, metadata=()):
        if req.text == self.fail_on:
            raise RuntimeError("shard gone")
        self.tiers.append((req.tier, round(req.threshold, 3)))
        hit, rejected, reason = self.table[req.text]
        return SimpleNamespace(hit=hit, guard_rejected=rejected, guard_reason=reason)

    def Invalidate(self, req, metadata=()):
        self.invalidated.append(req.namespace.tenant)


def test_a_quoted_field_holding_a_newline_is_one_row(tmp_path):
    f = tmp_path / "pairs.csv"
    f.write_text('id,q1,q2,label\n1,"two\nlines",one line,1\n2,a,b,0\n', encoding="utf-8")
    assert read_pairs(f) == ([("two\nlines", "one line", 1), ("a", "b", 0)], 0)


def test_each_tier_counts_right_and_wrong_hits_and_refusals_and_every_namespace_goes():
    stub = Stub({"same": (True, False, ""), "trap": (True, False, ""),
                 "guarded": (False, True, "numbers differ: 200 mg, 400 mg"),
                 "scored": (False, True, "verifier score 0.872 below 0.880"),
                 "far": (False, False, "")})
    pairs = [("a", "same", 1), ("b", "trap", 0), ("c", "guarded", 0), ("d", "scored", 1),
             ("e", "far", 1)]
    out = score(stub, pairs, ("strict", "relaxed"), 0.97, run="r")
    assert stub.stored == stub.invalidated == [f"pairs-r-{n}" for n in range(5)]
    assert stub.tiers[:2] == [("strict", 0.97), ("relaxed", 0.97)]
    f = out["strict"].figures()
    assert (f["pairs"], f["same_meaning"], f["true_hits"], f["false_hits"]) == (5, 3, 1, 1)
    assert (f["precision"], f["recall"], f["false_hit_rate"]) == (0.5, 1 / 3, 0.5)
    assert f["refused_by_guard_or_verifier"] == 2
    assert f["refusals_by_reason"] == {"numbers differ": 1,
                                       "verifier score below the tier's cut": 1}
    assert Tally().figures()["precision"] is None  # no hit: no precision, not 0


def test_a_failed_lookup_still_invalidates_its_namespace():
    stub = Stub({"same": (True, False, "")}, fail_on="boom")
    with pytest.raises(RuntimeError):
        score(stub, [("a", "same", 1), ("b", "boom", 0)], ("strict",), run="r")
    assert stub.invalidated == stub.stored == ["pairs-r-0", "pairs-r-1"]


@pytest.mark.parametrize("args,said", [
    (["--tiers", "medical"], "unknown tier(s) medical"),
    (["--limit", "-1"], "--limit must be >= 0"),
])
def test_bad_options_are_refused_before_any_call(tmp_path, capsys, args, said):
    pairs = tmp_path / "p.tsv"
    pairs.write_text("a\tb\t1\n")
    with pytest.raises(SystemExit) as e:
        main([str(pairs), "--address", "127.0.0.1:1", *args])
    assert e.value.code == 2 and said in capsys.readouterr().err
