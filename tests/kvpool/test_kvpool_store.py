"""KvStore copies between pool blocks and working rows, against a naive per-token reference."""

from __future__ import annotations

import pytest
import torch

from services.kvpool.paged_cache import KvStore

L, H, D, BS = 2, 2, 3, 4


def store(num_blocks: int = 12, rows: int = 3) -> KvStore:
    s = KvStore(num_layers=L, kv_heads=H, head_dim=D, num_blocks=num_blocks, block_size=BS,
                max_rows=rows, max_context=64, dtype=torch.float32, device="cpu",
                initial_capacity=64)
    torch.manual_seed(0)
    s.blocks.normal_()
    return s


def naive_row(s: KvStore, block_ids: list[int], n: int) -> torch.Tensor:
    """[L, 2, H, n, D]: token t of the sequence is token t % BS of block block_ids[t // BS]."""
    return torch.stack([s.blocks[block_ids[t // BS], :, :, :, t % BS] for t in range(n)], dim=3)


@pytest.mark.parametrize("ids", [[3, 4, 5, 6], [7, 2, 9, 0], [1, 2, 8, 9], [5, 6, 0, 1]])
@pytest.mark.parametrize("n", [1, 4, 7, 13, 16])
def test_load_row_gathers_exactly_the_prefix_tokens(ids: list[int], n: int) -> None:
    s = store()
    s.rows[:, :, 1].fill_(-7.0)
    before_other_rows = s.rows[:, :, [0, 2]].clone()
    s.load_row(1, ids, n)
    assert torch.equal(s.rows[:, :, 1, :, :n], naive_row(s, ids, n))
    assert (s.rows[:, :, 1, :, n:] == -7.0).all(), "positions past the prefix were written"
    assert torch.equal(s.rows[:, :, [0, 2]], before_other_rows), "another row was written"


def test_store_blocks_then_load_row_round_trips() -> None:
    s = store()
    s.rows[:, :, 0].normal_()
    row = s.rows[:, :, 0, :, :16].clone()
    s.store_blocks(0, [10, 11], 2)  # tokens 8..15 -> blocks 10, 11
    s.store_blocks(0, [4, 1], 0)  # tokens 0..7 -> blocks 4, 1
    s.load_row(2, [4, 1, 10, 11], 16)
    assert torch.equal(s.rows[:, :, 2, :, :16], row)
