"""The attention the kvpool engine runs: transformers' SDPA, with grouped-query attention kept
grouped on CPU for multi-token forwards.

The engine always passes an explicit 4-D mask (ragged batches, drafts). With a mask,
transformers' SDPA path copies every key and value head `num_key_value_groups` times
(`repeat_kv`) before a forward of more than one token — a prefill over a cached prefix, or a
draft's verification — because masked GQA falls back to the math kernel on CUDA. On CPU, torch's
SDPA takes the mask and the grouped heads as they are (`enable_gqa=True`): SmolLM2's 3 KV
heads serve 9 query heads without the copies of every cached position in every layer.

Only that case changes; decode steps (one query token: transformers packs the groups), CUDA
and every other device keep the stock function. The grouped call computes the same attention,
and the kvpool exactness tests compare its greedy tokens with the ungrouped path's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

NAME = "tiercache_sdpa"


def _sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
          attention_mask: torch.Tensor | None, dropout: float = 0.0,
          scaling: float | None = None, is_causal: bool | None = None,
          **kwargs: Any) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if (query.device.type == "cpu" and attention_mask is not None and query.shape[2] > 1
            and getattr(module, "num_key_value_groups", 1) > 1
            and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
            and not kwargs.get("output_attentions", False)):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                             dropout_p=dropout, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


def register() -> str:
    """Register the attention (and its mask builder, SDPA's) with transformers; returns the
    name to load a model with (`attn_implementation=`)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    AttentionInterface.register(NAME, _sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME
