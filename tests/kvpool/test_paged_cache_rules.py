"""Rules of the paged cache's working rows that a mutation audit found unguarded: they grow
to the smallest rung that holds what is asked, and never when they hold it already."""

from __future__ import annotations

import torch

from services.kvpool.paged_cache import KvStore
from tests.kvpool.test_kvpool_store import BS, D, H, L


def rows_of(capacity: int, max_context: int = 64) -> KvStore:
    """A store whose working rows start at `capacity` tokens."""
    return KvStore(num_layers=L, kv_heads=H, head_dim=D, num_blocks=4, block_size=BS,
                   max_rows=2, max_context=max_context, dtype=torch.float32, device="cpu",
                   initial_capacity=capacity)


def test_rows_grow_to_the_smallest_rung_that_holds_the_tokens() -> None:
    """A length that is a rung itself (64 / 4 = 16) gets that rung, not the next one up
    (twice the memory)."""
    s = rows_of(4)
    assert s.capacity == 4
    s.ensure_capacity(16)
    assert s.capacity == 16
    s.ensure_capacity(17)
    assert s.capacity == 32


def test_rows_that_hold_the_tokens_already_are_not_reallocated() -> None:
    """Rows at their full size (preallocated) asked for exactly what they hold keep their
    tensor: a reallocation there is the full-size copy peak preallocation exists to avoid."""
    s = rows_of(64)
    rows = s.rows
    for n in (1, 63, 64):
        s.ensure_capacity(n)
        assert s.rows is rows and s.capacity == 64


def test_growing_rows_keep_what_every_row_holds() -> None:
    """Rows grow while other sequences decode in them (a longer prompt is admitted): every
    row's K/V so far is kept, and the new positions are zeros (never uninitialised memory)."""
    s = rows_of(4)
    s.rows.normal_()
    before = s.rows.clone()
    s.ensure_capacity(16)
    assert torch.equal(s.rows[..., :4, :], before)
    assert not s.rows[..., 4:, :].any()


def test_rows_grow_to_the_next_rung_where_the_ladder_is_not_powers_of_two() -> None:
    """Rows asked for one token more than a rung grew to the smallest rung holding twice
    that rung, past the one holding what was asked, wherever rounding to blocks makes a
    rung more than half the next (max_context 3,000, block 16: 384 -> 1,504, not 752).
    Here the ladder of 36 is 36, 20, 12, 8, 4: from 12, 13 tokens take 20, not 36."""
    s = rows_of(12, max_context=36)
    assert s.capacity == 12
    s.ensure_capacity(13)
    assert s.capacity == 20
    s.ensure_capacity(21)
    assert s.capacity == 36


def test_zeroing_reaches_what_each_row_write_path_wrote_and_skips_what_is_zero() -> None:
    """Erasure fills only what was written since the last zeroing: each row up to the
    furthest slot a load, a forward's plan, a slot move or a row move wrote. A write one of
    them failed to note would stay in memory; a second zeroing with nothing written since
    fills nothing."""
    from services.kvpool.paged_cache import ForwardPlan, PagedCache

    s = rows_of(16, max_context=16)
    assert s.zero_unused_rows({}) == 0  # nothing written yet: nothing to fill
    s.blocks.normal_()
    s.load_row(0, [0, 1], 6)  # slots 0..5
    s.move_slots(0, [1], [9])  # slot 9, past every slot written before
    s.move_row(0, 1, 10)  # row 1: slots 0..9
    PagedCache(s).begin(ForwardPlan(1, [10], 3))  # a forward's K/V go to row 1, 10..12
    s.rows[:, :, 1, :, 10:13] = 1.0
    assert s.rows[:, :, 0, :, 9].any() and s.rows[:, :, 1, :, 12].all()
    assert s.zero_unused_rows({1: 4}) == 10 + (13 - 4)
    assert not s.rows[:, :, 0].any() and not s.rows[:, :, 1, :, 4:].any()
    assert s.rows[:, :, 1, :, :4].any()  # a running sequence's own tokens are kept
    assert s.zero_unused_rows({1: 4}) == 0


def test_zeroing_blocks_fills_those_written_since_they_were_last_zeroed() -> None:
    """A block a row was stored into or a copy-on-write filled is zeroed; one never written,
    or zeroed since, is skipped (it is zero already)."""
    s = rows_of(16, max_context=16)
    s.rows.normal_()
    s.store_blocks(0, [2], 0)
    s.copy_block(2, 3)
    assert s.blocks[2].any() and s.blocks[3].any()
    assert s.zero_blocks([0, 1, 2, 3]) == 2
    assert not s.blocks.any()
    assert s.zero_blocks([0, 1, 2, 3]) == 0


def test_the_integrity_check_fails_on_kv_written_where_no_write_was_noted() -> None:
    """Erasure fills only what was noted as written, so the engine's integrity check (after
    every step in the engine tests) fails on a row slot past its written extent or a block
    not noted, whichever write path left it; noted writes pass."""
    import pytest

    s = rows_of(16, max_context=16)
    s.check_integrity()
    s.rows[:, :, 1, :, 5] = 1.0  # written as a path that forgot `wrote` would
    with pytest.raises(AssertionError, match="row 1 holds K/V past its written extent"):
        s.check_integrity()
    s.wrote(1, 5)  # noted one slot short: slot 5 is the extent's first, and must be zero
    with pytest.raises(AssertionError, match=r"row 1 holds K/V past its written extent \(5\)"):
        s.check_integrity()
    s.wrote(1, 6)
    s.check_integrity()
    s.blocks[3] = 1.0
    with pytest.raises(AssertionError, match=r"blocks \[3\] hold K/V not noted"):
        s.check_integrity()
    s.copy_block(3, 2)  # a noted write: block 2 passes, 3 still fails
    with pytest.raises(AssertionError, match=r"blocks \[3\]"):
        s.check_integrity()
