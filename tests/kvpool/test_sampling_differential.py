"""A differential review of sampling.py: the sampler's distributions and verdicts against a
brute-force model written from its docstrings (and kvpool/README.md "Acceptance").

The model, in float64 on the logits' exact values:
- p = softmax((x - max) / T) of a row, cut to top-p: the kept set must reach top_p, be the
  smallest such set (dropping its least likely token would not reach it) and hold the most
  likely tokens; the kept probabilities are p renormalised. Which of tokens tied at the cut is
  kept is not documented: only those invariants are asserted, and a boundary within float32
  rounding (1e-5) may go either way. A row holding NaN or +-inf raises NonFiniteLogits (the
  docstrings and test_kvpool_engine say -inf is as bad as NaN) when, and only when, the answer
  uses it.
- verify, sampled, with a draft d_1..d_k: the speculative-sampling rule for a point mass:
  accept d_j with probability p_j(d_j); on rejection emit t from the residual, p_j without d_j
  renormalised; after the whole draft, t from p_k. The probability of each outcome (accepted
  count, token, or NonFiniteLogits on reaching a bad row) is computed in closed form.
- verify_tree, sampled: at a node whose children hold tokens C, move to child c with
  probability p(c), else emit t from p without C, renormalised (drafting.Tree, verify_tree).
- greedy (T = 0): the longest draft prefix equal to each row's argmax (the first maximal
  index), then that row's argmax; the tree walk the same way.
- seeds: the answer's token n is drawn from p with a generator seeded with draw_seed(seed, n)
  (torch.multinomial): a run mixing sample, sample_batch, verify, verify_batch and verify_tree
  with drafts that agree for a while, trees, and restarts with seed_offset = tokens so far
  must emit exactly the tokens of one plain run, token by token.

The code's outcome distribution is read exactly, not sampled: `draw` is replaced by one that
answers from a list of chosen tokens and every sequence of choices is enumerated, each weighted
by the weights the code passed (each of those checked against the model row it should come
from). `draw` itself is checked against torch.multinomial with the documented seed and by a
chi-square test of its frequencies. verify_batch and sample_batch must equal per-row calls
(each row's result, NonFiniteLogits for its own bad rows only, and its sampler's position).

Random cases use vocabularies of 2-8 with many ties, huge and tiny logits, temperatures from
1e-45 to 3.4e38, top_p from the smallest float32 to 1 and exactly at a row's cumulative masses,
drafts of up to 5 tokens holding likely tokens, tokens outside the top-p set, of probability
zero or outside the vocabulary, and bad values in rows used or not.

Run in the review: 20,000 seeds of each of probs, verify, verify_tree and the batch test, 8,000
answer streams. Found: a temperature below float32's range (in-process only: the wire carries
float32) raised NonFiniteLogits on finite logits, logits spanning more than float32's max got
no probability where a huge temperature gives some, and a top_p below float32's range dropped
every token (NaN probabilities); all fixed, with tests in test_sampling.py. Out of contract and
left as is: a draft longer than the logits rows minus one raises IndexError once the walk
reaches a missing row (callers always pass len(draft) + 1 rows).

Injected bugs, failing seeds of this bounded run (1,000 per test, 333 streams): the top-p cut
dropping the token that reaches top_p 131 / 158 / 160 (probs / verify / tree); the last row
after a full draft read one row early 169 verify, 166 streams; a rejection redrawn from p
(not the residual) 512 verify, 59 streams; the draw position moved once per verify call 110
streams; greedy taking the last maximal index 34 / 61 / 144 batch / 60 streams; greedy not
checking the row that emits the token 21 / 22; tree rows off by one 471 tree, 177 streams;
temperature multiplying 371 / 466 / 484; the greedy tree not checking its root row 7 tree; a
batch failing every row for one bad row 287 batch.
KVPOOL_SAMPLING_SEEDS=N runs N seeds per test (N / 3 streams; default 1000).
"""

