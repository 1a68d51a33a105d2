"""Property test: the index against a naive dict of token tuples, integrity after every step.

Reference semantics (what the index documents): a replica holds a set of prefixes (token
tuples from the root, per salt); a stored block counts only if the replica holds its parent;
removing a block removes every held prefix that extends it; a match for a replica is the
longest run of leading blocks it holds.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from services.common.hashing import BlockHasher
from services.prefix.index import Cleared, Removed
from tests.clock import Clock

from .conftest import BS, KEY, MODEL, make_index, stored, toks

REPLICAS = ("a", "b", "c")
chains = st.lists(st.integers(0, 2), min_size=1, max_size=4)
salts = st.sampled_from(["", "t"])
ops = st.one_of(
    st.tuples(st.just("store"), st.sampled_from(REPLICAS), chains, salts, st.integers(0, 3),
              st.integers(1, 4)),
    st.tuples(st.just("store"), st.sampled_from(REPLICAS), chains, salts, st.just(0),
              st.integers(1, 4)),
    st.tuples(st.just("remove"), st.sampled_from(REPLICAS), chains, salts, st.integers(0, 4)),
    st.tuples(st.just("clear"), st.sampled_from(REPLICAS)),
    st.tuples(st.just("restart"), st.sampled_from(REPLICAS)),
    st.tuples(st.just("match"), chains, salts),
    # The sweeper's reaping of what a clear or a restart left unheld, a few slots at a time.
    st.tuples(st.just("reap"), st.integers(0, 5)),
)


class Naive:
    def __init__(self) -> None:
        self.held: dict[str, set[tuple]] = {r: set() for r in REPLICAS}

    def store(self, r: str, salt: str, tokens: list[int], start: int, end: int) -> None:
        for j in range(start, end):
            if j and (salt, tuple(tokens[: j * BS])) not in self.held[r]:
                return
            self.held[r].add((salt, tuple(tokens[: (j + 1) * BS])))

    def remove(self, r: str, salt: str, prefix: list[int]) -> None:
        p = tuple(prefix)
        if (salt, p) in self.held[r]:
            self.held[r] = {(s, q) for s, q in self.held[r] if not (s == salt and q[: len(p)] == p)}

    def match(self, salt: str, tokens: list[int]) -> dict[str, int]:
        out = {}
        for r in REPLICAS:
            k = 0
            held = self.held[r]
            while (k + 1) * BS <= len(tokens) and (salt, tuple(tokens[: (k + 1) * BS])) in held:
                k += 1
            out[r] = k
        return out

    def nodes(self) -> int:
        return len(set().union(*self.held.values()))


def _run(steps, max_nodes: int) -> None:
    clock = Clock()
    index = make_index(clock, max_nodes=max_nodes, lease_seconds=1e9)
    hasher = BlockHasher(MODEL, BS, KEY)
    ref = Naive()
    inc = dict.fromkeys(REPLICAS, 0)
    seq = dict.fromkeys(REPLICAS, 1)
    for r in REPLICAS:
        index.register(r, "0", f"addr-{r}", MODEL, BS)
    pruning = max_nodes < 10**6
    probes: list[tuple[str, list[int]]] = []
    for op in steps:
        kind = op[0]
        if kind in ("store", "remove"):
            probes = [(op[3], toks(*op[2]))] + probes[:3]
        if kind == "store":
            _, r, chain, salt, start, n = op
            tokens = toks(*chain)
            start = min(start, len(chain) - 1)
            end = min(len(chain), start + n)
            index.publish(r, str(inc[r]), seq[r], [stored(hasher, tokens, start, salt, end)])
            seq[r] += 1
            ref.store(r, salt, tokens, start, end)
        elif kind == "remove":
            _, r, chain, salt, j = op
            j = min(j, len(chain) - 1)
            tokens = toks(*chain)
            index.publish(r, str(inc[r]), seq[r], [Removed([hasher.hashes(tokens, salt)[j]])])
            seq[r] += 1
            ref.remove(r, salt, tokens[: (j + 1) * BS])
        elif kind == "clear":
            index.publish(op[1], str(inc[op[1]]), seq[op[1]], [Cleared()])
            seq[op[1]] += 1
            ref.held[op[1]] = set()
        elif kind == "restart":
            r = op[1]
            inc[r] += 1
            seq[r] = index.register(r, str(inc[r]), f"addr-{r}", MODEL, BS).next_seq
            ref.held[r] = set()
        elif kind == "reap":
            left = index.tree.unheld
            assert index.reap(op[1]) <= left
        else:
            _, chain, salt = op
            tokens = toks(*chain) + [99]
            got = {m.replica_id: m.matched_blocks
                   for m in index.match(MODEL, salt, token_ids=tokens).matches}
            want = ref.match(salt, tokens)
            if pruning:
                # Pruning only forgets: never more than the truth.
                assert all(got[r] <= want[r] for r in REPLICAS), (got, want)
            else:
                assert got == want
        index.check_integrity()
        for salt, tokens in probes:
            got = {m.replica_id: m.matched_blocks
                   for m in index.match(MODEL, salt, token_ids=tokens).matches}
            want = ref.match(salt, tokens)
            assert all(got[r] <= want[r] for r in REPLICAS) if pruning else got == want
        if pruning:
            assert len(index.tree) <= max_nodes
        else:
            assert len(index.tree) == ref.nodes()
            for r in REPLICAS:
                assert index.tree.held[index._replicas[r].bit] == len(ref.held[r])


@settings(max_examples=150, deadline=None)
@given(st.lists(ops, min_size=5, max_size=40))
def test_index_agrees_with_naive_reference(steps):
    _run(steps, max_nodes=10**6)


@settings(max_examples=60, deadline=None)
@given(st.lists(ops, min_size=5, max_size=40))
def test_pruned_index_stays_consistent_and_never_overclaims(steps):
    _run(steps, max_nodes=6)
