"""Bounded fuzzing (hypothesis): the public orchestrator API answers every random request with a
documented status (never INTERNAL or UNKNOWN), and the prefix index's event stream keeps its
integrity under random events and sequence numbers, converging to the truth after a resync.

Bounds: a fixed number of examples per test and a per-test wall-clock cap, so `make test` stays
predictable; `HARDENING_FUZZ_EXAMPLES=N` multiplies the counts for a longer local run.
"""

from __future__ import annotations

import os
import random

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiercache.v1 import orchestrator_pb2

from services.common.errors import InvalidArgument, NotFound, ResourceExhausted
from services.common.hashing import BlockHasher
from services.prefix.index import Cleared, PrefixIndex, Removed, Stored
from tests.hardening.conftest import ADMIN, TOK_A, call, md

# Each fuzz test is also capped in wall-clock time (pytest-timeout), whatever the examples cost.
pytestmark = pytest.mark.timeout(240)
SCALE = int(os.environ.get("HARDENING_FUZZ_EXAMPLES", "1"))
DOCUMENTED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
              grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED,
              grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAVAILABLE,
              grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.FAILED_PRECONDITION}
FUZZ = settings(max_examples=25 * SCALE, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# ---- orchestrator -------------------------------------------------------------------------------

text = st.one_of(st.text(max_size=40), st.sampled_from(["", " ", "hi", "\x00", "🙂" * 5]))
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, 0.5, 1.0, -1.0]))
i32 = st.one_of(st.integers(-(2**31), 2**31 - 1), st.integers(-2, 20))
u32 = st.one_of(st.integers(0, 2**32 - 1), st.integers(0, 50_000))
role = st.one_of(st.sampled_from(["user", "system", "assistant"]), text)
token = st.sampled_from([TOK_A, ADMIN, "", "nope"])


@st.composite
def generate_requests(draw) -> orchestrator_pb2.GenerateRequest:
    r = orchestrator_pb2.GenerateRequest(session_id=draw(text),
                                         return_token_ids=draw(st.booleans()))
    for _ in range(draw(st.integers(0, 3))):
        r.messages.add(role=draw(role), content=draw(text))
    if draw(st.booleans()):
        r.prompt = draw(text)
    s = r.sampling
    s.max_tokens = draw(i32)
    s.temperature = draw(floats)
    s.top_p = draw(floats)
    s.seed = draw(st.integers(0, 2**64 - 1))
    s.stop_token_ids.extend(draw(st.lists(u32, max_size=3)))
    s.ignore_eos = draw(st.booleans())
    p = r.cache_policy
    p.skip_semantic_lookup, p.skip_semantic_store, p.skip_prefix_cache, p.skip_draft = (
        draw(st.booleans()) for _ in range(4))
    p.semantic_tier = draw(st.one_of(st.sampled_from(["", "strict", "standard", "relaxed"]),
                                     text))
    p.semantic_threshold = draw(floats)
    return r


@st.composite
def warm_requests(draw) -> orchestrator_pb2.WarmRequest:
    r = orchestrator_pb2.WarmRequest(top_k=draw(st.one_of(u32, st.integers(0, 3))),
                                     target=draw(st.integers(0, 5)),
                                     pin_ttl_seconds=draw(st.integers(0, 120)))
    for _ in range(draw(st.integers(0, 2))):
        wp = r.prompts.add(prompt=draw(text))
        for _ in range(draw(st.integers(0, 2))):
            wp.messages.add(role=draw(role), content=draw(text))
    return r


def documented(out, what) -> None:
    assert out.code in DOCUMENTED, (what, out.code, out.details)
    assert "Traceback" not in out.details


@pytest.fixture(scope="module")
def orch_channel(stack):
    ch = grpc.insecure_channel(stack.orch.address)
    yield ch
    ch.close()


@pytest.fixture
def stack_intact(stack):
    """After a fuzz test the stack it fuzzed still stands (UNAVAILABLE and DEADLINE_EXCEEDED
    are documented answers, so a crashed or wedged service would pass the calls alone): no
    process exited, every replica idle with no block lost, every dependency healthy."""
    yield
    dead = [p.name for p in stack.all() if p.proc is None or p.proc.poll() is not None]
    assert not dead, f"exited: {dead}"
    stack.wait_kv_idle()
    deps = stack.admin_stats().dependencies
    assert deps and all(d.healthy for d in deps), deps


@pytest.mark.e2e
@pytest.mark.model
@settings(FUZZ, max_examples=30 * SCALE)
@given(req=generate_requests(), tok=token)
def test_fuzz_generate(orch_channel, stack_intact, req, tok):
    out = call(orch_channel, "/tiercache.v1.Orchestrator/Generate", req.SerializeToString(),
               stream=True, metadata=md(tok) if tok else None, timeout=60)
    documented(out, req)
    if out.code == grpc.StatusCode.OK:
        finals = [orchestrator_pb2.GenerateResponse.FromString(b) for b in out.responses]
        assert finals[-1].HasField("final")  # a stream that succeeds ends with its final


@pytest.mark.e2e
@pytest.mark.model
@settings(FUZZ, max_examples=15 * SCALE)
@given(req=warm_requests(), tok=token)
def test_fuzz_warm(orch_channel, stack_intact, req, tok):
    out = call(orch_channel, "/tiercache.v1.Orchestrator/Warm", req.SerializeToString(),
               metadata=md(tok) if tok else None, timeout=60)
    documented(out, req)


