"""Rules of `services/kvpool/linear.py` a mutation audit found unchecked: when oneDNN is
judged able to serve a model (with oracles of their own, not `unsupported` itself), and what
the probe refuses."""

from __future__ import annotations

import pytest
import torch

from services.kvpool import linear
from services.kvpool.linear import PackedLinear, Packing, pack_linears, unsupported
from tests.kvpool.conftest import make_tiny_model

HAS_OPS = (torch.backends.mkldnn.is_available()
           and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
           and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
needs_ops = pytest.mark.skipif(not HAS_OPS, reason="this torch build has no oneDNN linear")


@needs_ops
def test_a_float32_model_is_packed_wherever_torch_has_the_onednn_ops() -> None:
    """The tests of packed layers skip themselves when `unsupported` refuses float32: a probe
    that wrongly refused (or a PackedLinear that lost its bias) skipped them and passed."""
    assert linear._probe(torch.float32) == ""
    assert unsupported(make_tiny_model()) == ""


@needs_ops
def test_the_probe_refuses_packed_layers_that_compute_something_else(monkeypatch) -> None:
    """A packed layer off by more than the tolerance, in values alone (same shape and dtype),
    keeps torch's kernels; so does one whose packing raises."""
    real = PackedLinear.forward
    monkeypatch.setattr(PackedLinear, "forward", lambda self, x: real(self, x) + 0.01)
    assert "disagreed" in linear._probe(torch.float32)
    monkeypatch.setattr(PackedLinear, "forward", real)

    def cannot(self, lin, dtype=None):
        raise RuntimeError("no reorder on this CPU")

    monkeypatch.setattr(PackedLinear, "__init__", cannot)
    why = linear._probe(torch.float32)
    assert why.startswith("the oneDNN probe failed") and "no reorder on this CPU" in why
    assert pack_linears(make_tiny_model()).kernels == "torch"


@needs_ops
def test_a_bfloat16_model_needs_native_bfloat16_and_a_float32_probe_too(monkeypatch) -> None:
    """Its head runs packed in float32: a float32 probe that fails keeps torch's kernels even
    where bfloat16 passes; without native bfloat16 it is refused whatever the probes say."""
    model = make_tiny_model().to(torch.bfloat16)
    monkeypatch.setattr(linear, "_probe", lambda dtype: "" if dtype == torch.bfloat16 else "f32")
    monkeypatch.setattr(linear, "_native_bfloat16", lambda: True)
    assert unsupported(model) == "f32"
    monkeypatch.setattr(linear, "_probe", lambda dtype: "")
    assert unsupported(model) == ""
    monkeypatch.setattr(linear, "_native_bfloat16", lambda: False)
    assert "native bfloat16" in unsupported(model)


def test_torch_without_onednn_and_models_off_the_cpu_or_without_linears_keep_torch(
        monkeypatch) -> None:
    """Each refusal says why and leaves the model's layers as they were."""
    bare = torch.nn.Sequential(torch.nn.ReLU())
    assert pack_linears(bare) == Packing("torch", 0, "the model has no linear layers")
    meta = make_tiny_model().to("meta")
    assert unsupported(meta) == "the model is on meta, not the CPU"
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    model = make_tiny_model()
    assert pack_linears(model) == Packing("torch", 0, "this torch build has no oneDNN linear")
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
