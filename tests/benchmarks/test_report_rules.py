"""What benchmarks/report.py writes into its tables: each value under the column that names its
unit, each target with its value and its bound, each documented command as it is run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import report
from tests.benchmarks.test_report_keys import _render

RESULTS = Path(report.RESULTS)


def test_a_verdict_only_target_shows_its_figure_and_its_bound():
    """prefix_index writes `{"bytes_per_block <= 250": true}`: the row showed no value and the
    whole name in the goal column."""
    d = {"bytes_per_block": 207.7, "hit_ratio": 0.833, "trie": {"hit_ratio": 0.831},
         "targets": {"bytes_per_block <= 250": True, "speedup_vs_token_trie >= 5": False,
                     "hit_ratio within 0.01 of the trie": True, "something else": True}}
    got = report.targets_of(d)
    assert got[0] == ("bytes_per_block", 207.7, "<= 250", True)
    assert got[1] == ("speedup_vs_token_trie", None, ">= 5", False)  # no such figure: no value
    name, value, goal, met = got[2]
    assert (name, goal, met) == ("hit_ratio difference from the trie", "<= 0.01", True)
    assert value == pytest.approx(0.002)
    assert got[3] == ("something else", None, "something else", True)
    # The dict shape is as it was.
    assert report.targets_of({"targets": {"x": {"value": 1.2, "target": ">= 1.5", "met": False}}}
                             ) == [("x", 1.2, ">= 1.5", False)]


@pytest.fixture
def rendered(results, monkeypatch) -> str:
    """REPORT.md from a copy of the stored results (conftest's `results`; plots left out)."""
    return _render(results, monkeypatch)


def _rows(text: str, head: str) -> list[list[str]]:
    lines = text.splitlines()
    i = lines.index(head)
    out = []
    for line in lines[i + 2:]:
        if not line.startswith("|"):
            break
        out.append([c.strip() for c in line.strip("|").split("|")])
    return out


def test_kvpool_ratios_are_not_in_the_seconds_column(rendered):
    kv = json.loads((RESULTS / "kvpool.json").read_text())["figures"]
    rows = {r[0]: r[1:] for r in _rows(rendered, "| case | TTFT s | ratio |")}
    assert rows["hit / miss"] == ["–", report._f(kv["ttft_ratio_hit_over_miss"])]
    assert rows["unique prompt, cache on / off"] == [
        "–", report._f(kv["ttft_ratio_cache_on_over_off_unique"])]
    assert rows["cold (nothing cached)"] == [report._f(kv["ttft_cold_s"]), "–"]


def test_prefix_index_targets_have_values_in_the_all_targets_table(rendered):
    rows = [r for r in _rows(rendered, "| benchmark | target | value | goal | met |")
            if r[0] == "prefix_index"]
    assert rows and all(r[2] != "–" for r in rows)
    assert ["prefix_index", "bytes_per_block"] == rows[0][:2] and rows[0][3] == "<= 250"


def test_the_quick_commands_are_the_ones_run(rendered):
    """`prefix_index --quick` alone writes no file: the report names the `--out` it runs."""
    assert ("`python -m benchmarks.prefix_index --quick --out "
            "benchmarks/results/prefix_index-quick.json`") in rendered
    assert "`python -m benchmarks.kvpool --quick`" in rendered


def test_a_quick_result_says_which_targets_it_did_not_judge(tmp_path, monkeypatch):
    """semantic_quick.json measures latency at 5k entries: its targets at 100k are not judged,
    and "5/5 targets met" read as the full run's."""
    out = tmp_path / "repo" / "benchmarks" / "results"
    out.mkdir(parents=True)
    full = {"targets": {"lookup_p50_ms@100k": {"value": 1.4, "target": "<= 2.0", "met": True},
                        "strict_qqp_precision": {"value": 0.93, "target": ">= 0.97",
                                                 "met": False}}}
    quick = {"quick": True, "targets": {"strict_qqp_precision": {
        "value": 0.97, "target": ">= 0.97", "met": True}}}
    (out / "semantic.json").write_text(json.dumps(full))
    (out / "semantic_quick.json").write_text(json.dumps(quick))
    monkeypatch.setattr(report, "ROOT", tmp_path / "repo")
    monkeypatch.setattr(report, "RESULTS", out)
    for name in ("plot_ttft", "plot_hits_over_time", "plot_pool", "plot_decode",
                 "plot_semantic", "plot_index"):
        monkeypatch.setattr(report, name, lambda *a, **k: None)
    text = report.write_report(True).read_text()
    assert "| semantic | `benchmarks/results/semantic_quick.json` (quick run) | – | – | 1/1 |" \
        in text
    assert "a quick run leaves out those its reduced run does not measure (semantic: " \
        "lookup_p50_ms@100k)" in text
    # The full report has nothing to say.
    assert "a quick run leaves out" not in report.write_report(False).read_text()


def test_every_decode_step_table_names_its_file(rendered):
    for name in ("step_profile_cuda.json", "step_profile_cpu.json"):
        if (RESULTS / name).exists():
            assert f"(`benchmarks/results/{name}`; `python -m benchmarks.step_profile" in rendered


def test_the_device_study_names_the_file_its_pairs_came_from(rendered):
    """Its pairs are assisted.json's; "of the near pairs above" read as the quick run's."""
    if (RESULTS / "device_cuda.json").exists():
        assert "12 of the near pairs in `benchmarks/results/assisted.json`)" in rendered
        assert "of the near pairs above" not in rendered


def test_each_run_of_the_benchmarks_logs_to_a_folder_of_its_own_said_at_its_start(
        tmp_path, monkeypatch, capsys):
    """`--run` logged each benchmark to one fixed /tmp/tiercache-bench-logs/<name>.log: a second
    run (side by side, or a rerun of a failure) overwrote the first's log."""
    import tempfile

    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "__init__.py").write_text("")
    (root / "benchmarks" / "kvpool.py").write_text(
        "import os\nprint('run', os.environ['BENCH_RUN'])\n")
    monkeypatch.setattr(report, "ROOT", root)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    logs = []
    for run in ("first", "second"):
        monkeypatch.setenv("BENCH_RUN", run)
        st = report.run_all(False, ["kvpool"])["kvpool"]
        assert st["status"] == "ok", st
        logs.append(Path(st["log"]))
    a, b = logs
    assert a.parent != b.parent and a.parent.parent == b.parent.parent == tmp_path
    assert a.read_text() == "run first\n" and b.read_text() == "run second\n"
    out = capsys.readouterr().out
    assert f"[report] benchmark logs in {a.parent}\n" in out
    assert f"[report] benchmark logs in {b.parent}\n" in out
