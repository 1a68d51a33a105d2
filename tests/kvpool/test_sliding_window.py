"""Models whose layers attend through a sliding window: served within the window, exactly.

The paged cache gives every layer one causal mask over the whole context; transformers takes a
mask it is given as it is and builds no window into it, so past the window every answer (a
cold one too) differed from the model's own. The context is clamped to the window.
"""

from __future__ import annotations

import random

import torch

from services.kvpool.engine import model_info, sliding_window
from tests.kvpool.conftest import collect, reference_greedy, request


def _mistral(window: int | None):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=1024, sliding_window=window, eos_token_id=127,
                        attn_implementation="sdpa", initializer_range=0.25)
    m = MistralForCausalLM(cfg).eval()
    m.generation_config.eos_token_id = 127
    return m


def test_which_configs_have_a_window():
    from transformers import Gemma2Config, LlamaConfig, Qwen2Config

    assert sliding_window(_mistral(8).config) == 8
    assert sliding_window(_mistral(None).config) is None
    assert sliding_window(Gemma2Config(sliding_window=16, num_hidden_layers=2)) == 16
    assert sliding_window(Qwen2Config(sliding_window=16, use_sliding_window=False)) is None
    assert sliding_window(Qwen2Config(sliding_window=16, use_sliding_window=True,
                                      max_window_layers=1, num_hidden_layers=2)) == 16
    assert sliding_window(LlamaConfig()) is None


def test_a_sliding_window_model_is_served_within_its_window_exactly(make_engine):
    m = _mistral(8)
    info = model_info(m, "mistral-sw8")
    assert info.max_context == 8
    assert model_info(_mistral(None), "mistral").max_context == 1024
    eng = make_engine(model=m, num_blocks=64, block_size=4)
    rng = random.Random(0)
    for length in (4, 5, 7):
        p = [rng.randrange(1, 126) for _ in range(length)]
        toks, _ = collect(eng.submit(request(p, 8 - length, ignore_eos=True))[1])
        assert toks == reference_greedy(m, p, 8 - length)


def test_past_the_window_the_unclamped_engine_differs_from_the_model():
    """Why the clamp: given the whole context, the engine's answers past the window are not
    the model's (what every request of such a model got before)."""
    import dataclasses

    from services.common.hashing import BlockHasher
    from services.kvpool.block_pool import BlockPool
    from services.kvpool.engine import Engine

    m = _mistral(8)
    info = dataclasses.replace(model_info(m, "mistral-sw8"), max_context=1024)
    eng = Engine(m, info, BlockPool(64, 4, BlockHasher("mistral-sw8", 4, key=b"k")),
                 max_batch_size=2, max_prefill_chunk=64).start()
    try:
        rng = random.Random(1)
        differ = 0
        for _ in range(3):
            p = [rng.randrange(1, 126) for _ in range(30)]
            toks, _ = collect(eng.submit(request(p, 4, ignore_eos=True))[1])
            differ += toks != reference_greedy(m, p, 4)
        assert differ >= 2
    finally:
        eng.stop()