from __future__ import annotations

import math
import os
import random
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch

from services.kvpool.drafting import Branch, Source, Tree
from services.kvpool.sampling import (
    NonFiniteLogits,
    Sampler,
    SamplingSpec,
    draw_seed,
    sample_batch,
    verify_batch,
)

SEEDS = int(os.environ.get("KVPOOL_SAMPLING_SEEDS", "1000"))
EPS = 1e-5  # float32 rounding of the masses the top-p cut compares
TOL = 2e-5  # float32 probabilities against float64 ones

TEMPS = (1e-45, 1e-30, 1e-3, 0.05, 0.3, 1.0, 1.7, 1e3, 1e30, 3.4e38)
TOP_PS = (1.0, 1.0, 1.0, 0.999999, 0.9, 0.5, 0.25, 1e-6, 1.4e-45)
RAW_TEMPS = (1e-46, 1e-300, 0.3, 1e300)
RAW_TOP_PS = (1e-46, 1e-300, 0.3, 1.0)
NONFINITE = "nonfinite"


def f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float64).float())


# ---- the model ----------------------------------------------------------------------------


class Bad(Exception):
    """The model's NonFiniteLogits."""


def model_softmax(row: list[float], t: float) -> list[float]:
    if not all(math.isfinite(v) for v in row):
        raise Bad
    m = max(row)
    z = [math.exp((v - m) / t) for v in row]
    s = sum(z)
    return [v / s for v in z]


def check_row(code_p: list[float], row: list[float], spec: SamplingSpec) -> list[float]:
    """The code's distribution for `row` against the model's; returns the model's (float64)
    over the code's kept set, once that set is shown to be one the docs allow."""
    p = model_softmax(row, spec.temperature)
    kept = [i for i, v in enumerate(code_p) if v > 0]
    assert kept, code_p
    assert all(p[i] > 0 for i in kept), (code_p, p)
    mass = sum(p[i] for i in kept)
    if spec.top_p >= 1.0:
        assert all(i in kept for i, v in enumerate(p) if v > 1e-30), (code_p, p)
    else:
        tp = spec.top_p
        least = min(p[i] for i in kept)
        assert mass >= tp - EPS, ("top-p set short of top_p", code_p, p, tp)
        assert mass - least < tp + EPS, ("top-p set not the smallest", code_p, p, tp)
        dropped = [v for i, v in enumerate(p) if i not in kept]
        assert not dropped or least >= max(dropped) - EPS, ("not the likeliest", code_p, p)
    q = [p[i] / mass if i in kept else 0.0 for i in range(len(p))]
    assert abs(sum(code_p) - 1.0) <= TOL and all(
        abs(a - b) <= TOL for a, b in zip(code_p, q, strict=True)), (code_p, q)
    return q


def first_argmax(row: list[float]) -> int:
    return row.index(max(row))


def finite(row: list[float]) -> bool:
    return all(math.isfinite(v) for v in row)


def model_verify(rows: list[list[float]], draft: list[int], spec: SamplingSpec,
                 q: Callable[[int], list[float]]) -> dict:
    """Outcome -> probability: (accepted, token) or NONFINITE. `q(i)`: row i's distribution."""
    if spec.greedy:
        for j in range(len(draft) + 1):
            if not finite(rows[j]):
                return {NONFINITE: 1.0}
            t = first_argmax(rows[j])
            if j == len(draft) or t != draft[j]:
                return {(j, t): 1.0}
    out: dict = defaultdict(float)
    reach = 1.0
    for j, x in enumerate(draft):
        if not finite(rows[j]):
            out[NONFINITE] += reach
            return out
        p = q(j)
        acc = p[x] if 0 <= x < len(p) else 0.0
        rej = 1.0 - acc
        if rej > 1e-12:  # rejected: the residual, p without x renormalised
            for t, v in enumerate(p):
                if t != x:
                    out[(j, t)] += reach * rej * (v / rej)
        reach *= acc
        if reach == 0.0:
            return out
    if not finite(rows[len(draft)]):
        out[NONFINITE] += reach
        return out
    for t, v in enumerate(q(len(draft))):
        out[(len(draft), t)] += reach * v
    return out


