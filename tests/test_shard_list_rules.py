"""Rules of `services.common.shard_list` (how a shard reports shard lists that differ) that
the mutation audit found unguarded: the warning is written at most once a minute."""

from __future__ import annotations

import logging

from services.prefix.shard_list import ShardListCheck
from tests.clock import Clock


def test_a_mismatch_warns_at_most_once_a_minute(caplog):
    """A misconfigured caller mismatches on every call: one warning, then none until a minute
    after it (each mismatch is still counted)."""
    clock = Clock()
    c = ShardListCheck(clock)
    c.registered("r0", 2, "aaaa")
    caplog.set_level(logging.WARNING, "services.prefix.shard_list")
    assert not c.check(3, "bbbb", ["r0"])
    for _ in range(5):
        clock.t += 11  # 55 s after the warning in all
        assert not c.check(3, "bbbb", ["r0"])
    assert len(caplog.records) == 1
    clock.t += 5
    assert not c.check(3, "bbbb", ["r0"])
    assert len(caplog.records) == 2 and c.mismatches_total == 7


def test_a_side_says_its_own_list_as_the_notes_name_it():
    """A note named the lists by fingerprint only, and no start line said whose list had
    which: `said` is what the orchestrator's ready line and kvpool's registration line add."""
    from types import SimpleNamespace

    from tiercache.v1 import common_pb2

    from services.common.addresses import shard_fingerprint
    from services.common.shard_list import said
    from services.orchestrator.__main__ import shard_lists_said
    from services.orchestrator.backends import SemanticBackend
    from services.orchestrator.prefix_backend import PrefixBackend

    def sent(addrs: list[str]) -> common_pb2.ShardList:
        return common_pb2.ShardList(shards=len(addrs), fingerprint=shard_fingerprint(addrs))

    two, three = ["p-0:1", "p-1:1"], ["p-0:1", " P-1.:1", "p-2:1"]
    c = ShardListCheck(Clock())
    c.registered("r0", 2, shard_fingerprint(two))
    assert not c.check(3, shard_fingerprint(three), ["r0"])
    assert said(sent(two)) in c.note() and said(sent(three)) in c.note()
    assert said(sent(["a:1"])) == f"1 shard ({shard_fingerprint(['a:1'])})"
    # The lists as the orchestrator's clients send them (addresses stripped, blanks left out).
    orch = SimpleNamespace(semantic=SemanticBackend("s-0:2, s-1:2", "", 1.0),
                           prefix=PrefixBackend(tuple(three), "", 0.5, block_size=16))
    assert shard_lists_said(orch) == (f"; semantic shard list {said(sent(['s-0:2', 's-1:2']))}"
                                      f"; prefix shard list {said(sent(three))}")
    assert shard_lists_said(SimpleNamespace(semantic=SemanticBackend("", "", 1.0),
                                            prefix=None)) == ""


def test_one_mismatch_is_said_in_the_singular():
    """A scaling walkthrough: "(1 such Matches in all)"."""
    import logging

    from prometheus_client import CollectorRegistry, Counter

    from services.common.shard_list import MismatchReport

    now = [0.0]
    metric = Counter("t_mismatch", "t", registry=CollectorRegistry())
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    log = logging.getLogger("test.shard_list.singular")
    log.addHandler(Keep())
    r = MismatchReport(lambda: now[0], metric, log, tier="prefix", between="a and b",
                       calls=("Match", "Matches"), advice="fix it")
    r.record("x")
    assert r.note().endswith("(1 such Match in all)")
    assert "(1 such Match since the last warning)" in seen[0]
    r.record("x")
    assert r.note().endswith("(2 such Matches in all)")
