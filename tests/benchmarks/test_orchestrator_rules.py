"""The orchestrator benchmark's headline figures when a run answered nothing."""

from __future__ import annotations

import json

from benchmarks import orchestrator as orch
from clients.python.replay import Outcome


def outcome(ttft: float, cached: int, error: str = "") -> Outcome:
    return Outcome("s", "t", 0, "turn", 0.0, ttft, ttft + 50, 1000, cached, 16, False, 0.0,
                   "kvpool-0", "prefix", error)


def test_caches_off_answering_nothing_is_no_speedup_and_the_result_is_written(tmp_path,
                                                                             monkeypatch):
    """Every caches-off request failed: its median TTFT is None, and dividing by it was a
    TypeError after all the runs (minutes of them), with nothing written."""
    runs = {"tiercache": [outcome(200.0, 960)], "round_robin": [outcome(250.0, 480)],
            "caches_off": [outcome(0.0, 0, error="DEADLINE_EXCEEDED: x")]}

    def fake_run_variant(name, spec, **kw):
        res = orch.summarize(runs[name], ("kvpool-0", "kvpool-1"))
        res["model_served"] = [("s", 0)]
        return res

    monkeypatch.setattr(orch, "run_variant", fake_run_variant)
    monkeypatch.setattr(orch, "pool_blocks", lambda spec: ({}, 100))
    monkeypatch.setattr(orch, "reuse_rows", lambda spec, max_tokens: [(("s", 0), 1000, 992)])
    out = tmp_path / "o.json"
    assert orch.main(["--repeat", "1", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["ttft_p50_speedup_vs_caches_off"] is None
    assert res["targets"]["ttft_p50_speedup_vs_caches_off"] == {
        "target": ">= 3.0", "value": None, "met": False}
    assert res["prefix_hit_ratio_vs_round_robin"] == 2.0
