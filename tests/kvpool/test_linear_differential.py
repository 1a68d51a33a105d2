"""A differential review of services/kvpool/linear.py (packed oneDNN linear layers) and of
services/kvpool/calibrate.py's choice of sweeps, against models of what their docs say.

`PackedLinear`: linear.py promises no bits ("float32 products summed in another order, not
the same bits as MKL's"; the probe allows a tolerance, `PROBE_TOLERANCE`), and names the
reference for exactness: every forward of a replica runs on the same kernels, so greedy
tokens are compared with the packed model's own (test_linear.py does so through the engine).
The model here is the float64 product of the very values the layer holds (its weight and
bias cast to the dtype it packs, the input cast to it), and the bound a float sum of n
products may stray from it: (n + 2) * 2^-24 * sum |w x| + |b| in float32 (the worst case of
any order, a few ulps in practice), plus two bfloat16 roundings (2^-7 of it) for a bfloat16
layer. Random shapes: in and out features 1 to 1,536 (odd ones, 1), leading dimensions none,
zero-sized, one to three, inputs strided, transposed, broadcast (stride 0), non-contiguous in
the last dimension; bias or not; float32, bfloat16 where the CPU has native bfloat16, and a
bfloat16 layer packed as float32 (the head). Each answer's shape and dtype must be
`torch.nn.functional.linear`'s on the same input, its values within the bound, and within
`PROBE_TOLERANCE` of torch's own where that is what the probe asks (values of size one).

`unsupported` / `pack_linears`: random module trees (nested, a head, a Linear subclass,
float32 / bfloat16 / float16 / float64 layers, some on the meta device, none at all) against
the rule the docstrings give, with its conditions found here without linear.py: oneDNN's ops
in this torch, native bfloat16 from the CPU's flags (/proc/cpuinfo: avx512_bf16 or
amx_bf16), not from `_native_bfloat16` (test_linear.py computed its skip with `unsupported`
itself, so a wrong refusal skipped the tests and passed). A packed tree: every exact
`nn.Linear` swapped, the head packed float32, the output within the bound, a second call
reporting the same.

`calibrate.undisturbed` and `forward_costs`: random lists of sweeps (walls, CPU, times per
length, ties and values on the 1.35 / 0.85 boundaries) against the docstring's rule
computed by brute force (the reference is the second best of three or more, the best of
fewer; a sweep counts if within `SLOW_SWEEP` of the reference wall and at least `BUSY_CPU`
of the reference CPU share), and `forward_costs` on a stand-in model with scripted clocks:
sweeps run until `sweeps` of those so far count, each length then costs the median over the
sweeps that count, TooSlow once past the budget without enough.

Run: 2,000 seeds of the linear layers (three inputs each), 1,000 trees, 20,000 sweep lists
and 5,000 scripted timings (LINEAR_DIFFERENTIAL_SEEDS sets how many here; 25 by default).
Found: no divergence. On this CPU (Intel Xeon, AMX), the largest error of a packed float32
layer was 5 ulps of sum |w x|, as torch's own (4); a bfloat16 layer's one bfloat16 rounding,
as torch's; the tiny model's greedy tokens packed and on torch's kernels agreed on 32 of 32
prompts (not a promise of the docs, which take the packed model as its own reference).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import types
from pathlib import Path

import pytest
import torch

from services.kvpool import calibrate, linear
from services.kvpool.calibrate import Sweep, TooSlow, undisturbed
from services.kvpool.linear import PROBE_TOLERANCE, PackedLinear, Packing, pack_linears

SEEDS = int(os.environ.get("LINEAR_DIFFERENTIAL_SEEDS", "25"))
FIRST = int(os.environ.get("LINEAR_DIFFERENTIAL_FIRST_SEED", "0"))

HAS_OPS = (torch.backends.mkldnn.is_available()
           and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
           and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags")
            for f in line.split(":", 1)[1].split()}


NATIVE_BF16 = bool({"avx512_bf16", "amx_bf16"} & _cpu_flags())
needs_ops = pytest.mark.skipif(not HAS_OPS, reason="this torch build has no oneDNN linear")
SIZES = [1, 2, 3, 7, 17, 64, 96, 127, 257, 576, 1536]


def _bound(x64: torch.Tensor, w64: torch.Tensor, b64: torch.Tensor, dtype) -> torch.Tensor:
    """How far a sum of the products in any order may be from the exact one, per output."""
    mag = x64.abs() @ w64.abs().T + b64.abs()
    n = w64.shape[1]
    tol = (n + 2) * 2.0 ** -24
    if dtype == torch.bfloat16:
        tol += 2.0 ** -7
    return tol * mag


def _input(rng: random.Random, g: torch.Generator, lead: tuple[int, ...], n: int,
           dtype: torch.dtype) -> torch.Tensor:
    """An input of shape lead + (n,), contiguous or a view of another layout."""
    how = rng.choice(["plain", "plain", "sliced", "transposed", "broadcast", "inner"])
    if how == "sliced" and lead:
        big = torch.randn(*lead[:-1], 2 * lead[-1] + 1, n, generator=g).to(dtype)
        return big[..., 1::2, :]
    if how == "transposed" and len(lead) >= 2:
        big = torch.randn(*lead[:-2], lead[-1], lead[-2], n, generator=g).to(dtype)
        return big.transpose(-2, -3)
    if how == "broadcast" and lead:
        return torch.randn(n, generator=g).to(dtype).expand(*lead, n)
    if how == "inner":
        return torch.randn(*lead, 2 * n, generator=g).to(dtype)[..., ::2]
    return torch.randn(*lead, n, generator=g).to(dtype)


def run_linear(seed: int) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    n_in, n_out = rng.choice(SIZES), rng.choice(SIZES)
    dtypes = [torch.float32] + ([torch.bfloat16] if NATIVE_BF16 else [])
    dtype = rng.choice(dtypes)
    head = dtype == torch.bfloat16 and rng.random() < 0.3
    lin = torch.nn.Linear(n_in, n_out, bias=rng.random() < 0.5)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n_out, n_in, generator=g) * rng.choice([1.0, 0.02, 30.0]))
        if lin.bias is not None:
            lin.bias.copy_(torch.randn(n_out, generator=g))
    lin = lin.to(dtype)
    packed = PackedLinear(lin, torch.float32 if head else None)
    runs = torch.float32 if head else dtype
    assert packed.dtype == runs and packed.in_features == n_in and packed.out_features == n_out
    w64 = lin.weight.to(runs).double()
    b64 = (lin.bias.to(runs).double() if lin.bias is not None
           else torch.zeros(n_out, dtype=torch.float64))
    for _ in range(3):
        lead = tuple(rng.choice([0, 1, 1, 2, 3, 17]) for _ in range(rng.choice([0, 1, 1, 2, 3])))
        while torch.Size(lead).numel() > 51:  # rows of a verify forward, not a prefill's
            lead = lead[1:]
        x = _input(rng, g, lead, n_in, dtype)
        with torch.inference_mode():
            got = packed(x)
            want = torch.nn.functional.linear(
                x.to(runs), lin.weight.to(runs), None if lin.bias is None else lin.bias.to(runs))
        where = (seed, n_in, n_out, lin.bias is not None, dtype, head, tuple(x.shape),
                 x.stride())
        assert got.shape == want.shape == (*lead, n_out), where
        assert got.dtype == want.dtype == runs, where
        x64 = x.to(runs).double()
        ref = x64 @ w64.T + b64
        err = (got.double() - ref).abs()
        assert bool((err <= _bound(x64, w64, b64, runs)).all()), (where, err.max().item())
        if n_in == 1 and got.numel():  # one product: the probe's tolerance holds outright
            tol = PROBE_TOLERANCE[runs]
            assert torch.allclose(got.float(), want.float(), rtol=tol, atol=tol), where


class Sub(torch.nn.Linear):
    """A Linear subclass: not an `nn.Linear` to pack (its forward may differ)."""


def _tree(rng: random.Random, g: torch.Generator) -> tuple[torch.nn.Module, list]:
    """A random module tree, and its exact nn.Linear layers as (parent, name, layer)."""
    dtype = rng.choice([torch.float32, torch.float32, torch.bfloat16, torch.float16,
                        torch.float64])
    mixed = rng.random() < 0.15
    on_meta = rng.random() < 0.1
    root = torch.nn.Module()
    layers: list = []
    width = rng.choice([3, 8])

    def add(parent: torch.nn.Module, depth: int) -> None:
        for i in range(rng.randint(0 if depth else 1, 3)):
            kind = rng.choice(["linear", "linear", "sub", "relu", "nest"] if depth < 2
                              else ["linear", "relu", "sub"])
            if kind == "nest":
                child = torch.nn.Sequential()
                add(child, depth + 1)
            elif kind == "relu":
                child = torch.nn.ReLU()
            else:
                cls = torch.nn.Linear if kind == "linear" else Sub
                child = cls(width, width, bias=rng.random() < 0.5)
                with torch.no_grad():
                    child.weight.copy_(torch.randn(width, width, generator=g))
                child = child.to(rng.choice([torch.float16, torch.float32, torch.bfloat16])
                                 if mixed else dtype)
                if kind == "linear":
                    layers.append((parent, str(i), child))
            parent.add_module(str(i), child)

    add(root, 0)
    if rng.random() < 0.5:
        head = torch.nn.Linear(width, 5, bias=False)
        with torch.no_grad():
            head.weight.copy_(torch.randn(5, width, generator=g))
        root.lm_head = head.to(dtype)
        layers.append((root, "lm_head", root.lm_head))
    if on_meta:
        root = root.to("meta")
        layers = [(p, n, getattr(p, n)) for p, n, _ in layers]
    return root, layers


def _refusal(layers: list) -> str:
    """What the docstrings say refuses packing ("" = packed), from the layers alone."""
    if not HAS_OPS:
        return "oneDNN"
    if not layers:
        return "no linear"
    if any(m.weight.device.type != "cpu" for _, _, m in layers):
        return "not the CPU"
    dtypes = {m.weight.dtype for _, _, m in layers}
    if not dtypes <= {torch.float32, torch.bfloat16}:
        return "not float32 or bfloat16"
    if len(dtypes) > 1:
        return "mix"
    if dtypes == {torch.bfloat16} and not NATIVE_BF16:
        return "native bfloat16"
    return ""


def run_tree(seed: int) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    model, layers = _tree(rng, g)
    refusal = _refusal(layers)
    why = linear.unsupported(model)
    if refusal in ("not the CPU", "not float32 or bfloat16") and why:
        # Several reasons may hold; the docs do not rank them: any of them.
        assert any(r in why for r in ("not the CPU", "not float32 or bfloat16", "mix")), why
    else:
        assert (why == "") == (refusal == ""), (seed, refusal, why)
        assert refusal in why, (seed, refusal, why)
    before = [(p, n, getattr(p, n)) for p, n, _ in layers]
    got = pack_linears(model)
    if refusal:
        assert got.kernels == "torch" and got.layers == 0 and got.why_not == why, seed
        assert all(getattr(p, n) is m for p, n, m in before), seed  # left as it was
        return
    assert got == Packing("onednn", len(layers)), (seed, got)
    for p, n, m in before:
        new = getattr(p, n)
        assert isinstance(new, PackedLinear), (seed, n)
        dtype = torch.float32 if n == "lm_head" and p is model else m.weight.dtype
        assert new.dtype == dtype, (seed, n, new.dtype)
        x = torch.randn(2, 3, m.in_features, generator=g).to(m.weight.dtype)
        with torch.inference_mode():
            out = new(x)
        w64, x64 = m.weight.to(dtype).double(), x.to(dtype).double()
        b64 = (m.bias.to(dtype).double() if m.bias is not None
               else torch.zeros(m.out_features, dtype=torch.float64))
        err = (out.double() - (x64 @ w64.T + b64)).abs()
        assert out.dtype == dtype and bool((err <= _bound(x64, w64, b64, dtype)).all()), seed
    assert not any(type(m) is torch.nn.Linear for m in model.modules()), seed
    assert all(type(m) is Sub for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert pack_linears(model) == got, seed  # packed before: reported again
    assert linear.packed_layers(model) == len(layers)


@needs_ops
@pytest.mark.parametrize("seed", range(FIRST, FIRST + SEEDS))
def test_packed_linear_against_the_float64_product(seed) -> None:
    for s in range(seed * 2, seed * 2 + 2):
        run_linear(s)


@pytest.mark.parametrize("seed", range(FIRST, FIRST + SEEDS))
def test_unsupported_and_pack_linears_against_the_rule(seed) -> None:
    for s in range(seed * 2, seed * 2 + 2):
        run_tree(s)


@needs_ops
def test_the_probe_passes_where_the_cpu_runs_the_dtype() -> None:
    """The probe of each dtype this CPU runs natively agrees with torch's linear."""
    assert linear._probe(torch.float32) == ""
    if NATIVE_BF16:
        assert linear._probe(torch.bfloat16) == ""
        assert linear._native_bfloat16()


