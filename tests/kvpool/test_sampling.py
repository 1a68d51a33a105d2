"""The sampler's rules (pure logic): top-p's kept set, unseeded randomness, and which rows of
a verify forward must be finite."""

from __future__ import annotations

import math

import pytest
import torch

from services.kvpool.drafting import Branch, Source, Tree
from services.kvpool.sampling import NonFiniteLogits, Sampler, SamplingSpec, verify_batch


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_it() -> None:
    """Four equal tokens (0.25 each, exact in binary): top_p 0.5 keeps exactly two (their mass
    reaches 0.5; a third is not needed), top_p 0.51 three, top_p 0.25 the top one alone."""
    for top_p, kept in ((0.5, 2), (0.51, 3), (0.25, 1), (1.0, 4)):
        s = Sampler(SamplingSpec(max_tokens=1, temperature=1.0, top_p=top_p, seed=1))
        p = s.probs(torch.zeros(4))
        want = [1.0 / kept] * kept + [0.0] * (4 - kept)
        assert sorted(p.tolist(), reverse=True) == pytest.approx(want), top_p


def test_unseeded_requests_draw_their_own_randomness() -> None:
    """seed 0 means 'no seed': each request draws a random one, so two unseeded requests do
    not sample the same answer (20 tokens from a uniform 1000: equal by chance with
    probability 1000^-20)."""
    answers = []
    for _ in range(2):
        s = Sampler(SamplingSpec(max_tokens=20, temperature=1.0, seed=0))
        answers.append([s.sample(torch.zeros(1000)) for _ in range(20)])
    assert answers[0] != answers[1]
    # ...while a seeded request is reproducible.
    seeded = []
    for _ in range(2):
        s = Sampler(SamplingSpec(max_tokens=20, temperature=1.0, seed=5))
        seeded.append([s.sample(torch.zeros(1000)) for _ in range(20)])
    assert seeded[0] == seeded[1]


def _rows(*argmax_or_nan: int | None, vocab: int = 16) -> torch.Tensor:
    """Logits rows: row i peaks at argmax_or_nan[i], or is NaN at token 0 where None."""
    x = torch.zeros(len(argmax_or_nan), vocab)
    for i, t in enumerate(argmax_or_nan):
        if t is None:
            x[i, 0] = float("nan")
        else:
            x[i, t] = 5.0
    return x


def test_greedy_verify_fails_only_on_rows_the_answer_uses() -> None:
    """Draft [3, 4]: the model takes 3, then says 9 (4 rejected); the row after 4 is never used,
    so a NaN there must not fail the sequence (verify and verify_batch alike)."""
    s = Sampler(SamplingSpec(max_tokens=8))
    logits = _rows(3, 9, None)
    assert s.verify(logits, [3, 4]) == (1, 9)
    assert verify_batch([s], logits, [[3, 4]]) == [(1, 9)]
    # ...but a NaN in a row it uses does.
    bad = _rows(3, None, 7)
    assert isinstance(verify_batch([s], bad, [[3, 4]])[0], NonFiniteLogits)


def test_greedy_verify_tree_checks_the_root_row_too() -> None:
    """A NaN in the root row (the prediction after the context) fails the sequence even when
    argmax lands on a draft token and the walk goes on: the first emitted token came from it."""
    tree = Tree.of([Branch([5, 6], Source.DRAFT, 0)])
    logits = _rows(5, 6, 2)
    s = Sampler(SamplingSpec(max_tokens=8))
    assert s.verify_tree(logits, tree) == ([0, 1], 2)
    logits[0, 5] = float("nan")  # argmax still picks 5 (NaN counts as the max)
    assert int(torch.argmax(logits[0])) == 5
    with pytest.raises(NonFiniteLogits):
        s.verify_tree(logits, tree)


def test_scaling_float32_cannot_hold_is_done_in_float64() -> None:
    """softmax((x - max) / T) was computed in float32: a temperature below float32's range (a
    SamplingSpec built in-process; the wire's are float32) rounded to 0 and raised
    NonFiniteLogits on finite logits, and logits spanning more than float32's max made
    x - max -inf, no probability where a huge temperature gives some (test_sampling_
    differential found both)."""
    s = Sampler(SamplingSpec(max_tokens=1, temperature=1e-46, seed=1))
    assert s.probs(torch.tensor([1.0, 2.0, 2.0, 0.0])).tolist() == [0.0, 0.5, 0.5, 0.0]
    assert s.sample(torch.tensor([1.0, 2.0, 0.0])) == 1
    s = Sampler(SamplingSpec(max_tokens=1, temperature=3e38, seed=1))
    low = 1.0 / (1.0 + math.exp(4e38 / 3e38))  # softmax([0, -4e38 / 3e38])[1]
    assert s.probs(torch.tensor([2e38, -2e38])).tolist() == pytest.approx([1 - low, low])


def test_a_top_p_below_float32s_range_keeps_the_top_token() -> None:
    """The cut compares float32 masses with top_p, and a top_p below float32's range (in-process
    only: the wire's are float32) compares as 0, which the top token's preceding mass (0)
    reaches: every token was dropped, NaN probabilities, and `sample` failed in multinomial."""
    s = Sampler(SamplingSpec(max_tokens=1, temperature=1.0, top_p=1e-46, seed=1))
    assert s.probs(torch.tensor([1.0, 3.0, 2.0, 0.0])).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert s.sample(torch.tensor([1.0, 3.0, 2.0, 0.0])) == 1
