"""Rules of `services/kvpool/calibrate.py` a mutation audit found unchecked: which forwards a
timing runs (over what cache, in what order, how many sweeps) and what it reports."""

from __future__ import annotations

import time
import types

import torch

from services.kvpool import calibrate
from services.kvpool.calibrate import Sweep, forward_costs, undisturbed


def _record_forwards(model, on_forward=None):
    """A hook noting (new tokens, cached tokens) of each forward; `on_forward(new)` after."""
    seen: list[tuple[int, int]] = []

    def hook(module, args, kw) -> None:
        ids = args[0] if args else kw["input_ids"]
        seen.append((ids.shape[1], kw["cache"].get_seq_length()))
        if on_forward is not None and len(seen) > 1:  # not the prefill of the context
            on_forward(ids.shape[1])

    return seen, model.register_forward_pre_hook(hook, with_kwargs=True)


def test_each_sweep_times_every_length_over_the_context_from_its_own_start(tiny_model):
    """One warm-up sweep, then sweeps until `sweeps` count (one alone always counts); every
    forward of q new tokens runs over exactly `context` cached tokens, and each sweep starts
    at the next length, so a slow spell does not land on the same lengths every time."""
    seen, hook = _record_forwards(tiny_model)
    try:
        costs = forward_costs(tiny_model, 3, context=8, sweeps=1)
    finally:
        hook.remove()
    assert sorted(costs) == [1, 2, 3]
    assert seen == [(8, 0), (1, 8), (2, 8), (3, 8), (2, 8), (3, 8), (1, 8)]


def test_the_cost_of_a_length_is_the_median_of_the_undisturbed_sweeps(tiny_model,
                                                                     monkeypatch):
    """Sweeps timed (on a scripted clock) at 1.0, 1.5 and 1.125 s after the warm-up: all three
    count, and the length costs their median, not the mean, the least or the most."""
    now = [0.0]
    script = iter([1.0, 1.0, 1.5, 1.125])

    def advance(new_tokens: int) -> None:
        now[0] += next(script, 1.0)

    fake = types.SimpleNamespace(monotonic=time.monotonic, perf_counter=lambda: now[0],
                                 process_time=lambda: now[0])
    monkeypatch.setattr(calibrate, "time", fake)
    seen, hook = _record_forwards(tiny_model, advance)
    try:
        costs = forward_costs(tiny_model, 1, context=4, sweeps=3)
    finally:
        hook.remove()
    assert len(seen) == 1 + 4
    assert costs == {1: 1.125}  # sums of binary fractions: exact


def test_the_thread_count_found_at_the_start_is_restored(tiny_model):
    """`threads_for` sets each forward's count; the caller's count comes back afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        forward_costs(tiny_model, 2, context=4, sweeps=1, threads_for=lambda q: 1)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_with_three_sweeps_the_reference_is_the_second_fastest():
    """'The second best of three or more sweeps': one lucky fast sweep of three does not make
    the two ordinary ones look slow."""
    ordinary = [Sweep({1: 0.07}, wall, 1.9 * wall) for wall in (2.28, 2.25)]
    lucky = Sweep({1: 0.05}, 1.4, 1.9 * 1.4)
    assert undisturbed(ordinary + [lucky]) == ordinary + [lucky]


def test_no_lengths_or_no_sweeps_are_refused_before_anything_runs():
    """A differential review: max_q 0 failed with ZeroDivisionError after the prefill, and
    sweeps 0 returned costs from a single sweep; each is a ValueError naming the argument,
    and the model is not touched."""
    import pytest

    class Untouchable:
        def __getattr__(self, name):
            raise AssertionError(f"the model was used ({name})")

        def __call__(self, *a, **kw):
            raise AssertionError("the model was called")

    for kw, name in (({"max_q": 0}, "max_q"), ({"max_q": 2, "sweeps": 0}, "sweeps"),
                     ({"max_q": -1}, "max_q")):
        with pytest.raises(ValueError, match=f"^forward_costs: {name} must be >= 1, got"):
            forward_costs(Untouchable(), **kw)
