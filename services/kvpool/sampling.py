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
        probs = torch.softmax(logits.float().cpu() / self.spec.temperature, dim=-1)
        if self.spec.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            cum = torch.cumsum(sorted_p, dim=-1)
            # Keep the smallest set whose mass reaches top_p (always at least the top token).
            drop = cum - sorted_p >= self.spec.top_p
            sorted_p[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_p)
        return int(torch.multinomial(probs, 1, generator=self._gen))


def sample_batch(samplers: list[Sampler], logits: torch.Tensor) -> list[int]:
    """One token per row of [B, vocab] logits (all greedy rows in one argmax)."""
    if all(s.spec.greedy for s in samplers):
        return torch.argmax(logits, dim=-1).tolist()
    return [s.sample(logits[i]) for i, s in enumerate(samplers)]
