"""Prompt lookup for requests without a draft (TIERCACHE_KVPOOL_PROMPT_LOOKUP)."""

from __future__ import annotations

from services.kvpool.engine import EngineRequest
from services.kvpool.sampling import SamplingSpec
from tests.assisted.test_assisted_engine import N_NEW, prompt, run
from tests.kvpool.conftest import assert_idle, collect, reference_greedy
from tests.kvpool.test_kvpool_engine import paused


def _repetitive(tiny_model) -> tuple[list[int], list[int]]:
    """A prompt whose greedy answer repeats itself (the tiny random model falls into loops),
    so that lookup has something to find."""
    for seed in range(40):
        p = prompt(8, 200 + seed)
        ref = reference_greedy(tiny_model, p, N_NEW)
        if len(ref) == N_NEW and len(set(ref)) <= N_NEW // 3:
            return p, ref
    raise AssertionError("no repetitive answer among 40 prompts")


def test_a_request_without_a_draft_verifies_its_own_repetitions(make_engine,
                                                                tiny_model) -> None:
    p, ref = _repetitive(tiny_model)
    off = make_engine()
    toks, fin = run(off, p, [], ignore_eos=False)
    assert toks == ref and fin.draft_tokens_proposed == 0 and fin.forward_passes == N_NEW - 1
    on = make_engine(prompt_lookup=True)
    toks, fin = run(on, p, [], ignore_eos=False)
    assert toks == ref
    assert fin.lookup_tokens_accepted == fin.draft_tokens_accepted > 0
    assert fin.forward_passes == N_NEW - 1 - fin.draft_tokens_accepted
    # Off with drafts off, whatever the setting.
    toks, fin = run(make_engine(drafts=False, prompt_lookup=True), p, [], ignore_eos=False)
    assert toks == ref and fin.draft_tokens_proposed == 0


def test_lookup_rows_batched_with_plain_ones_keep_every_answer(make_engine,
                                                               tiny_model) -> None:
    eng = make_engine(num_blocks=128, max_batch_size=4, prompt_lookup=True)
    rep, _ = _repetitive(tiny_model)
    prompts = [rep] + [prompt(6 + i, 60 + i) for i in range(2)]
    refs = [reference_greedy(tiny_model, q, N_NEW) for q in prompts]
    with paused(eng):
        outs = [eng.submit(EngineRequest(f"l{i}", q, SamplingSpec(N_NEW)))[1]
                for i, q in enumerate(prompts)]
    res = [collect(o) for o in outs]
    assert [t for t, _ in res] == refs
    assert res[0][1].draft_tokens_accepted > 0
    assert_idle(eng)
