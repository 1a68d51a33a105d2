"""benchmarks/report.py renders both the results written before the bound/ceiling fixes (old
keys) and those written after (new keys), into a copy of the results folder."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report

# `results` (conftest.py): a copy of the stored results, the report pointed at it.


def _render(results: Path, monkeypatch) -> str:
    # Plots are not what is tested here (and are slow).
    for name in ("plot_ttft", "plot_hits_over_time", "plot_pool", "plot_decode",
                 "plot_semantic", "plot_index"):
        monkeypatch.setattr(report, name, lambda *a, **k: None)
    return report.write_report(False).read_text()


def test_old_results_render_without_the_retired_oracle(results, monkeypatch):
    """Results written before the fixes (the stored ones are rewritten to the old keys: the
    stored files themselves are re-run into the new ones)."""
    orch = json.loads((results / "orchestrator.json").read_text())
    orch["unbounded_cache_ceiling"] = {
        "model_served": {"requests_counted": 51, "prefix_hit_token_ratio": 0.84},
        "all_requests": {"requests_counted": 60, "prefix_hit_token_ratio": 0.861},
        "ceiling_over_round_robin": 1.359, "tiercache_share_of_ceiling": 0.912}
    (results / "orchestrator.json").write_text(json.dumps(orch))
    asst = json.loads((results / "assisted.json").read_text())
    figs = asst["figures"]
    for key in [k for k in figs if "hindsight" in k or k.startswith("random_draft")]:
        figs.pop(key)
    figs["forward_passes_per_token_ngram_oracle"] = 0.536
    figs["unrelated_slowdown"] = 0.905
    asst.pop("notes", None)
    (results / "assisted.json").write_text(json.dumps(asst))
    text = _render(results, monkeypatch)
    assert "ngram_oracle" not in text
    assert "not over the requests each ratio counts" in text
    assert "Any draft turns on prompt lookup" in text


def test_new_results_render_the_matched_ceiling_and_bounds(results, monkeypatch):
    orch = json.loads((results / "orchestrator.json").read_text())
    orch["unbounded_cache_ceiling"] = {
        "model_served": {"requests_counted": 51, "prefix_hit_token_ratio": 0.84},
        "round_robin_model_served": {"requests_counted": 50, "prefix_hit_token_ratio": 0.83},
        "all_requests": {"requests_counted": 60, "prefix_hit_token_ratio": 0.861},
        "tiercache_share_of_ceiling": 0.93, "round_robin_share_of_ceiling": 0.7,
        "ceiling_over_round_robin": 1.43, "routing_ratio_ceiling": 1.45}
    (results / "orchestrator.json").write_text(json.dumps(orch))
    asst = json.loads((results / "assisted.json").read_text())
    figs = asst["figures"]
    figs.pop("forward_passes_per_token_ngram_oracle", None)
    figs.update({"forward_passes_per_token_hindsight_bound_draft": 0.344,
                 "forward_passes_per_token_hindsight_bound": 0.28,
                 "random_draft_slowdown": 0.91, "random_draft_cost_vs_lookup_only": 1.0})
    asst["notes"] = {"forward_passes_per_token_hindsight_bound":
                     "lower bounds, not estimates: with hindsight."}
    (results / "assisted.json").write_text(json.dumps(asst))
    text = _render(results, monkeypatch)
    assert "1.43x round-robin's ratio (like for like" in text
    assert "could have been is 1.45" in text
    assert "| forward_passes_per_token_hindsight_bound | 0.28 |" in text
    assert "random_draft_slowdown 0.91" in text
    assert "are lower bounds, not estimates: with hindsight." in text
    assert text.count("lower bounds, not estimates") == 1  # said once, not twice


def test_the_route_table_shows_expected_and_shortfall_and_dashes_for_older_results():
    orch = {"tiercache": {"routes": {
                "prefix": {"requests": 50, "prompt_tokens": 1000, "cached_tokens": 900,
                           "expected_tokens": 950, "shortfall_tokens": 50},
                "ring": {"requests": 8, "prompt_tokens": 0, "cached_tokens": 0}}},
            "round_robin": {"routes": {"round_robin": {"requests": 60, "prompt_tokens": 400,
                                                       "cached_tokens": 100}}}}
    text = "\n".join(report.routes_table(orch))
    assert "| tiercache | prefix | 50 | 1,000 | 900 | 0.9 | 950 | 50 |" in text
    assert "| tiercache | ring | 8 | 0 | 0 | – | – | – |" in text
    assert "| round_robin | round_robin | 60 | 400 | 100 | 0.25 | – | – |" in text
    assert report.routes_table({"tiercache": {"routes": {}}}) == []


def test_the_lapse_paragraph_reads_the_lapse_benchmark_or_says_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "ROOT", tmp_path)
    path = tmp_path / "prefix_lapse.json"
    assert report.lapse_text(path) == []
    path.write_text(json.dumps({
        "workload": {"blocks_held_by_lapsing_replica": 1000024, "nodes_left_unheld": 855416},
        "lapse_lock_ms": 36.8, "walk_clear_lock_ms": 3221.5, "reap_steps": 172,
        "reap_step_ms_max": 33.4, "reap_step_ms_p50": 19.3,
        "same_blocks_and_saved_hits_as_the_walk": True}))
    text = " ".join(report.lapse_text(path))
    assert "held 1,000,024 blocks held the index lock 36.8 ms (the walk it replaced: 3,222 ms)" \
        in text
    assert "855,416 nodes it left unheld were deleted in 172 steps of at most 33.4 ms" in text
    assert text.endswith("as the walk: yes.")


def test_the_restart_paragraph_reads_the_committed_restart_benchmark(tmp_path):
    assert report.restart_text(tmp_path / "semantic_restart.json") == []
    path = report.RESULTS / "semantic_restart.json"
    d = json.loads(path.read_text())
    text = " ".join(report.restart_text(path))
    assert "–" not in text  # every figure it names is in the file
    assert f"{d['workload']['entries']:,} entries in one namespace" in text
    assert text.endswith(f"from both: {'yes' if d['same_top10'] else 'no'}.")


def test_missing_ceiling_parts_do_not_crash():
    assert "–" in report.ceiling_text({})
    assert report.assisted_notes({}, {}) == []
    line, = report.assisted_notes({"unrelated_slowdown": 0.9}, {})
    assert "unrelated_draft_cost_vs_lookup_only –" in line


def test_device_results_render_beside_the_cpu_ones_and_vanish_without_them(results, monkeypatch):
    """The GPU check's results (`benchmarks.device`, `benchmarks.step_profile`; not part of
    `--run`) get a paragraph and a table each, with their own figures; without the files the
    report says nothing of them (no invented GPU line)."""
    text = _render(results, monkeypatch)
    for name in ("device_cuda.json", "device_cpu.json"):
        f = json.loads((results / name).read_text())["figures"]
        assert f"decode_speedup_in_process {report._f(f['decode_speedup_in_process'])}" in text
    cuda = json.loads((results / "step_profile_cuda.json").read_text())
    assert f"A decode step on {cuda['device_name']}" in text
    assert report._f(cuda["figures"]["batch_1"]["gpu_busy_ms_per_step"]) in text
    for name in ("device_cuda.json", "device_cpu.json", "step_profile_cuda.json",
                 "step_profile_cpu.json"):
        (results / name).unlink()
    text = _render(results, monkeypatch)
    assert "decode_speedup_in_process" not in text and "A decode step on" not in text


def test_semantic_latency_table_says_what_the_figures_exclude(results, monkeypatch):
    """lookup_p50/p99_ms exclude the server's embedding (the issue's targets); the table said
    only "lookup p50 ms", and the parts' hosts (kept from runs on different machines) were
    not shown."""
    sem = json.loads((results / "semantic.json").read_text())
    sem["latency"] = {"100000": {"index": "hnsw", "lookup_p50_ms": 1.25, "lookup_p99_ms": 2.5,
                                 "lookup_embed_p50_ms": 4.5, "recall_at_1_vs_exact": 0.99}}
    sem["part_runs"] = {"embed": {"at": "2026-12-03T14:03:12Z", "cpu_model": "AMD EPYC"},
                        "latency": {"at": "2026-12-05T23:07:03Z", "cpu_model": "Intel Xeon"}}
    (results / "semantic.json").write_text(json.dumps(sem))
    text = _render(results, monkeypatch)
    assert ("| entries | index | lookup p50 ms (excl. embedding) | lookup p99 ms (excl. "
            "embedding) | lookup p50 ms (with embedding) | recall@1 vs exact |") in text
    assert "| 100000 | hnsw | 1.25 | 2.5 | 4.5 | 0.99 |" in text
    assert ("Parts of this file by run (`part_runs`): embed 2026-12-03 on AMD EPYC; latency "
            "2026-12-05 on Intel Xeon.") in text


def test_assisted_near_pair_rule_is_said_beside_the_table(results, monkeypatch):
    """The target subset is chosen by the served draft's share of B's tokens, which the issue
    words as A's answer's share: the report says which, and how many drafts were A's own."""
    from benchmarks.assisted import NOTES

    asst = json.loads((results / "assisted.json").read_text())
    asst["figures"].update(near_pairs=5, near_pairs_draft_from_own_question=4)
    asst["notes"] = dict(NOTES)
    (results / "assisted.json").write_text(json.dumps(asst))
    text = _render(results, monkeypatch)
    assert "near_pairs (5, 4 drafted from their own A): the target figures" in text
    assert "The issue names A's answer" in text
    asst.pop("notes")  # results written before the note: nothing claimed
    (results / "assisted.json").write_text(json.dumps(asst))
    assert "drafted from their own A" not in _render(results, monkeypatch)