# calibrate.py

def _reference_undisturbed(sweeps: list[Sweep]) -> list[Sweep]:
    """The docstring's rule, by brute force: the reference of a measure is the sweep that
    exactly one other beats (ties counted in list order) of three or more, the best of
    fewer."""
    def share(s: Sweep) -> float:
        return s.cpu / s.wall

    def ref(value, better) -> float:
        if len(sweeps) < 3:
            return value(next(s for s in sweeps
                              if not any(better(value(o), value(s)) for o in sweeps)))
        for i, s in enumerate(sweeps):
            ahead = sum(1 for j, o in enumerate(sweeps) if better(value(o), value(s))
                        or (value(o) == value(s) and j < i))
            if ahead == 1:
                return value(s)
        raise AssertionError("no second best")

    wall = ref(lambda s: s.wall, lambda a, b: a < b)
    cpu = ref(share, lambda a, b: a > b)
    return [s for s in sweeps
            if s.wall <= wall * calibrate.SLOW_SWEEP and share(s) >= cpu * calibrate.BUSY_CPU]


def _sweeps(rng: random.Random, max_q: int) -> list[Sweep]:
    out = []
    base = rng.choice([0.5, 2.0, 2.25])
    for _ in range(rng.randint(1, 7)):
        wall = rng.choice([base, base, base * 1.35, base * 1.375, base * 2, base * 0.75,
                           rng.uniform(0.25, 6)])
        share = rng.choice([1.0, 1.0, 0.85, 0.84375, 1.9, 0.5, rng.uniform(0.1, 2)])
        times = {q: rng.choice([0.0625, 0.125, 0.25, rng.uniform(0.01, 0.3)])
                 for q in range(1, max_q + 1)}
        out.append(Sweep(times, wall, share * wall))
    return out