def children(tree: Tree, node: int) -> dict[int, int]:
    """token -> child node, from the tree's parents and tokens (the first node wins)."""
    kids: dict[int, int] = {}
    for i, (par, tok) in enumerate(zip(tree.parents, tree.tokens, strict=True)):
        if par == node:
            kids.setdefault(tok, i)
    return kids


def model_tree(rows: list[list[float]], tree: Tree, spec: SamplingSpec,
               q: Callable[[int], list[float]]) -> dict:
    """Outcome -> probability: (path, token) or NONFINITE. Row 0: the root, i + 1: node i."""
    out: dict = defaultdict(float)

    def visit(node: int, path: tuple[int, ...], reach: float) -> None:
        row = rows[node + 1]
        if not finite(row):
            out[NONFINITE] += reach
            return
        kids = children(tree, node)
        if spec.greedy:
            t = first_argmax(row)
            if t in kids:
                visit(kids[t], (*path, kids[t]), reach)
            else:
                out[(path, t)] += reach
            return
        p = q(node + 1)
        for tok, kid in kids.items():
            if 0 <= tok < len(p) and p[tok] > 0:
                visit(kid, (*path, kid), reach * p[tok])
        rest = 1.0 - sum(p[t] for t in kids if 0 <= t < len(p))
        if rest > 1e-12:
            for t, v in enumerate(p):
                if t not in kids:
                    out[(path, t)] += reach * rest * (v / rest)

    visit(-1, (), 1.0)
    return out


# ---- the code's distribution, enumerated --------------------------------------------------


class _More(Exception):
    def __init__(self, weights: list[float]) -> None:
        super().__init__()
        self.weights = weights


def code_distribution(spec: SamplingSpec, call: Callable[[Sampler], object],
                      row_of: Callable[[tuple[int, ...]], int], rows: list[list[float]],
                      emitted: Callable[[object], int]) -> tuple[dict, dict[int, list[float]]]:
    """Every sequence of draws `call` can make, weighted by what the code passed to `draw`:
    outcome -> probability, and the model distribution of each row drawn from (checked)."""
    dist: dict = defaultdict(float)
    qs: dict[int, list[float]] = {}
    todo: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while todo:
        choices, prob = todo.pop()
        s = Sampler(spec)
        made: list[int] = []

        def draw(w: torch.Tensor, choices=choices, made=made) -> int:
            if len(made) == len(choices):
                raise _More(w.double().tolist())
            made.append(choices[len(made)])
            return made[-1]

        s.draw = draw  # type: ignore[method-assign]
        try:
            out = call(s)
        except _More as more:
            w = more.weights
            r = row_of(choices)
            q = check_row(w, rows[r], spec)
            if r in qs:
                assert qs[r] == q
            qs[r] = q
            tot = sum(w)
            todo.extend((choices + (y,), prob * v / tot) for y, v in enumerate(w) if v > 0)
            continue
        except NonFiniteLogits:
            dist[NONFINITE] += prob
            continue
        assert len(made) == len(choices) == emitted(out), ("one draw per emitted token", out)
        dist[out] += prob
    return dist, qs


def same_distribution(code: dict, model: dict, where: object) -> None:
    for k in set(code) | set(model):
        assert abs(code.get(k, 0.0) - model.get(k, 0.0)) <= 10 * TOL, (where, k, code, model)


# ---- random cases -------------------------------------------------------------------------


