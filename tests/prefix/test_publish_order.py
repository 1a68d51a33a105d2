"""Batch numbers after RESYNC: a timed-out batch still queued at the index must not take the
place of the replica's resync (a real index server, a gate standing in for its lock)."""

from __future__ import annotations

import threading

import grpc
from tiercache.v1 import prefix_pb2

from services.common.hashing import BlockHasher
from services.common.prefix_client import PrefixIndexClient
from services.prefix.config import PrefixConfig
from services.prefix.server import serve

BS, MODEL = 16, "tiny"


class Gate:
    """The servicer's lock, but while closed the test admits the waiting calls in the order it
    chooses (as a long call holding the real lock would, in whatever order)."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.cv = threading.Condition()
        self.closed = False
        self.waiting: list[object] = []
        self.admit: set[object] = set()
        self.exits = 0  # calls that have left the lock

    def __enter__(self) -> None:
        with self.cv:
            if self.closed:
                me = object()
                self.waiting.append(me)
                self.cv.notify_all()
                self.cv.wait_for(lambda: me in self.admit)
        self.mu.acquire()

    def __exit__(self, *exc: object) -> None:
        self.mu.release()
        with self.cv:
            self.exits += 1
            self.cv.notify_all()

    def wait_exits(self, n: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: self.exits >= n, timeout=30)

    def wait_waiters(self, n: int) -> None:
        with self.cv:
            assert self.cv.wait_for(lambda: len(self.waiting) >= n, timeout=10)

    def release(self, i: int) -> None:
        with self.cv:
            self.admit.add(self.waiting[i])
            self.cv.notify_all()

    def open(self) -> None:
        with self.cv:
            self.closed = False
            self.admit.update(self.waiting)
            self.cv.notify_all()


def stored(hs, toks, start, end):
    return prefix_pb2.KvEvent(stored=prefix_pb2.BlocksStored(
        parent_hash=hs[start - 1] if start else b"", block_hashes=hs[start:end],
        token_ids=toks[start * BS:end * BS], first_block_hash=hs[0], start_block=start))


def removed(hs):
    return prefix_pb2.KvEvent(removed=prefix_pb2.BlocksRemoved(block_hashes=hs))


def test_a_delayed_old_batch_cannot_stand_in_for_the_resync():
    svc = serve(PrefixConfig(address="127.0.0.1:0", metrics_port=-1, block_size=BS,
                             lease_seconds=1000))
    gate = Gate()
    svc.servicer.lock = gate
    c = PrefixIndexClient([svc.address], timeout=5, block_size=BS)
    try:
        toks = list(range(3 * BS))
        hs = BlockHasher(MODEL, BS).hashes(toks)
        c.register("r", "inc", "127.0.0.1:7000", MODEL, BS, 64)
        c.publish_events("r", "inc", [stored(hs, toks, 0, 2)], resync=True)
        gate.closed = True
        # Batch 2 (stored block 2) times out at the client but stays queued at the index.
        try:
            c.publish_events("r", "inc", [stored(hs, toks, 2, 3)], timeout=0.5)
            raise AssertionError("the gated call should have timed out")
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        gate.wait_waiters(1)
        # The pool evicts block 2; the next batch (stored + removed) comes with number 3.
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("r", c.publish_events(
            "r", "inc", [stored(hs, toks, 2, 3), removed([hs[2]])])))
        t.start()
        gate.wait_waiters(2)
        gate.release(1)
        t.join(10)
        assert out["r"].resync  # a gap: batch 2 has not arrived
        done = gate.exits
        gate.release(0)  # the delayed batch 2 is applied now
        gate.open()
        gate.wait_exits(done + 1)
        # The replica's resync: it holds blocks 0 and 1 only.
        assert not c.publish_events("r", "inc", [stored(hs, toks, 0, 2)], resync=True).resync
        m = c.match(MODEL, token_ids=toks)
        assert [(x.replica_id, x.matched_blocks) for x in m.matches] == [("r", 2)]
    finally:
        c.close()
        svc.stop(0)
