"""The namespace index's rules at their edges: the merge and purge thresholds the module docs
promise, merges held against adds, and what `adopt` must refuse or purge.

Written for what a mutation audit found no test checking; each was seen failing on a hand-made
mutant of the rule it checks."""

from __future__ import annotations

import numpy as np

from services.semantic.index import IndexParams, NamespaceIndex
from tests.semantic.test_index import _unit, counting_builds, settled
from tests.semantic.test_snapshot import PARAMS, hnsw_of
from tests.waits import holds_within


def test_a_search_past_a_few_tombstones_takes_one_pass():
    """_EXTRA_K: a few tombstones at the top of the list must not cost a second search."""
    rng = np.random.default_rng(11)
    vecs = _unit(rng, 100)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000), background=False)
    idx.add_many(np.arange(100), vecs)
    order = np.argsort(-(vecs @ vecs[0]))
    for lab in order[:3]:  # the query's own row and its two nearest
        idx.remove(int(lab))
    passes = []
    real = idx._search_snapshot

    def counting(*a, **kw):
        passes.append(a[-1])
        return real(*a, **kw)

    idx._search_snapshot = counting
    assert idx.search(vecs[0], 1)[0].label == int(order[3])
    assert len(passes) == 1, passes


def test_tombstones_are_purged_when_more_than_a_quarter_and_64_not_at_exactly():
    rng = np.random.default_rng(12)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000), background=False)
    idx.add_many(np.arange(200), _unit(rng, 200))
    for lab in range(64):  # 64 of 136 live: at the rule, not past it
        idx.remove(lab)
    assert len(idx._dead) == 64 and len(idx._snap.main_labels) == 200
    idx.remove(64)  # 65 > max(64, 135 // 4): purged
    assert len(idx._dead) == 0 and len(idx._snap.main_labels) == 135
    idx.check_integrity()


def test_a_delta_three_quarters_full_is_merged_in_the_background():
    rng = np.random.default_rng(13)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000, delta_capacity=16))
    vecs = _unit(rng, 12)
    for i, v in enumerate(vecs):  # 12 of 16
        idx.add(i, v)
    settled(idx)
    assert idx.kind == "flat" and idx._snap.count[0] == 0 and len(idx._snap.main_labels) == 12
    idx.close(5)


def test_adds_while_merges_are_held_start_no_merge_until_released():
    rng = np.random.default_rng(14)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000, delta_capacity=16))
    builds = counting_builds(idx)
    vecs = _unit(rng, 12)
    with idx.merges_held():
        for i, v in enumerate(vecs):  # reaches 3/4 of the delta
            idx.add(i, v)
        assert idx._merging is None and builds == []
    settled(idx)
    assert builds and idx.kind == "flat"
    idx.close(5)


def test_a_namespace_of_exactly_hnsw_min_entries_is_hnsw():
    """Flat while fewer than `hnsw_min_entries`, else HNSW (module docs)."""
    rng = np.random.default_rng(15)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=100), background=False)
    idx.add_many(np.arange(100), _unit(rng, 100))
    assert idx.kind == "hnsw"
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=100), background=False)
    idx.add_many(np.arange(99), _unit(rng, 99))
    assert idx.kind == "flat"


def test_a_graph_whose_live_entries_fell_below_hnsw_min_is_rebuilt_flat_at_a_merge():
    rng = np.random.default_rng(16)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=100, delta_capacity=16),
                         background=False)
    idx.add_many(np.arange(110), _unit(rng, 110))
    assert idx.kind == "hnsw"
    for lab in range(40):  # 40 tombstones: too few to purge
        idx.remove(lab)
    vecs = _unit(rng, 17)
    for i, v in enumerate(vecs):  # the 17th add merges inline: 70 + 16 live < 100
        idx.add(1000 + i, v)
    assert idx.kind == "flat" and len(idx._dead) == 0
    assert idx.search(vecs[5], 1)[0].label == 1005
    idx.check_integrity()


def test_a_graph_holding_one_label_past_those_issued_is_not_adopted():
    labels, vecs = np.arange(1, 101, dtype=np.int64), _unit(np.random.default_rng(17), 100, 16)
    main, saved = hnsw_of(labels, vecs)
    index = NamespaceIndex(PARAMS, background=False)
    assert not index.adopt(main, saved, labels[:99], vecs[:99], 99)
    assert index.kind == "empty"
    assert index.adopt(main, saved, labels[:99], vecs[:99], 100)


def test_a_graph_holding_a_label_twice_is_not_adopted():
    labels, vecs = np.arange(1, 101, dtype=np.int64), _unit(np.random.default_rng(18), 100, 16)
    main, saved = hnsw_of(labels, vecs)
    twice = saved.copy()
    twice[6] = twice[5]  # row 6 claims row 5's label
    live = np.array([lab != saved[6] for lab in labels])
    index = NamespaceIndex(PARAMS, background=False)
    assert not index.adopt(main, twice, labels[live], vecs[live], 100)
    assert index.kind == "empty" and len(index) == 0


def test_an_adopted_graph_searches_with_the_configured_ef_search():
    """efSearch is not among the snapshot's settings: a changed one must apply on adopt."""
    labels, vecs = np.arange(1, 101, dtype=np.int64), _unit(np.random.default_rng(19), 100, 16)
    main, saved = hnsw_of(labels, vecs)
    params = PARAMS._replace(hnsw_ef_search=128)
    index = NamespaceIndex(params, background=False)
    assert index.adopt(main, saved, labels, vecs, 100)
    assert index._snap.main.hnsw.efSearch == 128


def test_an_adopted_graph_with_many_entries_gone_is_purged_by_the_usual_rule():
    labels, vecs = np.arange(1, 201, dtype=np.int64), _unit(np.random.default_rng(20), 200, 16)
    main, saved = hnsw_of(labels, vecs)
    index = NamespaceIndex(PARAMS, background=False)
    assert index.adopt(main, saved, labels[:100], vecs[:100], 200)  # 100 gone: > 64, > 1/4
    assert len(index._dead) == 0 and len(index._snap.main_labels) == 100
    assert index.search(vecs[7], 1)[0].label == 8
    index.check_integrity()


def test_a_running_merge_stops_after_its_build_once_merges_are_held():
    """merges_held: "a running merge stops after its current build" even if the delta filled
    again meanwhile (it would otherwise build again for an index about to be emptied)."""
    import threading

    rng = np.random.default_rng(21)
    idx = NamespaceIndex(IndexParams(32, hnsw_min_entries=1000, delta_capacity=16))
    go = threading.Event()
    builds = []
    real = idx._build

    def gated_build(*a, **kw):
        builds.append(kw.get("purge", False))
        assert go.wait(30)
        return real(*a, **kw)

    idx._build = gated_build
    vecs = _unit(rng, 40)
    for i in range(12):  # 3/4 of the delta: a merge starts and waits in its build
        idx.add(i, vecs[i])
    holds_within(lambda: builds, 30, 0.01)
    assert builds == [False]
    with idx.merges_held():
        for i in range(12, 40):  # the delta fills again behind the build
            idx.add(i, vecs[i])
        go.set()
        settled(idx)
        assert builds == [False]  # stopped after the one build
        assert all(idx.search(vecs[i], 1)[0].label == i for i in (0, 20, 39))
    settled(idx)
    idx.check_integrity()
    idx.close(5)
