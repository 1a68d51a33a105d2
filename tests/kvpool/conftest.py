"""Fixtures for kvpool tests: a tiny random Llama, engines over it, the real SmolLM2."""

from __future__ import annotations

import queue
import random
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest
import torch

from services.common.hashing import BlockHasher
from services.kvpool.block_pool import BlockPool
from services.kvpool.engine import (
    Engine,
    EngineRequest,
    Failed,
    Finished,
    TokenDelta,
    model_info,
)
from services.kvpool.sampling import SamplingSpec

TINY_VOCAB = 128
TINY_ID = "tiny-llama"


class StatsEngine:
    """An engine a publisher reads only the pool's shape and the stats of: by default nothing
    running and every block free."""

    pool = SimpleNamespace(block_size=4, num_blocks=50,
                           hasher=SimpleNamespace(key=b"k", probe=lambda: b""))

    def __init__(self, running: int = 0, waiting: int = 0, blocks_free: int = 50,
                 blocks_cached: int = 0) -> None:
        self._stats = SimpleNamespace(running=running, waiting=waiting,
                                      blocks_free=blocks_free, blocks_cached=blocks_cached,
                                      blocks_total=50)

    def stats(self):
        return self._stats


def make_tiny_model(seed: int = 0, max_pos: int = 1024):
    """A randomly initialised, Llama-shaped model small enough for unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos, eos_token_id=TINY_VOCAB - 1,
                      bos_token_id=0, pad_token_id=0, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = TINY_VOCAB - 1
    model.generation_config.pad_token_id = 0
    return model


@pytest.fixture(scope="session")
def tiny_model():
    return make_tiny_model()


EngineFactory = Callable[..., Engine]


@pytest.fixture
def make_engine(tiny_model) -> Iterator[EngineFactory]:
    """Build engines over the tiny model; each is checked for integrity and zero refs at the end.
    An engine given `threads` sets torch's thread count, which threads started later inherit:
    it is put back at the end."""
    engines: list[Engine] = []
    threads = torch.get_num_threads()

    def factory(num_blocks: int = 64, block_size: int = 4, max_batch_size: int = 4,
                max_prefill_chunk: int = 16, model=None, hash_key: bytes | None = b"k",
                **kw) -> Engine:
        m = model or tiny_model
        pool = BlockPool(num_blocks, block_size, BlockHasher(TINY_ID, block_size, key=hash_key))
        eng = Engine(m, model_info(m, TINY_ID), pool, max_batch_size=max_batch_size,
                     max_prefill_chunk=max_prefill_chunk, **kw).start()
        engines.append(eng)
        return eng

    yield factory
    for eng in engines:
        if not eng.running:  # stopped by the test: nothing may be left behind either
            eng.check_integrity()
            assert eng.pool.stats().in_use == 0
            continue
        try:
            assert_idle(eng)
        finally:
            eng.stop()
    torch.set_num_threads(threads)


def assert_idle(eng: Engine, timeout: float = 10.0) -> None:
    """Every request has ended: integrity holds and no block is referenced."""
    import time

    end = time.monotonic() + timeout
    while True:
        st = eng.call(lambda: (eng.check_integrity(), eng.pool.stats())[1]).result(timeout)
        if st.in_use == 0 and eng.stats().running == 0 and eng.stats().waiting == 0:
            return
        assert time.monotonic() < end, f"engine not idle: {st} {eng.stats()}"
        time.sleep(0.02)


def collect(out: queue.Queue, timeout: float = 30.0) -> tuple[list[int], Finished | Failed]:
    """Tokens streamed to one output queue, and how it ended."""
    toks: list[int] = []
    while True:
        item = out.get(timeout=timeout)
        if isinstance(item, TokenDelta):
            toks.extend(item.token_ids)
        else:
            return toks, item


def generate(eng: Engine, tokens: list[int], max_tokens: int = 8, salt: str = "",
             **sampling) -> tuple[list[int], Finished | Failed]:
    """Run one request to completion."""
    _, out = eng.submit(request(tokens, max_tokens, salt, **sampling))
    return collect(out)


def prompt(n: int, seed: int = 0) -> list[int]:
    """`n` token ids in [1, TINY_VOCAB - 1), drawn with `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(1, TINY_VOCAB - 1) for _ in range(n)]


def request(tokens: list[int], max_tokens: int = 8, salt: str = "", rid: str = "r",
            skip_prefix_cache: bool = False, deadline: float | None = None,
            draft: list[int] | tuple[int, ...] = (), **sampling) -> EngineRequest:
    spec = SamplingSpec(max_tokens=max_tokens, **sampling)
    return EngineRequest(rid, list(tokens), spec, salt, skip_prefix_cache, deadline,
                         draft_token_ids=tuple(draft))


def reference_greedy(model, tokens: list[int], max_tokens: int) -> list[int]:
    """Plain transformers greedy generation (its own cache), stopping on EOS like the engine."""
    ids = torch.tensor([tokens], device=model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                             do_sample=False)
    return out[0, len(tokens):].tolist()


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer, model_id) of the real SmolLM2 (converted once into the user cache),
    its linear layers packed as a replica packs them."""
    from transformers import AutoModelForCausalLM

    from services.common.model_store import load_tokenizer, resolve_model
    from services.kvpool.linear import pack_linears

    r = resolve_model("smollm2")
    model = AutoModelForCausalLM.from_pretrained(r.path, dtype=torch.float32,
                                                 attn_implementation="sdpa").eval()
    # On the kernels a replica serves it with (oneDNN where the host has it): the exactness
    # tests then check the kernels in production.
    pack_linears(model)
    return model, load_tokenizer(r.path), r.model_id
