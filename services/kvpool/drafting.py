"""What a sequence verifies next in cache-assisted generation (pure logic: no torch, no grpc).

A `Draft` holds a cached near-miss answer (token ids) for one sequence and proposes the tokens
that the sequence's next forward verifies. Before every forward it looks for where the
sequence is in two sources (suffix matching):

 1. The draft: the draft position whose preceding tokens agree longest with the end of the
    context (prompt + generated), found through an index of the draft's 1..4-grams and ranked
    by how far back the agreement goes (up to 32 tokens); among equal matches the one nearest
    where the draft was last followed. While the model follows the draft, that is simply the
    next draft token; after the model replaced a word, dropped one or inserted a clause, the
    first generated token that the draft has again re-aligns it. With no match at all right
    after the model replaced one draft token, the draft is guessed to go on right after it
    (a one-word substitution).
 2. The sequence's own context (prompt lookup): the same search among the context's earlier
    positions, for matches of 2+ tokens: answers repeat names and phrases of the question and
    of themselves. A longer match here beats the draft's; on a tie the draft wins.

The first proposal is the draft's start; it rides on the prompt's prefill forward, where extra
tokens are almost free, so it is a full (top) rung.

Gamma (tokens proposed) is one of three rungs: the lowest for a match of one token (or a
guessed substitution), the middle for two, the top for three or more, and at least a rung
above a proposal that verified in full. The rungs follow what a verify forward costs, which
differs by device: on one 2-core CPU host (MKL kernels) a forward of 2 or 3 tokens cost
1.08x / 1.16x a 1-token decode step, 4..15 tokens 1.6-2.5x and 16-17 tokens 1.9x (so
proposals of 1, 2 or 16 tokens: `LADDER`); on a 2-core AMD EPYC host 2-3 tokens cost 1.4-1.7x
and 5-6 tokens 1.0-1.3x, where `LADDER` proposed exactly the dearest lengths; with oneDNN
kernels there, 2-6 tokens cost about one token. So a replica times its forwards at start and
picks the rungs from them (`choose_ladder`, TIERCACHE_KVPOOL_DRAFT_LADDER=auto); `LADDER` is
the default of engines built without that. On a GPU a verify forward should cost about one
decode step, and the ladder is then the longest proposal throughout (not measured: no GPU).

Where the replica's timing was accepted, lengths after the first proposal are chosen by cost
instead of by rung (`Draft.length`): among the lengths on the cost frontier, the one with the
most tokens expected per cost, given how long the source's recent proposals kept verifying.
The costs are the timing's, replaced length by length by what the replica's served steps cost
(`ServedCosts`). A configured or fixed ladder keeps its rungs.

In a batch, every row's forward is as long as the longest proposal, so the engine cuts the
batch's proposals to what their expected tokens pay for (`batch_keep`), expectations scaled by
how much of them batches' proposals have lately verified (`BatchTrust`).

A sequence can verify a tree: besides the proposal, up to
`branches` - 1 short branches from the other draft positions that the context's end matches
(`Draft.alternatives`), merged into a trie (`Tree`) and checked in the same forward, each node
seeing only its own ancestors. The path the model's own choices follow is accepted (greedy: its
argmax; sampling: one draw per token, so outputs are distributed as without). Right after a
mismatch, the newest token often occurs at several draft positions and the ranking picks one;
the tree checks the runners-up at once instead of one forward each. After the model replaced a
draft token, the draft's going on at that token (the model inserted a word) and right after it
(a substitution) join them as guesses where thin matches may propose. Branches are the cheapest
length on the cost frontier (all of `top` where forwards cost alike, as expected on a GPU), and
with measured costs only as many join as their recent yield pays for: on the 2-core CPU a tree
rarely pays, with flat costs it does. In a batch, every row is padded to the longest proposal
anyway, so there a row's alternatives join as far as they fit in its padding (`room`).

Each source keeps its recent acceptance rate. Where the lowest rung's forward was timed at
about a decode step's cost (`LadderChoice.cheap_guesses`), a failed proposal costs nothing and
both sources propose on every match. Elsewhere, while the draft's rate is low, matches of one
token and substitution guesses propose nothing, and while lookup's is low, only 3-token context
matches propose, so an unrelated draft costs next to nothing. Proposals never change what is
generated (the verifier decides); they only decide how many forwards it takes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

NGRAM_MAX = 4  # longest n-gram ending the context that the indexes look up
MATCH_MAX = 32  # how far back a match is extended to rank candidates
LOOKUP_MIN = 2  # shortest context match that prompt lookup trusts
LOOKUP_CANDIDATES = 64  # latest occurrences of the matched n-gram that prompt lookup ranks
LADDER = (1, 2, 16)  # proposal lengths (see the module docstring for why these)
RUNG_BY_MATCH = {1: 0, 2: 1, 3: 2}  # first rung by the length of the match (3 = 3 or more)
RATE_ALPHA = 0.3  # weight of the newest proposal in a source's acceptance rate
WEAK_RATE_MIN = 0.2  # below this draft acceptance rate, 1-token draft matches propose nothing
LOOKUP_RATE_MIN = 0.3  # below this lookup acceptance rate, 2-token context matches are ignored

# A source's chance that a proposed token verifies, given the one before it did (lengths by
# cost, see `Draft.length`): an estimate from its own proposals, each weighed DECAY times the one
# after it, starting from one verified token and one failure.
PRIOR = (1.0, 1.0)
DECAY = 0.9

ALT_MATCH_MAX = 2  # a proposal matched on more context tokens than this gets no alternatives
ALT_PRIOR = (0.5, 2.0)  # before any tree: an alternative is expected to add 0.25 tokens
BRANCHES = 4  # most branches (the proposal and its alternatives) a tree verifies; 1 = no tree

GUESS_COST_MAX = 1.05  # see LadderChoice.cheap_guesses
CHEAPER_BY = 0.98  # a shorter proposal joins the ladder only if its forward costs this much less


def default_ladder(top: int) -> tuple[int, ...]:
    """LADDER with `top` (a replica's max_draft_tokens) as its top rung, raised or lowered to
    it, and no rung above it. (Only raised, a replica with max_draft_tokens 8 that fell back
    to the fixed lengths reported a rung of 16 it never proposes.)"""
    return tuple(min(r, top) for r in LADDER[:-1]) + (top,)


def choose_ladder(costs: dict[int, float], top: int) -> tuple[int, int, int]:
    """The ladder's three rungs (proposal lengths) for a device whose forward of q tokens
    per row costs costs[q] (relative or absolute; q = 1..top + 1, a proposal of g tokens rides
    a forward of g + 1).

    Only lengths on the cost frontier are worth proposing: one whose forward costs no less
    than a longer proposal's would verify fewer tokens for as much. The frontier is built from
    `top` down, keeping g when its forward is at least 2% cheaper (timing noise) than every
    longer one kept. Rungs: the shortest frontier length (after a miss), the one nearest
    twice it (after a match), and, while proposals verify, the one that emits the most tokens
    per cost when all of it verifies ((g + 1) / costs[g + 1]). On the 2-core CPUs
    measured (see the module docstring) the frontier starts at 1, 2 or 4 tokens; where
    forwards cost the same at any length (a GPU) it is `top` alone.
    """
    lengths = frontier(costs, top)
    low = lengths[0]
    high = max(lengths, key=lambda g: ((g + 1) / costs[g + 1], g))
    mid = min((g for g in lengths if g <= high), key=lambda g: (abs(g - 2 * low), g))
    return low, mid, high


def frontier(costs: dict[int, float], top: int) -> tuple[int, ...]:
    """The proposal lengths (ascending, at most `top`) on the cost frontier of `costs` (a
    forward of q tokens costs costs[q]; q = 2..top + 1): from `top` down, g is kept when its
    forward is at least 2% cheaper (timing noise) than every longer one kept."""
    assert top >= 1 and all(q in costs for q in range(2, top + 2)), "costs for q = 2..top+1"
    kept = [top]
    best = costs[top + 1]
    for g in range(top - 1, 0, -1):
        if costs[g + 1] <= best * CHEAPER_BY:
            kept.append(g)
            best = costs[g + 1]
    return tuple(reversed(kept))


def expected_run(p: float, g: int) -> float:
    """Tokens expected to verify of a g-token proposal whose every token verifies with chance
    p once the one before it did: p + p^2 + ... + p^g."""
    return float(g) if p >= 1.0 else p * (1.0 - p ** g) / (1.0 - p)


def forward_cost(costs: tuple[float, ...], n: int) -> float:
    """What a forward of `n` new tokens in all (rows x tokens per row) costs, in 1-token
    forwards, from `costs`: a single row's timed forwards of 1..len(costs) tokens
    (`LadderChoice.costs`).

    Rows of a batch cost about what one row of as many tokens does: the linear layers see `n`
    rows either way, and they dominate a forward of a small model (SmolLM2 on the 2-core host,
    in-process: 8 rows of 5 tokens 194 ms, one row of 40 prompt tokens 174 ms; 4 rows of one
    token 70 ms, one row of 4 tokens 72 ms). Past the timed lengths the cost goes on along the
    least-squares slope of their upper half (never down)."""
    m = len(costs)
    assert m >= 2 and n >= 1
    if n <= m:
        return costs[n - 1]
    xs = range(m // 2, m + 1)
    ys = costs[m // 2 - 1:]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) \
        / sum((x - mx) ** 2 for x in xs)
    return costs[-1] + max(slope, 0.0) * (n - m)


def batch_keep(costs: tuple[float, ...], lengths: list[int], rates: list[float],
               trust: float = 1.0) -> int:
    """How many tokens of each row's proposal a batch's forward should verify: the `k` (0 =
    none, decode plainly) with the most tokens expected per cost, proposals cut to `k`, among
    0 and the proposals' own lengths. Lengths in between are not tried: where a forward of a
    few tokens costs less than one of a single token (the oneDNN timing), one of them can be
    worth more (rows [16, 0] at rate 0.1 keep 0, 2.0 tokens per cost, where 2 gives 3.04;
    found by tests/assisted/test_drafting_differential.py, left as tuned and benchmarked).

    A batch's forward is as long as its longest row, so one row's proposal makes every row
    pay for its length: on the 2-core host one weak draft in a batch of 8 made the whole
    batch finish 1.3-1.5x later. Row i's proposal cut to k tokens is expected to emit the share
    `rates[i]` of its min(lengths[i], k) tokens (its source's recent acceptance rate) besides
    the model's own token; the forward costs `forward_cost(costs, rows x (k + 1))`. Where
    forwards were timed alike at every length (as expected on a GPU; not measured there),
    every proposal is kept. `trust`: the share of such expected tokens that batches'
    proposals have lately verified (`BatchTrust`), scaling every row's expectation."""
    b = len(lengths)
    # Without proposals every row has one token: the forward runs the 1-token path (its
    # attention too), which the timing shows dearer than one row of 4-6 tokens on oneDNN. A
    # batch of such rows costs no less than one of them (SmolLM2 on the 2-core host, in the
    # engine: 4 rows 70.8 ms, 1 row 67.7 ms; replicas' start-up timings put one row of 4
    # tokens at 0.74-0.90 of one token).
    best_k, best = 0, b / max(costs[0], forward_cost(costs, b))
    for k in sorted(set(lengths) - {0}):
        gain = trust * sum(r * min(n, k) for n, r in zip(lengths, rates, strict=True))
        value = (b + gain) / forward_cost(costs, b * (k + 1))
        if value > best:
            best_k, best = k, value
    return best_k


class BatchTrust:
    """How much of what `batch_keep` expected of a batch's kept proposals they verified lately:
    the factor it scales its expectations by (`factor`, within FLOOR..CEILING).

    Its expectation, a row's recent acceptance rate times the tokens it keeps, runs high in
    batches where every row drafts: on the Intel host, 8 near-pair drafts in one batch
    (SmolLM2, in-process) verified 364 tokens where it expected 461, and such batches
    finished 1.05-1.09x later than without drafts (`python -m benchmarks.draft_batch
    --all-draft`, B = 4 and 8). Each batch forward that kept proposals adds what was expected
    and what verified (both weighed DECAY_PER_STEP per forward since; PRIOR tokens of each to
    start)."""

    PRIOR = 8.0
    DECAY_PER_STEP = 0.97
    FLOOR, CEILING = 0.1, 2.0

    def __init__(self) -> None:
        self.expected = self.verified = self.PRIOR

    def observe(self, expected: float, verified: int) -> None:
        self.expected = self.DECAY_PER_STEP * self.expected + expected
        self.verified = self.DECAY_PER_STEP * self.verified + verified

    @property
    def factor(self) -> float:
        return min(max(self.verified / self.expected, self.FLOOR), self.CEILING)


class LadderChoice(NamedTuple):
    """The drafts' proposal lengths, where they came from, and what they were chosen from."""

    ladder: tuple[int, ...]
    # "configured" (fixed lengths), "measured" (timed at start), "given" (chosen from costs
    # configured: a timing taken elsewhere), or "fixed: <why the measurement was not used>"
    source: str
    # Forward of q = 1.. tokens / a 1-token one: what `ladder` was chosen from when measured
    # or given, or the timings refused as disturbed.
    costs: tuple[float, ...] = ()

    @property
    def measured(self) -> bool:
        """Whether `costs` are this device's accepted timing, taken at start or given by
        configuration (not fixed lengths, not refused as disturbed): what decisions by forward
        cost may rely on."""
        return self.source in ("measured", "given")

    @property
    def cheap_guesses(self) -> bool:
        """Whether a proposal of the lowest rung (g tokens, a forward of g + 1) was timed at
        most GUESS_COST_MAX of a 1-token decode step. Then a proposal resting on thin evidence
        (one matching token, a guessed substitution) costs next to nothing when it fails, and
        drafts make it however often they fail. Unmeasured (configured, fixed): no."""
        g = self.ladder[0]
        return self.measured and len(self.costs) > g \
            and self.costs[g] <= GUESS_COST_MAX * self.costs[0]


class ServedCosts:
    """Forward costs learned from the replica's own steps, over its start-up timing.

    The start-up timing (`LadderChoice.costs`) times bare forwards over a short cache, once,
    on a host that may be busy. Served steps of one sequence cost otherwise: on the 2-core
    host, in-process (SmolLM2, 8 near-pair answers), a step verifying 12 draft tokens cost
    1.31x a 1-token step against the timing's 1.18x, one verifying 5 cost 0.95x against
    0.94x. So every step with one sequence decoding is timed whole (forward, verification,
    bookkeeping) by its tokens per row q, and `now` holds each q's mean cost relative to a
    1-token step, once it and the 1-token steps have MIN_SAMPLES steps; other lengths keep the
    start-up figure. Lengths by cost and the batch rule read `now`, so new requests decode by
    what steps cost as served. A length never proposed keeps its timed figure: one timed too
    dear stays unproposed (a missed saving), one timed too cheap is proposed, served and
    corrected.

    Each q-token step is divided by the mean 1-token step *as it stands when that step is
    timed*, and those ratios are averaged. Dividing each length's mean time by the 1-token mean
    at the end put figures taken minutes apart over each other, on a host whose speed drifts:
    in-process on the Intel host (SmolLM2, the benchmark's 12 near pairs decoded plainly and
    with their drafts, 3,691 steps), the learned figures for 2-9 tokens swung with a standard
    deviation of 0.03-0.06 over the second half of the run; the ratios' swung by 0.002-0.04,
    at about the same levels (an ad-hoc trace, see the commit).
    Updated on the engine thread; readers take the `now` tuple as it stands."""

    MIN_SAMPLES = 8  # steps of a length before its served cost replaces the timed one
    ALPHA = 0.05  # weight of the newest step in a length's mean (after the first 1 / ALPHA)
    OUTLIER = 3.0  # a step this many times its length's mean was disturbed: not counted

    def __init__(self, start: tuple[float, ...]) -> None:
        self.start = tuple(start)
        self.now = self.start
        self.base = 0.0  # mean seconds of a 1-token step
        # Mean cost of a q-token step over the 1-token mean as it stood then (q = 1: 1.0).
        self.ratios = [1.0] * len(start)
        self.samples = [0] * len(start)

    def observe(self, q: int, seconds: float) -> None:
        """A step of one sequence with q tokens (its last token + q - 1 proposed) took
        `seconds`. Lengths past the timing are not learned, nor longer ones before any 1-token
        step was."""
        if not 1 <= q <= len(self.start) or seconds <= 0.0:
            return
        i = q - 1
        n = self.samples[i]
        weight = max(1.0 / (n + 1), self.ALPHA)
        if i == 0:
            if n >= self.MIN_SAMPLES and seconds > self.OUTLIER * self.base:
                return
            self.base += weight * (seconds - self.base)
        else:
            if self.samples[0] == 0:
                return
            r = seconds / self.base
            if n >= self.MIN_SAMPLES and r > self.OUTLIER * self.ratios[i]:
                return
            self.ratios[i] += weight * (r - self.ratios[i])
        self.samples[i] = n + 1
        if self.samples[0] >= self.MIN_SAMPLES:
            self.now = tuple(round(self.ratios[j], 3)
                             if self.samples[j] >= self.MIN_SAMPLES else self.start[j]
                             for j in range(len(self.start)))


class Source(Enum):
    """Where proposed tokens come from."""

    NONE = "none"
    DRAFT = "draft"  # the cached answer
    LOOKUP = "lookup"  # the sequence's own prompt and generated tokens


class Proposal(NamedTuple):
    """Tokens to verify in the next forward and their source."""

    tokens: list[int]
    source: Source


NO_PROPOSAL = Proposal([], Source.NONE)


class Branch(NamedTuple):
    """One proposal of a tree: its tokens, their source, and their first token's index there."""

    tokens: list[int]
    source: Source
    start: int


@dataclass(frozen=True)
class Tree:
    """Branches verified in one forward, merged into a trie of nodes. Node i is query position
    i + 1 of the forward (position 0, the root, is the sequence's last token); its parent is a
    node or -1 (the root), its depth its distance from the root. Branches share the nodes of a
    common prefix, and each branch's nodes come after those of the branches before it, so the
    first branch's nodes are 0..len - 1 in order."""

    branches: tuple[Branch, ...]
    tokens: tuple[int, ...]  # each node's token
    parents: tuple[int, ...]
    depths: tuple[int, ...]
    ends: tuple[int, ...]  # each branch's last node
    child: dict[tuple[int, int], int] = field(compare=False, repr=False)  # (parent, token)->node

    @classmethod
    def of(cls, branches: list[Branch]) -> Tree:
        assert branches and all(b.tokens for b in branches)
        tokens: list[int] = []
        parents: list[int] = []
        depths: list[int] = []
        ends: list[int] = []
        child: dict[tuple[int, int], int] = {}
        for b in branches:
            node = -1
            for t in b.tokens:
                nxt = child.get((node, t))
                if nxt is None:
                    nxt = child[(node, t)] = len(tokens)
                    tokens.append(t)
                    parents.append(node)
                    depths.append(depths[node] + 1 if node >= 0 else 1)
                node = nxt
            ends.append(node)
        return cls(tuple(branches), tuple(tokens), tuple(parents), tuple(depths), tuple(ends),
                   child)

    @property
    def size(self) -> int:
        """Nodes: the tokens the forward verifies besides the root."""
        return len(self.tokens)

    def walk(self, next_token: Callable[[int], int | None]) -> tuple[list[int], int | None]:
        """Verification: `next_token(i)` is the model's choice after node i (-1: after the
        root; its argmax, or a draw), or None where unknown. From the root, follow the child
        holding that token while there is one. Returns the nodes followed (the accepted path)
        and the model's token after the last of them."""
        path: list[int] = []
        node = -1
        tok = next_token(node)
        while tok is not None and (node, tok) in self.child:
            node = self.child[(node, tok)]
            path.append(node)
            tok = next_token(node)
        return path, tok

    def branch_of(self, path: list[int]) -> int:
        """The first branch that holds all of `path` (0 for an empty path)."""
        if not path:
            return 0
        for k, end in enumerate(self.ends):
            node = end
            while node >= 0 and node != path[-1]:
                node = self.parents[node]
            if node == path[-1]:
                return k
        raise ValueError("the path is not in the tree")

    def along_first(self, path: list[int]) -> int:
        """How many of `path`'s nodes the first branch holds: what it alone would have had
        accepted (its nodes are 0..len - 1; a later branch that goes on from its last node
        numbers its own nodes on from there too, and those are not the first branch's)."""
        n = min(len(path), len(self.branches[0].tokens))
        k = 0
        while k < n and path[k] == k:
            k += 1
        return k

    def visible(self) -> list[list[bool]]:
        """[q][q] for the forward's q = size + 1 positions: whether position a sees b (b is a
        or one of its ancestors; the root is everyone's)."""
        q = self.size + 1
        rows = [[b == 0 for b in range(q)] for _ in range(q)]
        rows[0][0] = True
        for i, p in enumerate(self.parents):
            rows[i + 1] = list(rows[p + 1])
            rows[i + 1][i + 1] = True
        return rows


class NgramIndex:
    """For a growing token list: each n-gram (n = 1..max_n) -> the indices right after it."""

    def __init__(self, max_n: int) -> None:
        self.max_n = max_n
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: list[int]) -> None:
        """Append tokens, indexing every n-gram that ends at one of them."""
        toks = self.tokens
        for t in tokens:
            toks.append(t)
            e = len(toks)
            for n in range(1, min(self.max_n, e) + 1):
                self.ends.setdefault(tuple(toks[e - n:e]), []).append(e)

    def sync(self, tokens: list[int]) -> None:
        """Index the tail of `tokens` (a longer version of the indexed list) not seen yet."""
        if len(tokens) > len(self.tokens):
            self.extend(tokens[len(self.tokens):])

    def after(self, key: tuple[int, ...]) -> list[int]:
        """Ascending indices right after the occurrences of `key`."""
        return self.ends.get(key, [])


@dataclass
class Draft:
    """A sequence's draft, where it stands against the generated tokens, and its proposals.

    The engine calls `propose` before a forward, then `record` and (unless the sequence ended)
    `advance` after it, also after a forward without a proposal (`update` does both);
    `withdraw` when a proposal could not be used after all.
    """

    tokens: list[int]
    index: NgramIndex  # over the draft
    self_lookup: bool = True  # propose from the sequence's own context too
    ladder: tuple[int, ...] = LADDER  # proposal lengths (the top one may be raised, see `of`)
    hint: int = 0  # draft index where the draft was last followed (breaks ties between matches)
    fresh: bool = True  # nothing proposed yet: the draft's start rides on the prefill forward
    rung: int = 0  # ladder index of the pending proposal
    floor: int = 0  # lowest rung of the next proposal: one above a proposal that fully verified
    context: NgramIndex = field(default_factory=lambda: NgramIndex(NGRAM_MAX))
    pending: Proposal = NO_PROPOSAL  # proposed, not yet verified
    start: int = 0  # index (in the draft or the context) of the pending proposal's first token
    replaced: int | None = None  # draft index of the token the model just replaced, if any
    cheap_guesses: bool = False  # a low-rung verify costs no more than a decode step
    # Lengths by cost (see `length`): a forward of q tokens costs costs[q - 1]; the lengths on
    # their frontier; per source, its weighed (verified, failed) counts behind its estimate.
    costs: tuple[float, ...] = ()
    lengths: tuple[int, ...] = ()
    runs: dict[Source, tuple[float, float]] = field(default_factory=dict)
    branches: int = 1  # most branches of a tree (`alternatives`); 1 = the proposal alone
    matched: int = 0  # how many context tokens the pending proposal's position matched
    # Weighed (tokens the alternatives added, alternatives offered): their yield (`credit`).
    alt_yield: tuple[float, float] = ALT_PRIOR
    rate: float = 1.0  # recent acceptance rate of draft proposals
    lookup_rate: float = 1.0  # recent acceptance rate of lookup proposals
    proposed: int = 0
    accepted: int = 0
    accepted_lookup: int = 0  # of `accepted`, tokens proposed by context lookup

    @classmethod
    def of(cls, tokens: list[int], self_lookup: bool = True, top: int = LADDER[-1],
           ladder: tuple[int, ...] | None = None, cheap_guesses: bool = False,
           costs: tuple[float, ...] = (), branches: int = 1) -> Draft:
        """`top`: the longest proposal wanted (a replica's max_draft_tokens); above the ladder's
        top rung it replaces that rung, for hardware whose verify forward pays for longer ones.
        `ladder`: the rungs to use instead (a replica's measured `choose_ladder`).
        `cheap_guesses`: a proposal of the lowest rung was timed no dearer than a decode step
        (`LadderChoice.cheap_guesses`), so thin matches propose however often they fail.
        `costs`: relative costs of forwards of 1.. tokens on the device (`Engine.costs`: the
        measured timing, or what served steps cost): then lengths after the first proposal
        are chosen by cost (`length`).
        `branches`: most branches a tree verifies (`alternatives`; 1 = none)."""
        index = NgramIndex(NGRAM_MAX)
        index.extend(list(tokens))
        if ladder is None:
            ladder = default_ladder(top)
        assert len(ladder) == len(LADDER) and list(ladder) == sorted(ladder) and ladder[0] >= 1
        lengths: tuple[int, ...] = ()
        if costs:
            assert len(costs) >= 2, "costs of forwards of 1 and more tokens"
            lengths = frontier({q: c for q, c in enumerate(costs, 1)}, min(top, len(costs) - 1))
        assert branches >= 1
        return cls(list(tokens), index, self_lookup, tuple(ladder), cheap_guesses=cheap_guesses,
                   costs=tuple(costs), lengths=lengths, branches=branches)

    # ---- proposing -----------------------------------------------------------------------

    def propose(self, context: list[int], limit: int) -> list[int]:
        """The tokens to verify after `context` (prompt + generated), at most `limit` (maybe
        none); they stay pending until `update` or `withdraw`."""
        self.pending = NO_PROPOSAL
        if limit <= 0:
            return []
        if self.fresh:
            self.rung = len(LADDER) - 1
            g = min(self.ladder[self.rung], limit)
            self.start = 0
            self.pending = Proposal(self.tokens[:g], Source.DRAFT)
            return self.pending.tokens
        best = self.match_draft(context)
        if best is None and self.replaced is not None and self.replaced + 1 < len(self.tokens):
            best = (0, self.replaced + 1)  # a one-word substitution: the draft goes on after it
        if best is not None and best[0] <= 1 and not self.cheap_guesses \
                and self.rate < WEAK_RATE_MIN:
            best = None  # a draft that keeps failing only gets to propose on solid matches
        source = Source.DRAFT
        if self.self_lookup:
            found = self.match_context(context)
            # On a tie the draft wins: the cached answer is what this mode is for.
            if found is not None and (best is None or found[0] > best[0]):
                best, source = found, Source.LOOKUP
        if best is None:
            return []
        m, j = best
        self.matched = m
        self.rung = max(RUNG_BY_MATCH[min(max(m, 1), 3)], self.floor)
        g = min(self.length(source) if self.lengths else self.ladder[self.rung], limit)
        src = self.tokens if source is Source.DRAFT else context
        self.start = j
        self.pending = Proposal(src[j:j + g], source)
        return self.pending.tokens

    def alternatives(self, context: list[int], limit: int, room: int | None = None
                     ) -> list[Branch]:
        """Up to `branches` - 1 more branches to verify beside the pending proposal, in one
        tree (`Tree`): the continuations (at most `limit` tokens) after the other draft
        positions that the end of `context` matches as `match_draft` finds them, best ranked
        first, then, right after the model replaced draft token r, the guesses that the draft
        goes on at r (an inserted word) and at r + 1 (a substituted one); each of the cheapest
        length on the cost frontier (the lowest rung without costs), none already in the
        tree. Replayed on the near pairs of `python -m benchmarks.assisted` (both hosts'
        recorded answers) with flat costs, the guesses made decoding 2.0-2.5% faster; with
        the CPU hosts' served costs they rarely pay and changed it by under 0.3% (an ad-hoc
        replay, see the commit). Nothing for a draft's first proposal, without a
        pending one, or for one matched on more than ALT_MATCH_MAX context tokens (aligned,
        not a guess among several spots); thin matches only where `propose` would take
        them. With costs, only as many as pay for their forward: the proposal's expected
        tokens plus what alternatives have added per alternative lately (`credit`), over the
        tree's forward cost, against the proposal's alone. `room`: the forward is as long
        anyway (a batch's row padded to its longest), so as many as add at most `room` tree
        nodes to the proposal's, whatever they cost."""
        prop = self.pending
        if self.branches <= 1 or not prop.tokens or self.fresh or limit <= 0 \
                or self.matched > ALT_MATCH_MAX:
            return []
        g = min(self.lengths[0] if self.lengths else self.ladder[0], limit)
        taken = self.start if prop.source is Source.DRAFT else -1
        thin_ok = self.cheap_guesses or self.rate >= WEAK_RATE_MIN
        ranked = sorted((c for c in self._draft_matches(context) if c[2] != taken),
                        reverse=True)
        # Ranked by m: once thin matches are not wanted, the rest are thin too, and so are
        # the guesses after a replaced token.
        starts = [j for m, _, j in itertools.takewhile(lambda c: c[0] > 1 or thin_ok, ranked)]
        if thin_ok and self.replaced is not None:
            starts += [self.replaced, self.replaced + 1]
        have = [prop.tokens]
        out: list[Branch] = []
        for j in starts:
            toks = self.tokens[j:j + g]
            if not toks or any(h[:len(toks)] == toks for h in have):
                continue  # nothing the tree does not already verify
            have.append(toks)
            out.append(Branch(toks, Source.DRAFT, j))
            if len(out) == self.branches - 1:
                break
        if not out or (room is None and not self.costs):
            return out
        # Nodes of the proposal and the first k alternatives (each branch adds nodes after
        # the last): sizes[k].
        ends = Tree.of([self.branch(), *out]).ends
        sizes = [max(ends[:k + 1]) + 1 for k in range(len(out) + 1)]
        if room is not None:  # nodes past the proposal's: a prefix of `out` fits
            return [b for k, b in enumerate(out, 1) if sizes[k] - len(prop.tokens) <= room]
        # As many as pay for their forward: the proposal is expected to emit
        # 1 + expected_run(p, len) tokens, each alternative what they have added lately.
        s, f = self.runs.get(prop.source, PRIOR)
        base = 1.0 + expected_run(s / (s + f), len(prop.tokens))
        added, offered = self.alt_yield
        each = added / offered
        best_k, best = 0, base / forward_cost(self.costs, 1 + len(prop.tokens))
        for k in range(1, len(out) + 1):
            value = (base + k * each) / forward_cost(self.costs, 1 + sizes[k])
            if value > best:
                best_k, best = k, value
        return out[:best_k]

    def credit(self, offered: int, added: int) -> None:
        """A tree forward verified `offered` alternatives beside the proposal, and they
        accepted `added` tokens more than the proposal alone would have."""
        a, o = self.alt_yield
        self.alt_yield = (DECAY * a + added, DECAY * o + offered)

    def follow(self, tree: Tree, path: list[int]) -> int:
        """`tree` (the pending proposal and its alternatives) was verified and `path`
        accepted: credit the alternatives with what they won, and take the branch holding
        the path (returned, as its index) as the proposal `record` and `advance` learn from."""
        self.credit(len(tree.branches) - 1, len(path) - tree.along_first(path))
        b = tree.branch_of(path)
        self.take(tree.branches[b])
        return b

    def branch(self) -> Branch:
        """The pending proposal as a tree's branch."""
        return Branch(self.pending.tokens, self.pending.source, self.start)

    def take(self, branch: Branch) -> None:
        """The tree's `branch` is the one the verifier followed: it becomes the pending
        proposal that `record` and `advance` learn from."""
        self.pending = Proposal(branch.tokens, branch.source)
        self.start = branch.start

    def match_draft(self, context: list[int]) -> tuple[int, int] | None:
        """(m, j): the draft index j whose preceding m tokens equal the end of `context`, m
        as long as any (at most MATCH_MAX); among equals the nearest to `hint`. None if the
        context's last token is nowhere in the draft (short of its end)."""
        best = max(self._draft_matches(context), default=None)
        return None if best is None else (best[0], best[2])

    def _draft_matches(self, context: list[int]) -> list[tuple[int, int, int]]:
        """Every draft position the end of `context` matches, as (m, -distance to `hint`, j):
        the larger, the better ranked (`match_draft`, `alternatives`)."""
        ends = self._ends(self.index, context, len(self.tokens))
        if not ends:
            return []
        n, js = ends
        return [(self._extend(self.tokens, j, context, n), -abs(j - self.hint), j) for j in js]

    def match_context(self, context: list[int]) -> tuple[int, int] | None:
        """(m, j) as `match_draft`, over the sequence's own earlier context (prompt lookup): m
        at least LOOKUP_MIN (3 while lookups keep failing, unless guesses are cheap), the
        latest among equals."""
        self.context.sync(context)
        least = LOOKUP_MIN if self.cheap_guesses or self.lookup_rate >= LOOKUP_RATE_MIN \
            else LOOKUP_MIN + 1
        ends = self._ends(self.context, context, len(context), least)
        if not ends:
            return None
        n, js = ends
        m, j = max((self._extend(context, j, context, n), j) for j in js[-LOOKUP_CANDIDATES:])
        return m, j

    @staticmethod
    def _ends(index: NgramIndex, context: list[int], end: int,
              least: int = 1) -> tuple[int, list[int]] | None:
        """The longest n-gram (NGRAM_MAX..least) ending `context` that occurs in `index`
        followed by at least one token (before `end`), and the indices right after its
        occurrences."""
        n_ctx = len(context)
        for n in range(min(NGRAM_MAX, n_ctx), least - 1, -1):
            js = [e for e in index.after(tuple(context[n_ctx - n:])) if e < end]
            if js:
                return n, js
        return None

    @staticmethod
    def _extend(src: list[int], j: int, context: list[int], n: int) -> int:
        """How many tokens before src[j] equal the end of `context` (n of them are known to)."""
        m, n_ctx = n, len(context)
        while m < MATCH_MAX and j - 1 - m >= 0 and m < n_ctx and \
                src[j - 1 - m] == context[n_ctx - 1 - m]:
            m += 1
        return m

    def length(self, source: Source) -> int:
        """How many tokens `source` proposes, chosen by cost: the frontier length g with the
        most tokens per cost expected of its forward, (1 + expected_run(p, g)) / costs[g],
        where p is the source's estimated chance that a token verifies after the one before
        it did (from its own recent proposals; PRIOR, DECAY).

        Proposals verify in runs: a source aligned with the answer verifies long ones, and
        one that keeps failing soon after its start makes every token past a few wasted
        cost. So a source that follows the answer proposes long, one that does not proposes
        the cheapest length, and where forwards cost alike at any length (a GPU), always the
        longest. On the 2-core EPYC host, the near pairs of `python -m benchmarks.assisted`
        replayed with the replica's timed costs decode 2.31x faster than plainly this way,
        against 2.19x with the rungs by match length (`choose_ladder`) and 2.30x with the
        best fixed rungs in hindsight (5, 5, 5)."""
        s, f = self.runs.get(source, PRIOR)
        p = s / (s + f)
        return max(self.lengths, key=lambda g: ((1.0 + expected_run(p, g)) / self.costs[g], -g))

    @property
    def pending_rate(self) -> float:
        """The recent acceptance rate of the pending proposal's source."""
        return self.lookup_rate if self.pending.source is Source.LOOKUP else self.rate

    def withdraw(self) -> None:
        """Forget the pending proposal (it was not verified)."""
        self.pending = NO_PROPOSAL

    def trim(self, n: int) -> list[int]:
        """Keep only the first `n` tokens of the pending proposal; returns what is left."""
        if n <= 0:
            self.withdraw()
        elif n < len(self.pending.tokens):
            self.pending = Proposal(self.pending.tokens[:n], self.pending.source)
        return self.pending.tokens

    # ---- learning from the verifier -------------------------------------------------------

    def update(self, accepted: int, emitted: list[int]) -> None:
        """After a forward: `accepted` tokens of the pending proposal verified, `emitted` (those
        plus the model's own token) appended."""
        self.record(accepted)
        self.advance(emitted)

    def record(self, accepted: int, used: int | None = None, proposed: int | None = None
               ) -> None:
        """`accepted` tokens of the pending proposal (maybe none) verified: adapt gamma.
        `used` of them were emitted (fewer when a stop among them ended the answer); the
        accepted counts report those. `proposed`: the tokens verified, where a tree verified
        more than the pending proposal's."""
        used = accepted if used is None else used
        prop = self.pending
        self.fresh = False
        if prop.tokens:
            r = RATE_ALPHA * accepted / len(prop.tokens)
            if prop.source is Source.LOOKUP:
                self.lookup_rate = (1 - RATE_ALPHA) * self.lookup_rate + r
                self.accepted_lookup += used
            else:
                self.rate = (1 - RATE_ALPHA) * self.rate + r
            full = accepted == len(prop.tokens)
            self.floor = min(self.rung + 1, len(LADDER) - 1) if full else 0
            if self.lengths:
                ok, failed = self.runs.get(prop.source, PRIOR)
                self.runs[prop.source] = (DECAY * ok + accepted, DECAY * failed + (not full))
        self.proposed += len(prop.tokens) if proposed is None else proposed
        self.accepted += used

    def advance(self, emitted: list[int]) -> None:
        """Move past `emitted` (the newest generated tokens): where the draft was followed."""
        prop, self.pending = self.pending, NO_PROPOSAL
        p = self.start if prop.source is Source.DRAFT else self.hint
        k = 0
        while k < len(emitted) and p + k < len(self.tokens) and self.tokens[p + k] == emitted[k]:
            k += 1
        if k:
            self.hint = p + k
        self.replaced = (p + k if prop.source is Source.DRAFT and k == len(emitted) - 1
                         else None)
