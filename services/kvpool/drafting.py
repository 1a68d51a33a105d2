"""What a sequence verifies next in cache-assisted generation (pure logic: no torch, no grpc).

A `Draft` holds a cached near-miss answer (token ids) for one sequence and proposes the tokens
that the sequence's next forward verifies. Two sources, tried in order:

 1. The draft, while aligned: `pos` is the draft index expected next. After a mismatch it is
    re-aligned by looking up the last 4, 3, 2 or 1 generated tokens in the draft; the nearest match
    after the point reached so far wins (a single token only counts just after it), and a
    single substituted token resumes the draft right after the token it replaced.
 2. The sequence's own context (prompt + generated tokens), when the draft has nothing aligned:
    the last 4, 3 or 2 tokens are looked up among earlier positions and what followed their most
    recent occurrence is proposed (prompt-lookup decoding): answers repeat names and phrases of
    the question and of themselves.

Gamma (tokens proposed) climbs a ladder of three rungs, one rung per fully accepted proposal,
and drops after a miss. The rungs follow what a verify forward costs, which differs by device:
on one 2-core CPU host a forward of 2 or 3 tokens cost 1.08x / 1.16x a 1-token decode step,
4..15 tokens 1.6-2.5x and 16-17 tokens 1.9x (so proposals of 1, 2 or 16 tokens: `LADDER`); a
2-core Intel Xeon host gave the same shape; on a 2-core AMD EPYC host 2-3 tokens cost 1.4-1.7x
and 5-6 tokens 1.0-1.3x, where `LADDER` proposed exactly the dearest lengths. So a replica
times its forwards at start and picks the rungs from them (`choose_ladder`,
TIERCACHE_KVPOOL_DRAFT_LADDER=auto); `LADDER` is the default of engines built without that.
On a GPU a verify forward should cost about one decode step, and the ladder is then the
longest proposal throughout (not measured: no GPU here). The first proposal rides on the
prompt's prefill forward, where extra tokens are almost free, so it is a full rung. Each
source keeps its recent acceptance rate: while the draft's is low, alignments resting on one
matching token (or a guessed substitution) propose nothing, and while lookup's is low, only
3-token context matches propose, so an unrelated draft costs next to nothing. Proposals never
change what is generated (the verifier decides); they only decide how many forwards it takes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import NamedTuple

NGRAM_MAX = 4  # longest suffix of the generated tokens looked up in the draft or the context
NGRAM1_WINDOW = 4  # a single-token match only counts this close after the last aligned spot
LOOKUP_MIN = 2  # shortest context suffix that prompt lookup trusts
LADDER = (1, 2, 16)  # proposal lengths (see the module docstring for why these)
RUNG_AFTER_MATCH = {1: 1, 2: 1, 3: 2}  # rung after re-aligning on an n-gram (3 = 3 or more)
RUNG_AFTER_SUBSTITUTION = 0  # rung after resuming past a substituted token
RUNG_AFTER_MISS = (0, 1)  # rung after a proposal with none / some tokens accepted
LOOKUP_RUNG = {2: 0, 3: 1}  # first lookup rung by the matched context suffix (3 = 3 or more)
RATE_ALPHA = 0.3  # weight of the newest proposal in a source's acceptance rate
WEAK_RATE_MIN = 0.2  # below this draft acceptance rate, weak alignments propose nothing
LOOKUP_RATE_MIN = 0.3  # below this lookup acceptance rate, 2-token context matches are ignored


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
    assert top >= 1 and all(q in costs for q in range(2, top + 2)), "costs for q = 2..top+1"
    frontier = [top]
    best = costs[top + 1]
    for g in range(top - 1, 0, -1):
        if costs[g + 1] < best * CHEAPER_BY:
            frontier.append(g)
            best = costs[g + 1]
    low = frontier[-1]
    high = max(frontier, key=lambda g: ((g + 1) / costs[g + 1], g))
    mid = min((g for g in frontier if g <= high), key=lambda g: (abs(g - 2 * low), g))
    return low, mid, high


class LadderChoice(NamedTuple):
    """The drafts' proposal lengths, where they came from, and what they were chosen from."""

    ladder: tuple[int, ...]
    source: str  # "configured", "measured", or "fixed: <why the measurement was not used>"
    # Timed forward of q = 1.. tokens / a 1-token one: what `ladder` was chosen from when
    # measured, or the timings refused as disturbed.
    costs: tuple[float, ...] = ()


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
    self_lookup: bool = True  # propose from the sequence's own context when not aligned
    ladder: tuple[int, ...] = LADDER  # proposal lengths (the top one may be raised, see `of`)
    pos: int | None = 0  # draft index expected next; None = not aligned
    hint: int = 0  # the draft index reached so far (re-alignment prefers matches after it)
    rung: int = len(LADDER) - 1  # LADDER index of the next draft proposal
    lookup_rung: int = 0  # LADDER index of the next lookup proposal (while it keeps verifying)
    context: NgramIndex = field(default_factory=lambda: NgramIndex(NGRAM_MAX))
    pending: Proposal = NO_PROPOSAL  # proposed, not yet verified
    weak: bool = False  # `pos` rests on one matching token or a guessed substitution
    rate: float = 1.0  # recent acceptance rate of draft proposals
    lookup_rate: float = 1.0  # recent acceptance rate of lookup proposals
    proposed: int = 0
    accepted: int = 0
    accepted_lookup: int = 0  # of `accepted`, tokens proposed by context lookup

    @classmethod
    def of(cls, tokens: list[int], self_lookup: bool = True, top: int = LADDER[-1],
           ladder: tuple[int, ...] | None = None) -> Draft:
        """`top`: the longest proposal wanted (a replica's max_draft_tokens); above the ladder's
        top rung it replaces that rung, for hardware whose verify forward pays for longer ones.
        `ladder`: the rungs to use instead (a replica's measured `choose_ladder`)."""
        index = NgramIndex(NGRAM_MAX)
        index.extend(list(tokens))
        if ladder is None:
            ladder = default_ladder(top)
        assert len(ladder) == len(LADDER) and list(ladder) == sorted(ladder) and ladder[0] >= 1
        return cls(list(tokens), index, self_lookup, tuple(ladder))

    # ---- proposing -----------------------------------------------------------------------

    def propose(self, context: list[int], limit: int) -> list[int]:
        """The tokens to verify after `context` (prompt + generated), at most `limit` (maybe
        none); they stay pending until `update` or `withdraw`."""
        self.pending = NO_PROPOSAL
        if limit <= 0:
            return []
        aligned = self.pos is not None and self.pos < len(self.tokens)
        if aligned and self.weak and self.rate < WEAK_RATE_MIN:
            aligned = False  # a draft that keeps failing only gets to propose on solid matches
        if aligned:
            assert self.pos is not None
            g = min(self.ladder[self.rung], limit, len(self.tokens) - self.pos)
            self.pending = Proposal(self.tokens[self.pos:self.pos + g], Source.DRAFT)
        elif self.self_lookup:
            self.pending = self._lookup(context, limit)
        return self.pending.tokens

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

    def _lookup(self, context: list[int], limit: int) -> Proposal:
        self.context.sync(context)
        n_ctx = len(context)
        for n in range(min(NGRAM_MAX, n_ctx - 1), LOOKUP_MIN - 1, -1):
            ends = self.context.after(tuple(context[n_ctx - n:]))
            # The last entry is the suffix itself; the one before is its latest earlier match.
            if n == 2 and self.lookup_rate < LOOKUP_RATE_MIN:
                break
            if len(ends) >= 2 and ends[-1] == n_ctx:
                e = ends[-2]
                g = min(self.ladder[max(self.lookup_rung, LOOKUP_RUNG[min(n, 3)])], limit)
                return Proposal(context[e:e + g], Source.LOOKUP)
        return NO_PROPOSAL

    # ---- learning from the verifier -------------------------------------------------------

    def update(self, accepted: int, emitted: list[int], generated: list[int]) -> None:
        """After a forward: `accepted` tokens of the pending proposal verified, `emitted` (those
        plus the model's own token) appended; `generated` is every token generated so far."""
        self.record(accepted)
        self.advance(emitted, generated)

    def record(self, accepted: int, used: int | None = None) -> None:
        """`accepted` tokens of the pending proposal (maybe none) verified: adapt gamma.
        `used` of them were emitted (fewer when a stop among them ended the answer); the
        accepted counts report those."""
        used = accepted if used is None else used
        prop, self.pending = self.pending, NO_PROPOSAL
        full = accepted == len(prop.tokens)
        if prop.tokens:
            r = RATE_ALPHA * accepted / len(prop.tokens)
            if prop.source is Source.LOOKUP:
                self.lookup_rate = (1 - RATE_ALPHA) * self.lookup_rate + r
            else:
                self.rate = (1 - RATE_ALPHA) * self.rate + r
                self.weak = self.weak and accepted == 0
        if prop.source is Source.LOOKUP:
            self.accepted_lookup += used
            self.lookup_rung = min(self.lookup_rung + 1, len(LADDER) - 1) if full else 0
        elif prop.source is Source.DRAFT:
            self.rung = min(self.rung + 1, len(LADDER) - 1) if full \
                else RUNG_AFTER_MISS[accepted > 0]
        else:
            self.lookup_rung = 0
        self.proposed += len(prop.tokens)
        self.accepted += used

    def advance(self, emitted: list[int], generated: list[int]) -> None:
        """Move past `emitted` (the newest generated tokens); re-align after a mismatch."""
        p = self.pos
        k = 0
        if p is not None:
            while (k < len(emitted) and p + k < len(self.tokens)
                   and self.tokens[p + k] == emitted[k]):
                k += 1
            self.hint = max(self.hint, p + k)
            if k == len(emitted):
                self.pos = p + k
                if (self.weak and k and p + k >= 2 and len(generated) >= 2
                        and generated[-2] == self.tokens[p + k - 2]):
                    # Two generated tokens in a row agree with the draft here: as solid as a
                    # 2-token re-alignment. Left weak, a draft whose rate fell during a replaced
                    # phrase of 5+ tokens never proposed again, though every later token matched.
                    self.weak = False
                return
        self.pos = self.realign(generated)
        if self.pos is None and p is not None and k == len(emitted) - 1 \
                and p + k + 1 < len(self.tokens):
            # The model replaced draft token p+k by one of its own: try the draft's
            # continuation right after it (a one-word substitution), with a short proposal.
            self.pos = p + k + 1
            self.rung = RUNG_AFTER_SUBSTITUTION
            self.weak = True

    def realign(self, generated: list[int]) -> int | None:
        """The draft index after the longest (4..1) suffix of `generated` found in the draft:
        the nearest match at or after `hint`, else (n >= 2) the last one before it."""
        for n in range(min(NGRAM_MAX, len(generated)), 0, -1):
            # A match at the very end of the draft proposes nothing.
            ends = [e for e in self.index.after(tuple(generated[-n:])) if e < len(self.tokens)]
            if not ends:
                continue
            after = [e for e in ends if e >= self.hint]
            if n == 1:
                # One token is weak evidence: only just after where the draft was left.
                after = [e for e in after if e <= self.hint + NGRAM1_WINDOW]
                if not after:
                    continue
            self.rung = RUNG_AFTER_MATCH[min(n, 3)]
            self.weak = n == 1
            return after[0] if after else ends[-1]
        return None
