"""The benchmark workload's paraphrased repeats: each a different session's paraphrase; where
its questions are read from."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import workload
from benchmarks.workload import WorkloadSpec, _repeats_after_their_originals, generate

ROOT = Path(__file__).resolve().parents[2]


def test_every_repeat_paraphrases_a_different_earlier_session():
    """Drawn with replacement, 6 of the orchestrator benchmark's 12 repeats asked the first
    session's one paraphrase: after the first, each was an exact repeat of an earlier repeat,
    a hit by text, and the semantic hit rate read 0.15 where paraphrase hits were 0.03."""
    for seed in (0, 1, 3, 7):
        w = generate(WorkloadSpec(seed=seed))
        repeats = [r for r in w.requests if r.kind == "repeat"]
        assert repeats and len({r.repeat_of for r in repeats}) == len(repeats)
        assert len({r.question for r in repeats}) == len(repeats)
        first = {r.session_id: r.at for r in w.requests if r.turn == 0 and r.kind == "turn"}
        assert all(first[r.repeat_of] < r.at for r in repeats)  # after what they repeat
    assert _repeats_after_their_originals(["fresh", "repeat", "repeat", "fresh", "fresh"]) == [
        "fresh", "repeat", "fresh", "repeat", "fresh"]


def test_a_missing_data_folder_is_one_line_naming_the_file_and_the_variable(tmp_path,
                                                                           monkeypatch):
    """The README's `python -m benchmarks.workload --out ...` from a checkout without
    ../shared/data was a FileNotFoundError traceback."""
    monkeypatch.setattr(workload, "DATA", tmp_path / "none")
    with pytest.raises(SystemExit) as e:
        workload.main(["--out", str(tmp_path / "t.jsonl"), "--sessions", "1"])
    msg = str(e.value.code)
    assert msg.startswith("error: ") and "qqp_val.csv" in msg and "TIERCACHE_DATA_DIR" in msg
    assert not (tmp_path / "t.jsonl").exists()


def test_the_data_folder_is_taken_from_tiercache_data_dir(tmp_path):
    """As services.semantic.labelled_data reads it (the workload ignored the variable)."""
    env = dict(os.environ, TIERCACHE_DATA_DIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "gen")]))
    r = subprocess.run([sys.executable, "-c", "from benchmarks import workload; "
                        "print(workload.DATA)"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == str(tmp_path)
