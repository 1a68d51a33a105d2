"""Linear layers on oneDNN with weights packed once, for float32 models on CPU.

torch's CPU `linear` goes to MKL's sgemm, which is poor at the shapes a replica runs: a
decode step multiplies one row per sequence, a draft verify forward 2-17. On the 2-core AMD
EPYC host (AVX-512) SmolLM2's head (49,152 x 576) took 13.9 ms for one row, 29.2 ms for two,
44.9 ms for three and 31.7 ms for 17; oneDNN with the weight reordered once into its blocked
layout took 5.8, 7.1, 5.9 and 7.5 ms. The whole model's forward (`calibrate.forward_costs`,
96 tokens cached) went 84.6 -> 56.3 ms for one token and 143.2 -> 77.6 ms for 17, so a verify
forward of 16 draft tokens costs 1.38x a decode step instead of 1.69x (all from
`python -m benchmarks.linear`).

`pack_linears` swaps every `nn.Linear` of a float32 CPU model for a `PackedLinear` holding the
packed copy (the dense weight is released unless something else holds it: a head tied to the
embeddings keeps both). The results are float32 products summed in another order, not the
same bits as MKL's; every forward of the replica runs on the same kernels, so what caching and
drafts must keep exact (greedy tokens equal to computing from scratch on this replica) is
unchanged. Anything else (CUDA, half precision, a torch without these ops, a probe that does
not agree with `linear`) keeps torch's kernels; `TIERCACHE_KVPOOL_LINEAR_KERNELS=torch` too.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from services.kvpool.config import LINEAR_KERNELS

PROBE_TOLERANCE = 1e-4  # the probe's allowed difference from torch's linear (float32 sums)


class PackedLinear(torch.nn.Module):
    """`nn.Linear` computed by oneDNN from a weight packed once (float32, CPU)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernels=onednn")


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
    for m in linears:
        if m.weight.device.type != "cpu":
            return f"the model is on {m.weight.device.type}, not the CPU"
        if m.weight.dtype != torch.float32:
            return f"the model's weights are {m.weight.dtype}, not float32"
    try:
        g = torch.Generator().manual_seed(0)
        lin = torch.nn.Linear(64, 96)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(96, 64, generator=g))
            lin.bias.copy_(torch.randn(96, generator=g))
            packed = PackedLinear(lin)
            for rows in (1, 3, 17):
                x = torch.randn(2, rows, 64, generator=g)
                want, got = lin(x), packed(x)
                if got.shape != want.shape or not torch.allclose(
                        got, want, rtol=PROBE_TOLERANCE, atol=PROBE_TOLERANCE):
                    return f"the oneDNN probe disagreed with torch's linear at {rows} rows"
    except Exception as e:  # noqa: BLE001 - any failure of the probe: keep torch's kernels
        return f"the oneDNN probe failed ({type(e).__name__}: {e})"
    return ""


def pack_linears(model: Any, kernels: str = "onednn") -> Packing:
    """Swap the model's `nn.Linear` modules for `PackedLinear` when `kernels` is "onednn" and
    the model can (see `unsupported`); the model is left as it was otherwise. A model packed
    before reports its packed layers again."""
    assert kernels in LINEAR_KERNELS, kernels
    if kernels == "torch":
        return Packing("torch", 0, "configured")
    done = packed_layers(model)
    if done and not any(type(m) is torch.nn.Linear for m in model.modules()):
        return Packing("onednn", done)  # packed before (a model shared by replicas)
    why = unsupported(model)
    if why:
        return Packing("torch", 0, why)
    n = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                setattr(parent, name, PackedLinear(child))
                n += 1
    return Packing("onednn", n)