def random_row(rng: random.Random, vocab: int) -> list[float]:
    kind = rng.randrange(6)
    if kind == 0:  # many ties
        return [float(rng.choice((-2, 0, 0, 1, 3, 3))) for _ in range(vocab)]
    if kind == 1:  # one peak
        row = [0.0] * vocab
        row[rng.randrange(vocab)] = rng.choice((4.0, 30.0, 1e4))
        return row
    if kind == 2:  # huge and tiny magnitudes
        return [rng.choice((-3e38, -1e30, -1e-30, 0.0, 1e-30, 1e30, 3e38)) for _ in range(vocab)]
    if kind == 3:  # nearly equal
        return [1.0 + rng.choice((0.0, 1e-7, 2e-7, -1e-7)) for _ in range(vocab)]
    return [rng.gauss(0, rng.choice((0.5, 3.0, 20.0))) for _ in range(vocab)]


def random_spec(rng: random.Random, row: list[float] | None = None) -> SamplingSpec:
    if rng.random() < 0.1:  # values float32 cannot hold (the wire's are float32)
        return SamplingSpec(8, temperature=rng.choice(RAW_TEMPS), top_p=rng.choice(RAW_TOP_PS),
                            seed=rng.randrange(1, 2**64))
    t = 0.0 if rng.random() < 0.2 else rng.choice(TEMPS)
    top_p = rng.choice(TOP_PS)
    if row is not None and t > 0 and rng.random() < 0.3:  # exactly at a cumulative mass
        p = sorted(model_softmax(row, f32(t)), reverse=True)
        top_p = min(1.0, f32(sum(p[:rng.randrange(1, len(p) + 1)])))
        if top_p <= 0:
            top_p = 1.0
    elif rng.random() < 0.1:
        top_p = f32(rng.uniform(1e-3, 1.0))
    return SamplingSpec(8, temperature=f32(t), top_p=f32(top_p), seed=rng.randrange(1, 2**64),
                        seed_offset=rng.choice((0, 0, 3, 2**40)))


def to_tensor(rows: list[list[float]], rng: random.Random) -> torch.Tensor:
    x = torch.tensor(rows, dtype=torch.float32)
    return x.to(torch.bfloat16) if rng.random() < 0.15 else x


def spoil(rng: random.Random, x: torch.Tensor, chance: float) -> None:
    """Put NaN / +-inf into random rows of `x`, each with probability `chance`."""
    for r in range(x.shape[0]):
        if rng.random() < chance:
            x[r, rng.randrange(x.shape[1])] = rng.choice((math.nan, math.inf, -math.inf))


def draft_token(rng: random.Random, row: list[float], vocab: int) -> int:
    kind = rng.randrange(5)
    if kind <= 1:  # the likeliest (often accepted)
        return first_argmax(row) if math.isfinite(max(row)) else 0
    if kind == 2:  # the least likely (often outside the top-p set, or of probability 0)
        return row.index(min(row)) if all(map(math.isfinite, row)) else 0
    if kind == 3 and rng.random() < 0.2:
        return vocab + rng.randrange(3)  # outside the vocabulary
    return rng.randrange(vocab)


def rows_of(x: torch.Tensor) -> list[list[float]]:
    return x.double().tolist()


# ---- the tests ----------------------------------------------------------------------------