def run_undisturbed(seed: int) -> None:
    rng = random.Random(seed)
    sweeps = _sweeps(rng, 2)
    got = undisturbed(sweeps)
    assert got == _reference_undisturbed(sweeps), seed
    assert all(any(g is s for s in sweeps) for g in got)  # the sweeps themselves, in order


class _Cache:
    def __init__(self) -> None:
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, n: int) -> None:
        self.length += n if n < 0 else 0


class _Model:
    """A stand-in: each forward of the timed sweeps moves the scripted clocks."""

    def __init__(self, on_forward) -> None:
        self.config = types.SimpleNamespace(vocab_size=50)
        self.on_forward = on_forward

    def parameters(self):
        return iter([torch.zeros(1)])

    def __call__(self, ids, cache, **_):
        cache.length += ids.shape[1]
        self.on_forward(ids.shape[1])


def _dyadic_sweeps(rng: random.Random, n: int, max_q: int) -> list[Sweep]:
    """Sweeps whose times a scripted clock adds up exactly (multiples of 1/64)."""
    out = []
    for _ in range(n):
        times = {q: rng.choice([1, 2, 4, 8]) / 64 for q in range(1, max_q + 1)}
        wall = sum(times.values()) + rng.choice([0, 1, 8, 16, 32, 64, 128, 300]) / 64
        share = rng.choice([64, 64, 60, 54, 32, 120]) / 64
        out.append(Sweep(times, wall, share * wall))
    return out


