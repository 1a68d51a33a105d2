"""What a verify forward costs on this replica's device, measured at start.

Draft proposals are only worth their forward's cost: on the 2-core CPUs this project was
measured on, a forward of 2-3 tokens per row cost 1.1-1.2x a one-token decode step on one host
and 1.4-1.7x on another, where 5-6 tokens cost 1.2-1.3x; on a GPU all of them cost about one
step. `forward_costs` times forwards of q = 1..max_q new tokens over a `context`-token cache,
with the engine's attention and an explicit 4-D mask and positions as the engine passes them,
and `drafting.choose_ladder` picks the proposal lengths from it.
"""

from __future__ import annotations

import time
from typing import Any

import torch


class TooSlow(RuntimeError):
    """The measurement ran past its time budget (a loaded host: its figures would be noise)."""


def forward_costs(model: Any, max_q: int, *, context: int = 96, reps: int = 3,
                  rounds: int = 2, budget_s: float = 60.0) -> dict[int, float]:
    """{q: median seconds of one forward of q new tokens (batch 1)}, q = 1..max_q, the
    smallest of `rounds` interleaved rounds of `reps` each (the least disturbed).

    Raises:
        TooSlow: past `budget_s` seconds.
    """
    t_start = time.monotonic()
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + max_q), generator=g).to(dev)
    best: dict[int, float] = {}
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids[:, :context], cache=cache, use_cache=True)
        for _ in range(rounds):
            for q in range(1, max_q + 1):
                pos = torch.arange(context, context + q, device=dev)[None]
                mask = (torch.arange(context + q, device=dev)[None, None, :]
                        <= pos[:, :, None])[:, None]
                times = []
                for _ in range(reps + 1):  # the first of each q warms its shapes up
                    extra = cache.get_seq_length() - context
                    if extra > 0:
                        cache.crop(-extra)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    t0 = time.perf_counter()
                    model(ids[:, context:context + q], cache=cache, position_ids=pos,
                          attention_mask=mask, use_cache=True)
                    if dev.type == "cuda":
                        torch.cuda.synchronize(dev)
                    times.append(time.perf_counter() - t0)
                med = sorted(times[1:])[reps // 2]
                best[q] = min(best.get(q, med), med)
                if time.monotonic() - t_start > budget_s:
                    raise TooSlow(f"timing forwards took over {budget_s:.0f} s")
    return best
