"""Linear layers on oneDNN with weights packed once, for float32 and bfloat16 models on CPU.

torch's CPU `linear` goes to MKL's sgemm, which is poor at the shapes a replica runs: a
decode step multiplies one row per sequence, a draft verify forward 2-17. On the 2-core AMD
EPYC host (AVX-512) SmolLM2's head (49,152 x 576) took 13.9 ms for one row, 29.2 ms for two,
44.9 ms for three and 31.7 ms for 17; oneDNN with the weight reordered once into its blocked
layout took 5.8, 7.1, 5.9 and 7.5 ms. The whole model's forward (`calibrate.forward_costs`,
96 tokens cached) went 84.6 -> 56.3 ms for one token and 143.2 -> 77.6 ms for 17, so a verify
forward of 16 draft tokens costs 1.38x a decode step instead of 1.69x (all from
`python -m benchmarks.linear`). Not on every CPU: on the 2-core Intel Xeon host (AMX), on one
thread, a 17-token forward went 124.4 -> 99.2 ms but a 1-token one 56.2 -> 64.6 ms (MKL is the
better GEMV there; `OMP_NUM_THREADS=1 python -m benchmarks.linear --out
benchmarks/results/linear_xeon_1thread.json`); the default stays oneDNN for the drafts' sake
(services/kvpool/README.md).

`pack_linears` swaps every `nn.Linear` of a float32 CPU model for a `PackedLinear` holding the
packed copy (the dense weight is released unless something else holds it: a head tied to the
embeddings keeps both). The results are float32 products summed in another order, not the
same bits as MKL's; every forward of the replica runs on the same kernels, so what caching and
drafts must keep exact (greedy tokens equal to computing from scratch on this replica) is
unchanged.

A bfloat16 model is packed too where oneDNN runs bfloat16 natively on this CPU (AVX-512 BF16 or
AMX): its layers in bfloat16, and its head as the float32 copy the engine computes logits with
(`engine.fp32_head`; taking bfloat16 hidden states, giving float32 logits). On the 2-core Intel
Xeon host (AMX), SmolLM2 in bfloat16 decoded 128 tokens at 71-73 ms per token on torch's
kernels and 63-67 ms packed, its start-up timing putting a forward of 17 tokens at 1.24x one
token's against 1.18x (engine in-process, one thread; the float32 model: 75-79 ms, 1.45x; an
ad-hoc timing, see the commit). Anything else (CUDA, float16, a
bfloat16 model on a CPU without native bfloat16, a torch without these ops, a probe that does
not agree with `linear`) keeps torch's kernels; `TIERCACHE_KVPOOL_LINEAR_KERNELS=torch` too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from services.kvpool.config import LINEAR_KERNELS

# The probe's allowed difference from torch's linear: float32 sums in another order, and
# bfloat16 products rounded once more or less (8 bits of mantissa: 2^-8 relative).
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


class PackedLinear(torch.nn.Module):
    """`nn.Linear` computed by oneDNN from a weight packed once (float32 or bfloat16, CPU).

    `dtype`: pack a copy of the weight (and bias) in this dtype instead; inputs of another
    dtype are cast to it (a bfloat16 model's float32 head takes its bfloat16 hidden states)."""

    def __init__(self, linear: torch.nn.Linear, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        self.dtype = dtype or linear.weight.dtype
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(
                linear.weight.detach().to(self.dtype), None)
        self.bias = None if linear.bias is None else linear.bias.detach().to(self.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, dtype={self.dtype}, kernels=onednn")


class Packing(NamedTuple):
    """What `pack_linears` did: the kernels the model's linear layers now run on, how many
    layers were packed, and why not when they were not."""

    kernels: str  # "onednn" or "torch"
    layers: int
    why_not: str = ""


def packed_layers(model: Any) -> int:
    """How many of the model's linear layers run on packed oneDNN weights."""
    return sum(isinstance(m, PackedLinear) for m in model.modules())


def unsupported(model: Any) -> str:
    """Why this model's linear layers cannot run on packed oneDNN weights ("" = they can)."""
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return "this torch build has no oneDNN linear"
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    if not linears:
        return "the model has no linear layers"
    dtypes = {m.weight.dtype for m in linears}
    for m in linears:
        if m.weight.device.type != "cpu":
            return f"the model is on {m.weight.device.type}, not the CPU"
        if m.weight.dtype not in PROBE_TOLERANCE:
            return f"the model's weights are {m.weight.dtype}, not float32 or bfloat16"
    if len(dtypes) > 1:
        return f"the model's weights mix {', '.join(sorted(map(str, dtypes)))}"
    dtype = dtypes.pop()
    if dtype == torch.bfloat16 and not _native_bfloat16():
        return "oneDNN has no native bfloat16 on this CPU (AVX-512 BF16 or AMX)"
    # A bfloat16 model's head runs packed in float32 (`pack_linears`): probe both.
    for probed in {dtype, torch.float32}:
        why = _probe(probed)
        if why:
            return why
    return ""


def _native_bfloat16() -> bool:
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def _probe(dtype: torch.dtype) -> str:
    """Why packed layers of `dtype` cannot stand in for torch's linear ("" = they can)."""
    tol = PROBE_TOLERANCE[dtype]
    try:
        g = torch.Generator().manual_seed(0)
        lin = torch.nn.Linear(64, 96)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(96, 64, generator=g))
            lin.bias.copy_(torch.randn(96, generator=g))
            lin = lin.to(dtype)
            packed = PackedLinear(lin)
            for rows in (1, 3, 17):
                x = torch.randn(2, rows, 64, generator=g).to(dtype)
                want, got = lin(x), packed(x)
                if got.shape != want.shape or got.dtype != want.dtype or not torch.allclose(
                        got.float(), want.float(), rtol=tol, atol=tol):
                    return (f"the oneDNN probe disagreed with torch's linear at {rows} rows "
                            f"({dtype})")
    except Exception as e:  # noqa: BLE001 - any failure of the probe: keep torch's kernels
        return f"the oneDNN probe failed ({dtype}; {type(e).__name__}: {e})"
    return ""


def pack_linears(model: Any, kernels: str = "onednn") -> Packing:
    """Swap the model's `nn.Linear` modules for `PackedLinear` when `kernels` is "onednn" and
    the model can (see `unsupported`); the model is left as it was otherwise. A model packed
    before reports its packed layers again. A bfloat16 model's `lm_head` is packed as a float32
    copy (the logits `engine.fp32_head` computes; its forward then gives float32 logits)."""
    assert kernels in LINEAR_KERNELS, kernels
    if kernels == "torch":
        return Packing("torch", 0, "configured")
    done = packed_layers(model)
    if done and not any(type(m) is torch.nn.Linear for m in model.modules()):
        return Packing("onednn", done)  # packed before (a model shared by replicas)
    why = unsupported(model)
    if why:
        return Packing("torch", 0, why)
    head = getattr(model, "lm_head", None)
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(
                    child, torch.float32 if child is head else None))
                n += 1
    return Packing("onednn", n)