@pytest.mark.e2e
@pytest.mark.model
@settings(FUZZ, max_examples=40 * SCALE)
@given(entry=text, rating=st.integers(-3, 2**31 - 1), tok=token,
       method=st.sampled_from(["Feedback", "Stats"]), garbage=st.binary(max_size=48))
def test_fuzz_feedback_stats_and_raw_bytes(orch_channel, stack_intact, entry, rating, tok,
                                           method, garbage):
    req = orchestrator_pb2.FeedbackRequest(semantic_entry_id=entry, rating=rating)
    payload = req.SerializeToString() if method == "Feedback" else b""
    meta = md(tok) if tok else None
    documented(call(orch_channel, f"/tiercache.v1.Orchestrator/{method}", payload,
                    metadata=meta), (method, req))
    # Arbitrary bytes as the request of any method: parsed by the interceptor, never INTERNAL.
    target = random.Random(len(garbage)).choice(["Generate", "Warm", "Feedback", "Stats"])
    documented(call(orch_channel, f"/tiercache.v1.Orchestrator/{target}", garbage,
                    stream=target == "Generate", metadata=md(TOK_A), timeout=60),
               (target, garbage))


# ---- the prefix index's event stream (pure: the servicer adds only proto conversion) ----------

BS = 4
KEY = b"fuzz-key"
H = BlockHasher("m", BS, KEY)


class Replica:
    """What a replica really holds: a prefix-closed set of chained blocks."""

    def __init__(self) -> None:
        self.blocks: dict[bytes, tuple[bytes, list[int]]] = {}  # hash -> (parent, tokens)

    def leaves(self) -> list[bytes]:
        parents = {p for p, _ in self.blocks.values()}
        return [h for h in self.blocks if h not in parents]

    def depth(self, h: bytes) -> int:
        d = 0
        while self.blocks[h][0]:
            h, d = self.blocks[h][0], d + 1
        return d

    def snapshot(self) -> list[Stored]:
        """One event per block, in no particular order (the index must not care)."""
        out = [Stored(p, [h], toks, "", b"" if p else h, self.depth(h))
               for h, (p, toks) in self.blocks.items()]
        random.Random(len(out)).shuffle(out)
        return out


op = st.one_of(
    st.tuples(st.just("store"), st.lists(st.integers(0, 3), min_size=1, max_size=4),
              st.integers(1, 3)),
    st.tuples(st.just("evict"), st.integers(0, 5), st.just(0)),
    st.tuples(st.just("clear"), st.just(0), st.just(0)),
    st.tuples(st.just("junk"), st.integers(0, 2), st.just(0)),
)
seq_mode = st.sampled_from(["next", "next", "next", "replay", "gap", "zero"])


@settings(FUZZ, max_examples=60 * SCALE)
@given(steps=st.lists(st.tuples(op, seq_mode), min_size=1, max_size=25))
def test_fuzz_index_event_stream_converges_after_resync(steps):
    idx = PrefixIndex(BS, hash_key=KEY, lease_seconds=1e9, verify_hashes=True, max_events=16)
    idx.register("r", "i", "a:1", "m", BS, 64, H.probe())
    truth = Replica()
    seq = 1
    for (kind, a, b), mode in steps:
        events = []
        if kind == "store":
            # Tokens drawn from a tiny alphabet so that chains share prefixes.
            toks = [t * 7 + j for t in a for j in range(BS)][: b * BS] or list(range(BS))
            toks = toks[: len(toks) // BS * BS]
            hs = H.hashes(toks, "")
            parent = b""
            for i, h in enumerate(hs):
                truth.blocks.setdefault(h, (parent, toks[i * BS:(i + 1) * BS]))
                parent = h
            events.append(Stored(b"", hs, toks, "", hs[0], 0))
        elif kind == "evict":
            gone = truth.leaves()[:a]
            for h in gone:
                del truth.blocks[h]
            if gone:
                events.append(Removed(gone))
        elif kind == "clear":
            truth.blocks.clear()
            events.append(Cleared())
        else:  # malformed: must be refused whole, state untouched
            events = [Removed([b"short"])] if a == 0 else [Stored(b"", [b"\x00" * 16],
                                                                   [1, 2, 3, 4], "", b"", 0)]
        s = {"next": seq, "replay": max(1, seq - 1), "gap": seq + 2, "zero": 0}[mode]
        before = idx.stats().nodes
        try:
            r = idx.publish("r", "i", s, events)
            assert kind != "junk" or s != seq, "a malformed batch was accepted"
            if not r.resync and s == seq:
                seq = r.next_seq
        except InvalidArgument:
            assert kind == "junk" or mode == "zero"
            assert idx.stats().nodes == before
        except (NotFound, ResourceExhausted) as e:  # pragma: no cover - would be a bug
            raise AssertionError(e) from e
        idx.check_integrity()
    # The replica's snapshot, sent as a resync: the index now says exactly what it holds.
    r = idx.publish("r", "i", seq, truth.snapshot(), resync=True)
    assert not r.resync
    idx.check_integrity()
    held = {rep.replica_id: rep.held_blocks for rep in idx.stats().replicas}
    assert held.get("r", 0) == len(truth.blocks)
    for h in truth.leaves():
        # Walk up to the root: the whole chain is matched, block for block.
        chain = []
        while h:
            p, toks = truth.blocks[h]
            chain[:0] = toks
            h = p
        m = idx.match("m", "", chain)
        assert m.matches and m.matches[0].matched_blocks == len(chain) // BS