def run_probs_seed(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.randrange(2, 9)
    row = random_row(rng, vocab)
    spec = random_spec(rng, row)
    x = to_tensor([row], rng)
    if rng.random() < 0.15:
        spoil(rng, x, 1.0)
    s = Sampler(spec)
    row = rows_of(x)[0]
    if not finite(row):
        with pytest.raises(NonFiniteLogits):
            s.probs(x[0])
        with pytest.raises(NonFiniteLogits):
            s.sample(x[0])
        return
    if spec.greedy:
        assert s.sample(x[0]) == first_argmax(row), (seed, row)
        return
    q = check_row(s.probs(x[0]).double().tolist(), row, spec)
    tok = s.sample(x[0])
    assert q[tok] > 0, (seed, row, tok)


def run_verify_seed(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.randrange(2, 9)
    k = rng.choice((0, 1, 1, 2, 3, 5))
    rows = [random_row(rng, vocab) for _ in range(k + 1)]
    spec = random_spec(rng, rows[0])
    x = to_tensor(rows, rng)
    spoil(rng, x, rng.choice((0.0, 0.0, 0.1, 0.3)))
    rows = rows_of(x)
    draft = [draft_token(rng, rows[i], vocab) for i in range(k)]
    where = (seed, spec, draft, rows)
    if spec.greedy:
        got: object
        try:
            got = Sampler(spec).verify(x, draft)
        except NonFiniteLogits:
            got = NONFINITE
        want = model_verify(rows, draft, spec, lambda i: [])
        assert {got: 1.0} == want, where
        return
    code, qs = code_distribution(spec, lambda s: s.verify(x, draft), len, rows,
                                 lambda out: out[0] + 1)
    same_distribution(code, model_verify(rows, draft, spec, qs.__getitem__), where)


def random_tree(rng: random.Random, vocab: int, likely: list[float]) -> Tree:
    branches = []
    for _ in range(rng.randrange(1, 4)):
        n = rng.randrange(1, 4)
        toks = [first_argmax(likely) if rng.random() < 0.4 and finite(likely)
                else rng.randrange(vocab + (rng.random() < 0.1)) for _ in range(n)]
        branches.append(Branch(toks, Source.DRAFT, 0))
    return Tree.of(branches)


def run_tree_seed(seed: int) -> None:
    rng = random.Random(seed)
    vocab = rng.randrange(2, 7)
    first = random_row(rng, vocab)
    tree = random_tree(rng, vocab, first)
    rows = [first] + [random_row(rng, vocab) for _ in range(tree.size)]
    spec = random_spec(rng, first)
    x = to_tensor(rows, rng)
    spoil(rng, x, rng.choice((0.0, 0.0, 0.1, 0.3)))
    rows = rows_of(x)
    where = (seed, spec, tree.tokens, tree.parents, rows)
    if spec.greedy:
        try:
            path, tok = Sampler(spec).verify_tree(x, tree)
            got: object = (tuple(path), tok)
        except NonFiniteLogits:
            got = NONFINITE
        assert {got: 1.0} == model_tree(rows, tree, spec, lambda i: []), where
        return

    def call(s: Sampler) -> object:
        path, tok = s.verify_tree(x, tree)
        return tuple(path), tok

    def row_of(choices: tuple[int, ...]) -> int:
        node = -1
        for y in choices:
            node = children(tree, node)[y]
        return node + 1

    code, qs = code_distribution(spec, call, row_of, rows, lambda out: len(out[0]) + 1)
    same_distribution(code, model_tree(rows, tree, spec, qs.__getitem__), where)


def run_batch_seed(seed: int) -> None:
    """verify_batch / sample_batch against each row's own call, real draws."""
    rng = random.Random(seed)
    vocab = rng.randrange(2, 9)
    n = rng.randrange(1, 6)
    plain = rng.random() < 0.3  # sample_batch: no drafts
    drafts = [[] if plain else [rng.randrange(vocab + 1) for _ in range(rng.choice((0, 1, 3)))]
              for _ in range(n)]
    rows = [random_row(rng, vocab) for d in drafts for _ in range(len(d) + 1)]
    specs = [random_spec(rng) for _ in range(n)]
    x = to_tensor(rows, rng)
    spoil(rng, x, rng.choice((0.0, 0.1, 0.3)))
    at = 0
    for d in drafts:  # drafts that agree with the greedy rows for a while
        for j in range(rng.randrange(len(d) + 1)):
            d[j] = int(torch.argmax(x[at + j]))
        at += len(d) + 1
    samplers = [Sampler(s) for s in specs]
    got = (sample_batch(samplers, x) if plain else verify_batch(samplers, x, drafts))
    at = 0
    for b, (spec, d) in enumerate(zip(specs, drafts, strict=True)):
        alone = Sampler(spec)
        rows_b = x[at:at + len(d) + 1]
        try:
            want: object = alone.sample(rows_b[0]) if plain else alone.verify(rows_b, d)
        except NonFiniteLogits:
            want = NONFINITE
        g = NONFINITE if isinstance(got[b], NonFiniteLogits) else got[b]
        assert g == want, (seed, b, spec, d)
        if want != NONFINITE:
            assert samplers[b]._index == alone._index, (seed, b)
        at += len(d) + 1


class World:
    """A deterministic model: the logits after a context (tiny vocabulary, ties)."""

    def __init__(self, key: int, vocab: int) -> None:
        self.key, self.vocab = key, vocab

    def row(self, ctx: tuple[int, ...]) -> list[float]:
        return random_row(random.Random(f"{self.key}:{ctx}"), self.vocab)

    def logits(self, ctxs: list[tuple[int, ...]]) -> torch.Tensor:
        return torch.tensor([self.row(c) for c in ctxs], dtype=torch.float32)


def run_stream_seed(seed: int) -> None:
    """One answer emitted by any mix of calls, drafts and restarts elsewhere (seed_offset) is
    the plain run's: token n is drawn with draw_seed(seed, n) whatever came before it."""
    rng = random.Random(seed)
    vocab = rng.randrange(2, 7)
    world = World(seed, vocab)
    prompt = tuple(rng.randrange(vocab) for _ in range(3))
    spec = random_spec(rng)
    spec = SamplingSpec(64, spec.temperature, spec.top_p, spec.seed)
    n_ref = 24
    ref: list[int] = []
    plain = Sampler(spec)
    for n in range(n_ref):
        x = world.logits([prompt + tuple(ref)])[0]
        tok = plain.sample(x)
        if not spec.greedy:  # the documented rule, from a fresh sampler's distribution
            g = torch.Generator().manual_seed(draw_seed(spec.seed, n))
            assert tok == int(torch.multinomial(Sampler(spec).probs(x), 1, generator=g)), seed
        else:
            assert tok == first_argmax(world.row(prompt + tuple(ref))), seed
        ref.append(tok)

    def proposal(at: int) -> list[int]:
        good = ref[at:at + rng.randrange(0, 6)]
        if good and rng.random() < 0.5:
            good[rng.randrange(len(good))] = rng.randrange(vocab)
        return good

    start = rng.randrange(0, 6)
    out = list(ref[:start])
    s = Sampler(SamplingSpec(64, spec.temperature, spec.top_p, spec.seed, seed_offset=start))
    others = [Sampler(random_spec(rng)) for _ in range(2)]
    noise = torch.Generator().manual_seed(seed)
    while len(out) < n_ref - 6:
        ctx = prompt + tuple(out)
        op = rng.randrange(6)
        if op == 0:
            emitted = [s.sample(world.logits([ctx])[0])]
        elif op == 1:
            rest = [rng.choice(others) for _ in range(rng.randrange(3))]
            where = rng.randrange(len(rest) + 1)
            batch = [*rest[:where], s, *rest[where:]]
            logits = world.logits([ctx] * len(batch))
            logits[torch.arange(len(batch)) != where] += torch.randn(len(batch) - 1, vocab,
                                                                     generator=noise)
            tok = sample_batch(batch, logits)[where]
            assert isinstance(tok, int)
            emitted = [tok]
        elif op in (2, 3):
            d = proposal(len(out))
            logits = world.logits([ctx + tuple(d[:i]) for i in range(len(d) + 1)])
            if op == 2:
                a, tok = s.verify(logits, d)
            else:
                other = rng.choice(others)
                od = [rng.randrange(vocab) for _ in range(rng.randrange(3))]
                both = torch.cat([world.logits([(9,) * (i + 1) for i in range(len(od) + 1)]),
                                  logits])
                got = verify_batch([other, s], both, [od, d])[1]
                assert not isinstance(got, NonFiniteLogits)
                a, tok = got
            emitted = [*d[:a], tok]
        elif op == 4:
            tree = Tree.of([Branch(proposal(len(out)) or [rng.randrange(vocab)], Source.DRAFT, 0)
                            for _ in range(rng.randrange(1, 4))])

            def path_to(i: int, tree: Tree = tree) -> tuple[int, ...]:
                toks: list[int] = []
                while i >= 0:
                    toks.append(tree.tokens[i])
                    i = tree.parents[i]
                return tuple(reversed(toks))

            logits = world.logits([ctx] + [ctx + path_to(i) for i in range(tree.size)])
            path, tok = s.verify_tree(logits, tree)
            emitted = [tree.tokens[i] for i in path] + [tok]
        else:  # the answer goes on elsewhere
            s = Sampler(SamplingSpec(64, spec.temperature, spec.top_p, spec.seed,
                                     seed_offset=len(out)))
            continue
        out.extend(emitted)
        assert out == ref[:len(out)], (seed, spec, out, ref)


def test_draw_is_the_seeded_multinomial_and_samples_its_weights() -> None:
    """draw(w) for the answer's token n: torch.multinomial(w) with a generator seeded
    draw_seed(seed, n); over many n its frequencies follow w (unnormalised; zeros never)."""
    w = torch.tensor([4.0, 2.0, 1.0, 0.0, 0.5, 0.5, 0.0]) * 0.37
    s = Sampler(SamplingSpec(8, temperature=1.0, seed=2**64 - 1, seed_offset=5))
    counts = [0] * len(w)
    n = 4000
    for i in range(n):
        g = torch.Generator().manual_seed(draw_seed(2**64 - 1, 5 + i))
        want = int(torch.multinomial(w, 1, generator=g))
        tok = s.draw(w)
        assert tok == want and s._index == 6 + i
        counts[tok] += 1
    p = (w / w.sum()).tolist()
    assert counts[3] == counts[6] == 0
    chi2 = sum((c - n * q) ** 2 / (n * q) for c, q in zip(counts, p, strict=True) if q > 0)
    assert chi2 < 25.7, counts  # 4 degrees of freedom: p < 3e-5 under the null
    assert len({draw_seed(a, b) for a in range(40) for b in range(40)}) == 1600
    assert all(0 <= draw_seed(a, b) < 2**63 for a in (0, 1, 2**64 - 1) for b in (0, 2**64 - 1))


CHUNK = 250


def chunks(total: int) -> list[int]:
    return list(range(0, max(total, 1), CHUNK))


def chunk_seeds(first: int, total: int = SEEDS) -> range:
    """The seeds of the chunk starting at `first` (of `chunks(total)`)."""
    return range(first, min(first + CHUNK, total))


@pytest.mark.parametrize("first", chunks(SEEDS))
def test_probs_and_sample_match_the_model(first: int) -> None:
    for seed in chunk_seeds(first):
        run_probs_seed(seed)


@pytest.mark.parametrize("first", chunks(SEEDS))
def test_verify_outcome_distribution_is_the_speculative_rule(first: int) -> None:
    for seed in chunk_seeds(first):
        run_verify_seed(seed)


@pytest.mark.parametrize("first", chunks(SEEDS))
def test_verify_tree_outcome_distribution_is_the_per_node_rule(first: int) -> None:
    for seed in chunk_seeds(first):
        run_tree_seed(seed)


@pytest.mark.parametrize("first", chunks(SEEDS))
def test_batches_equal_their_rows(first: int) -> None:
    for seed in chunk_seeds(first):
        run_batch_seed(seed)


@pytest.mark.parametrize("first", chunks(SEEDS // 3))
def test_a_seeded_answer_is_one_stream_whatever_verified_it(first: int) -> None:
    for seed in chunk_seeds(first, SEEDS // 3):
        run_stream_seed(seed)
