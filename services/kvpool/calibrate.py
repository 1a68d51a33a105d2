"""What a verify forward costs on this replica's device, measured at start.

Draft proposals are only worth their forward's cost: on the 2-core CPUs this project was
measured on, a forward of 2-3 tokens per row cost 1.1-1.2x a one-token decode step on one host
and 1.4-1.7x on another, where 5-6 tokens cost 1.2-1.3x; on a GPU all of them cost about one
step. `forward_costs` times forwards of q = 1..max_q new tokens over a `context`-token cache,
with the engine's attention and an explicit 4-D mask and positions as the engine passes them,
and `drafting.choose_ladder` picks the proposal lengths from it. It runs before the engine
thread starts, so nothing else of this process computes meanwhile. It is a starting point:
the engine then learns what its served steps cost, length by length (`drafting.ServedCosts`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from services.kvpool.engine import device_done


class TooSlow(RuntimeError):
    """The measurement ran past its time budget (a loaded host: its figures would be noise)."""


# A sweep this much slower than the reference one (the second fastest) was disturbed:
# dropped. Quiet sweeps of SmolLM2 on a 2-core host took 1.99-2.57 s; one beside a busy
# process, 5.46 s.
SLOW_SWEEP = 1.35
BUSY_CPU = 0.85  # a sweep with under this share of the reference CPU per second: dropped


@dataclass
class Sweep:
    """One forward of each q = 1..max_q, timed: seconds by q, and the sweep's wall and process
    CPU seconds."""

    times: dict[int, float] = field(default_factory=dict)
    wall: float = 0.0
    cpu: float = 0.0


def undisturbed(sweeps: list[Sweep]) -> list[Sweep]:
    """The sweeps within `SLOW_SWEEP` of the reference wall time whose process got at least
    `BUSY_CPU` of the reference CPU per second. The references are the second best of three
    or more sweeps (the best of fewer), so one freak sweep (a lucky fast one, another thread
    of the process adding CPU time) does not raise the bar for all the others."""
    walls = sorted(s.wall for s in sweeps)
    shares = sorted((s.cpu / max(s.wall, 1e-9) for s in sweeps), reverse=True)
    k = 1 if len(sweeps) >= 3 else 0
    return [s for s in sweeps if s.wall <= walls[k] * SLOW_SWEEP
            and s.cpu / max(s.wall, 1e-9) >= shares[k] * BUSY_CPU]


def forward_costs(model: Any, max_q: int, *, context: int = 96, sweeps: int = 6,
                  budget_s: float = 60.0,
                  threads_for: Callable[[int], int] | None = None) -> dict[int, float]:
    """{q: median seconds of one forward of q new tokens (batch 1)}, q = 1..max_q, over
    `sweeps` undisturbed sweeps.

    A sweep times one forward of each q in turn (after one sweep that warms the shapes up), each
    sweep starting at another q, so a slow spell of the host lands on a sweep rather than on
    the same lengths every time. Replicas start beside other services (the semantic tier
    loading its index, sibling replicas): one such start-up chose rungs (1, 1, 16) that cost
    the benchmark most of its speed-up, where six quiet timings on the same host chose a
    lowest rung of 4 to 9 (most likely a busy spell landed on the short lengths). So a sweep
    counts only if its wall time is within `SLOW_SWEEP` of the reference sweep's and this
    process got at least `BUSY_CPU` of the reference CPU per second (another process taking
    cores shows as both; see `undisturbed`), and sweeps continue until `sweeps` of them count.

    `threads_for(q)`: the torch threads a forward of q new tokens runs with when served
    (`Engine.threads_for`); the count found at the start is restored at the end.

    Raises:
        TooSlow: past `budget_s` seconds without enough undisturbed sweeps.
        ValueError: `max_q` or `sweeps` under 1 (before anything runs).
    """
    # max_q 0 failed with ZeroDivisionError after the prefill; sweeps 0 returned one sweep's.
    for name, value in (("max_q", max_q), ("sweeps", sweeps)):
        if value < 1:
            raise ValueError(f"forward_costs: {name} must be >= 1, got {value}")
    threads = torch.get_num_threads()
    try:
        return _forward_costs(model, max_q, context, sweeps, budget_s, threads_for)
    finally:
        torch.set_num_threads(threads)


def _forward_costs(model: Any, max_q: int, context: int, sweeps: int, budget_s: float,
                   threads_for: Callable[[int], int] | None) -> dict[int, float]:
    t_start = time.monotonic()
    from transformers import DynamicCache

    dev = next(model.parameters()).device
    vocab = int(model.config.vocab_size)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (1, context + max_q), generator=g).to(dev)
    shapes = []
    for q in range(1, max_q + 1):
        pos = torch.arange(context, context + q, device=dev)[None]
        mask = (torch.arange(context + q, device=dev)[None, None, :] <= pos[:, :, None])[:, None]
        shapes.append((q, pos, mask))
    done: list[Sweep] = []

    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids[:, :context], cache=cache, use_cache=True)
        n = 0  # sweeps run; the first only warms the shapes up
        while True:
            sweep = Sweep()
            start = n % len(shapes)
            n += 1
            w0, c0 = time.perf_counter(), time.process_time()
            for q, pos, mask in shapes[start:] + shapes[:start]:
                extra = cache.get_seq_length() - context
                if extra > 0:
                    cache.crop(-extra)
                if threads_for is not None:
                    torch.set_num_threads(threads_for(q))
                device_done(dev)
                t0 = time.perf_counter()
                model(ids[:, context:context + q], cache=cache, position_ids=pos,
                      attention_mask=mask, use_cache=True)
                device_done(dev)
                sweep.times[q] = time.perf_counter() - t0
            sweep.wall = time.perf_counter() - w0
            sweep.cpu = time.process_time() - c0
            if n > 1:
                done.append(sweep)
                kept = undisturbed(done)
                if len(kept) >= sweeps:
                    return {q: statistics.median(s.times[q] for s in kept)
                            for q in range(1, max_q + 1)}
            if time.monotonic() - t_start > budget_s:
                raise TooSlow(f"timing forwards took over {budget_s:.0f} s with "
                              f"{len(undisturbed(done)) if done else 0} of {sweeps} sweeps "
                              "undisturbed")
