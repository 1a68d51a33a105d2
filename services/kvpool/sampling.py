"""Choosing the next token: greedy, or temperature + top-p with a per-request seeded generator."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class SamplingSpec:
    """Validated sampling settings of one request (see common.proto SamplingParams)."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class Sampler:
    """Samples from one sequence's logits; reproducible for a non-zero seed."""

    def __init__(self, spec: SamplingSpec) -> None:
        self.spec = spec
        self._gen: torch.Generator | None = None
        if not spec.greedy:
            self._gen = torch.Generator(device="cpu")
            self._gen.manual_seed(spec.seed if spec.seed else secrets.randbits(63))

    def sample(self, logits: torch.Tensor) -> int:
        """Next token id from a [vocab] logits vector."""
        if self.spec.greedy:
            return int(torch.argmax(logits))
        return self.draw(self.probs(logits))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution sampling draws from: softmax(logits / T), cut to the top-p set."""
        x = logits.float().cpu()
        # Shift before scaling: at a tiny temperature logits / T overflows to inf and softmax
        # turns inf - inf into NaN; (x - max) / T is <= 0 and tends to a point mass instead.
        probs = torch.softmax((x - x.max()) / self.spec.temperature, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            raise ValueError("sampling: the model's logits are not finite")
        if self.spec.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            # Keep the smallest set whose mass reaches top_p (always at least the top token).
            drop = cum - sorted_p >= self.spec.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
            probs /= probs.sum()
        return probs

    def draw(self, probs: torch.Tensor) -> int:
        """One token from a (not necessarily normalised) [vocab] weight vector."""
        return int(torch.multinomial(probs, 1, generator=self._gen))

    def verify(self, logits: torch.Tensor, draft: list[int]) -> tuple[int, int]:
        """Accept the longest admissible prefix of `draft`; returns (accepted, next token).

        `logits` is [len(draft) + 1, vocab]: row i is the model's prediction after the context
        plus `draft[:i]`. Greedy accepts while the draft equals the argmax. With sampling, draft
        token x (a point mass) is accepted with probability p(x); on rejection the token is drawn
        from p with x removed and renormalised, so every emitted token is distributed exactly as
        the model's p. After a fully accepted draft the next token is drawn from the last row.

        The rule is carried out by drawing y from p and accepting x when y == x: that accepts
        with probability p(x), and a rejected y is distributed as p restricted to y != x, the
        residual max(p - q, 0) renormalised. It takes one draw per emitted token, exactly as
        plain decoding does, so a seeded request samples the same answer whether or not it has
        a draft and however much of a proposal the pool had room for.
        """
        if self.spec.greedy:
            model = torch.argmax(logits, dim=-1).tolist()
            a = 0
            while a < len(draft) and model[a] == draft[a]:
                a += 1
            return a, model[a]
        for i, x in enumerate(draft):
            y = self.draw(self.probs(logits[i]))
            if y != x:
                return i, y
        return len(draft), self.draw(self.probs(logits[len(draft)]))


def sample_batch(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """One token per row of [B, vocab] logits (all greedy rows in one argmax)."""
    if all(s.spec.greedy for s in samplers):
        return torch.argmax(logits, dim=-1).tolist()
    return [s.sample(logits[i]) for i, s in enumerate(samplers)]
