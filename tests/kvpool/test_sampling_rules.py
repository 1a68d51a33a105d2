"""Sampler rules found on a live stack (see test_sampling.py for the rest)."""

from __future__ import annotations

import torch

from services.kvpool.sampling import Sampler, SamplingSpec


def test_a_tiny_top_p_keeps_the_top_token_at_a_huge_temperature() -> None:
    """At temperature 3e38 every probability rounds to one value; a tiny top_p must still keep
    the model's top token (the logits' argmax), not whichever token a sort of equal
    probabilities put first (it sampled one fixed, unlikely token every step)."""
    torch.manual_seed(0)
    logits = torch.randn(49152) * 5
    s = Sampler(SamplingSpec(max_tokens=1, temperature=3e38, top_p=1e-7, seed=1))
    p = s.probs(logits)
    assert torch.nonzero(p).flatten().tolist() == [int(torch.argmax(logits))]
    assert s.sample(logits) == int(torch.argmax(logits))
