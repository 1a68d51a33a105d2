"""benchmarks/namespace_scale.py at a tiny size: its figures come from what it claims to run."""

from __future__ import annotations

import queue

from benchmarks import namespace_scale as ns


def test_a_run_loads_every_namespace_hits_and_frees_the_emptied_ones(tmp_path):
    db = str(tmp_path / "ns.db")
    ns._fill(db, 20, 2)
    out: queue.Queue = queue.Queue()
    ns._run(20, 2, db, out)
    r = out.get_nowait()
    assert r["lookup_hits"] == ns.CALLS  # each Lookup asks a stored prompt of a held namespace
    assert r["emptied_left"] == {"indexes": 0, "ns_lru": 0, "removing": 0, "expiring_ns": 0}
    assert r["load_s"] >= 0 and r["py_kb_per_ns"] > 0 and r["snap_load_s"] >= 0
    ns._live(20, 2, str(tmp_path / "live.db"), out)
    assert set(out.get_nowait()) == {"live_rss_kb_per_ns", "live_store_ms_last_1000"}