def run_forward_costs(seed: int, monkeypatch) -> None:
    rng = random.Random(seed)
    max_q, want_sweeps = rng.randint(1, 3), rng.randint(1, 4)
    budget, per_sweep = rng.choice([0.5, 5.0, 12.0, 30.0]), rng.choice([1.0, 2.5])
    script = _dyadic_sweeps(rng, 40, max_q)  # the warm-up sweep, then the timed ones
    perf, proc, mono = [0.0], [0.0], [0.0]
    state = {"sweep": 0, "perf_reads": 0, "cpu_reads": 0, "prefilled": False}

    def on_forward(q: int) -> None:
        if not state["prefilled"]:  # the context's prefill, before the sweeps
            state["prefilled"] = True
            return
        perf[0] += script[state["sweep"]].times[q]

    def perf_counter() -> float:
        # Each sweep reads it at its start, before and after each forward, and at its end:
        # the end holds the rest of the sweep's wall time (cropping, setting threads...).
        n = state["perf_reads"] % (2 * max_q + 2)
        state["perf_reads"] += 1
        if n == 2 * max_q + 1:
            s = script[state["sweep"]]
            perf[0] += s.wall - sum(s.times.values())
            mono[0] += per_sweep
            state["sweep"] += 1
        return perf[0]

    def process_time() -> float:
        if state["cpu_reads"] % 2:  # a sweep's end
            proc[0] += script[state["sweep"] - 1].cpu
        state["cpu_reads"] += 1
        return proc[0]

    fake = types.SimpleNamespace(monotonic=lambda: mono[0], perf_counter=perf_counter,
                                 process_time=process_time)
    monkeypatch.setattr(calibrate, "time", fake)
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(
        DynamicCache=lambda config: _Cache()))
    # The docstring's loop over the script: one warm-up sweep, then sweeps until `sweeps`
    # of those so far count, TooSlow once past the budget (checked as each sweep ends).
    want: dict | None = None
    if per_sweep <= budget:
        timed: list[Sweep] = []
        for k, s in enumerate(script[1:], start=2):
            timed.append(s)
            counting = _reference_undisturbed(timed)
            if len(counting) >= want_sweeps:
                want = {q: statistics.median(c.times[q] for c in counting)
                        for q in range(1, max_q + 1)}
                break
            if k * per_sweep > budget:
                break
    model = _Model(on_forward)
    if want is None:
        with pytest.raises(TooSlow):
            calibrate.forward_costs(model, max_q, context=4, sweeps=want_sweeps,
                                    budget_s=budget)
        return
    got = calibrate.forward_costs(model, max_q, context=4, sweeps=want_sweeps, budget_s=budget)
    assert got == want, seed  # sums of multiples of 1/64: exact


@pytest.mark.parametrize("seed", range(FIRST, FIRST + SEEDS))
def test_undisturbed_and_forward_costs_against_the_docstring(seed, monkeypatch) -> None:
    for s in range(seed * 25, seed * 25 + 25):
        run_undisturbed(s)
    for s in range(seed * 5, seed * 5 + 5):
        with monkeypatch.context() as m:
            run_forward_costs(s, m)
