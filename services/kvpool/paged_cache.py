"""KV storage for the pool and the `transformers` cache class that runs the model over it.

Two tensors, one per purpose:

    blocks  [num_blocks, layers, 2, kv_heads, block_size, head_dim]   the pool: shared, cached
    rows    [layers, 2, max_rows, kv_heads, capacity, head_dim]        working rows, one per
                                                                      running sequence

A sequence joining the batch gathers its cached prefix from `blocks` into its row once; every
forward then appends K/V to the rows (cheap, in place) and attention reads the rows directly, as
a plain cache would (re-gathering blocks at each step cost ~20 ms/step). Whenever a block of a
sequence fills up, the engine copies it from the row into its pool block and commits it, so the
pool always holds every full block and later requests can reuse it.

Rows of the sequences decoded together are kept contiguous (0..B-1), so a batched decode reads
`rows[l, 0, :B, :, :kv_len]` as a view — no per-step copy. Keys are stored after RoPE: a block is
only valid at its own absolute position, which is exactly how prefix reuse uses it.

Erasure (`zero_blocks`, `zero_unused_rows`) zeroes only what may be non-zero: the store notes
each block written since it was last zeroed and each row's written extent (its highest slot
written + 1 since then). Every write to either tensor goes through this module (a forward's
through `PagedCache.begin`'s plan), which notes it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass
class ForwardPlan:
    """Where the tokens of one forward go: rows `row0..row0+B-1`, starting at `starts[b]`.

    With trees (`drafting.Tree`; `depths` and `visible` given, a row each): row b's new tokens
    still go to the slots starts[b].., but its token t sits at position starts[b] +
    depths[b][t] and sees the cached positions and the new tokens that `visible[b][t]` marks
    (a tree node: itself and its ancestors; a row without a tree: the tokens up to it)."""

    row0: int
    starts: list[int]  # slot of each row's first new token (and its position)
    q_len: int  # new tokens per row (same for all rows of a forward)
    depths: list[tuple[int, ...]] | None = None  # per row, each new token's depth (root 0)
    visible: list[list[list[bool]]] | None = None  # per row, [q_len][q_len]

    @property
    def batch(self) -> int:
        return len(self.starts)

    @property
    def kv_len(self) -> int:
        return max(self.starts) + self.q_len


class KvStore:
    """The block tensor plus the working rows (see the module docstring)."""

    def __init__(self, *, num_layers: int, kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int, max_rows: int, max_context: int, dtype: torch.dtype,
                 device: torch.device | str, initial_capacity: int = 256) -> None:
        self.num_layers, self.kv_heads, self.head_dim = num_layers, kv_heads, head_dim
        self.block_size, self.max_rows, self.max_context = block_size, max_rows, max_context
        self.dtype, self.device = dtype, torch.device(device)
        self.blocks = torch.zeros(num_blocks, num_layers, 2, kv_heads, block_size, head_dim,
                                  dtype=dtype, device=self.device)
        self.capacity = 0
        self.rows = torch.zeros(0)
        self._dirty: set[int] = set()  # blocks written since they were last zeroed
        self._extent = [0] * max_rows  # per row: slots from here on are zero
        self.ensure_capacity(min(initial_capacity, self._round(max_context)))

    @staticmethod
    def block_bytes(num_layers: int, kv_heads: int, head_dim: int, block_size: int,
                    dtype: torch.dtype) -> int:
        """Bytes of one pool block."""
        return num_layers * 2 * kv_heads * block_size * head_dim * dtype.itemsize

    def _round(self, n: int) -> int:
        return -(-n // self.block_size) * self.block_size

    def _rung(self, num_tokens: int) -> int:
        """The smallest capacity on the ladder max_context, max_context/2, /4, ... (each rounded
        up to a block) that holds `num_tokens`. Growing only along it keeps the copy's peak
        (old and new rows at once) within 1.5x the full size: the step to the top comes from
        at most half of it. Jumping straight to a long prompt's length and then doubling
        could hold nearly 2x."""
        top = self._round(self.max_context)
        cap = top
        while cap > self.block_size:
            half = self._round(-(-cap // 2))
            if half < num_tokens or half >= cap:
                break
            cap = half
        return max(cap, self._round(num_tokens))

    def ensure_capacity(self, num_tokens: int) -> None:
        """Grow every row to hold `num_tokens` positions (along `_rung`'s ladder; contents
        kept)."""
        if num_tokens <= self.capacity:
            return
        # The smallest rung that holds them, not the one that holds twice the rows: the rung
        # above the rows' own is at most twice it anyway, and where rounding to blocks makes a
        # rung more than half the next, doubling first skipped one (3,000 / 16: 384 -> 1,504).
        cap = self._rung(num_tokens)
        # Zeros, not empty(): masked-out positions are still multiplied by 0 in attention, and
        # uninitialised memory may hold NaN (0 * NaN = NaN).
        rows = torch.zeros(self.num_layers, 2, self.max_rows, self.kv_heads, cap, self.head_dim,
                           dtype=self.dtype, device=self.device)
        if self.capacity:
            rows[..., : self.capacity, :] = self.rows
        self.rows, self.capacity = rows, cap

    def load_row(self, row: int, block_ids: list[int], num_tokens: int) -> None:
        """Gather the first `num_tokens` tokens of a sequence from its pool blocks into `row`."""
        if num_tokens <= 0:
            return
        self.wrote(row, num_tokens)
        bs = self.block_size
        full, rem = divmod(num_tokens, bs)
        # One strided copy per run of consecutive block ids, straight into the row: a gather
        # (index_select, then reshape) made two full-size temporaries and cost ~5x as much,
        # which a prefix hit pays before its first token.
        # rows[l, kv, row, h, j*bs + t, d] <- blocks[ids[j], l, kv, h, t, d]
        dst = self.rows[:, :, row, :, :full * bs].unflatten(3, (full, bs))
        for j0, j1, b0 in _runs(block_ids[:full]):
            dst[:, :, :, j0:j1].copy_(self.blocks[b0:b0 + j1 - j0].permute(1, 2, 3, 0, 4, 5))
        if rem:
            tail = self.blocks[block_ids[full], :, :, :, :rem]
            self.rows[:, :, row, :, full * bs:num_tokens] = tail

    def store_blocks(self, row: int, block_ids: list[int], first_block: int) -> None:
        """Copy full blocks `first_block..` of `row` into the given pool blocks (one copy)."""
        if not block_ids:
            return
        bs, nb = self.block_size, len(block_ids)
        s = first_block * bs
        # [L, 2, H, nb*bs, D] -> [nb, L, 2, H, bs, D]
        src = self.rows[:, :, row, :, s:s + nb * bs].reshape(
            self.num_layers, 2, self.kv_heads, nb, bs, self.head_dim).permute(3, 0, 1, 2, 4, 5)
        idx = torch.tensor(block_ids, device=self.device)
        self._dirty.update(block_ids)
        self.blocks.index_copy_(0, idx, src)

    def wrote(self, row: int, end: int) -> None:
        """Note that `row`'s slots before `end` may hold K/V (for `zero_unused_rows`)."""
        if end > self._extent[row]:
            self._extent[row] = end

    def zero_blocks(self, block_ids: list[int]) -> int:
        """Overwrite the given pool blocks with zeros, every layer's K and V (one fill): an
        erased tenant's KV must not stay in memory until the next allocation writes there.
        Blocks not written since they were last zeroed (or made) are zero already and left
        alone. Returns how many were zeroed."""
        ids = [bid for bid in block_ids if bid in self._dirty]
        if ids:
            self.blocks.index_fill_(0, torch.tensor(ids, device=self.device), 0)
            self._dirty.difference_update(ids)
        return len(ids)

    def zero_unused_rows(self, held: dict[int, int]) -> int:
        """Overwrite with zeros every working-row slot no running sequence holds: each row not
        in `held` (row -> tokens its sequence has computed), whose ended sequence left its KV
        there, and each held row past its tokens (a longer sequence's, or rejected draft
        tokens). Only up to each row's written extent: past it the row is zero already.
        Returns the slots zeroed."""
        zeroed = 0
        for row, end in enumerate(self._extent):
            keep = held.get(row, 0)
            if end > keep:
                self.rows[:, :, row, :, keep:end].zero_()
                self._extent[row] = keep
                zeroed += end - keep
        return zeroed

    def check_integrity(self) -> None:
        """What erasure relies on, since it fills only what was noted as written: every block
        not noted is zero, and every row is zero from its written extent on. A write path
        that does not note what it writes fails here at the next check (tests check after
        every engine step), not only where a flush happens to leave its K/V."""
        for row, end in enumerate(self._extent):
            assert not self.rows[:, :, row, :, end:].any(), (
                f"row {row} holds K/V past its written extent ({end})")
        written = self.blocks.flatten(1).any(1).nonzero().flatten().tolist()
        unnoted = sorted(set(written) - self._dirty)
        assert not unnoted, f"blocks {unnoted[:8]} hold K/V not noted as written"

    def copy_block(self, src: int, dst: int) -> None:
        self._dirty.add(dst)
        self.blocks[dst] = self.blocks[src]

    def move_slots(self, row: int, src: list[int], dst: list[int]) -> None:
        """Copy the K/V of `row`'s slots `src` to its slots `dst` (all read before any is
        written): a tree's accepted path, moved to where its positions belong."""
        if src:
            self.wrote(row, max(dst) + 1)
            r = self.rows[:, :, row]
            r[:, :, :, torch.tensor(dst, device=self.device)] = \
                r[:, :, :, torch.tensor(src, device=self.device)]

    def move_row(self, src: int, dst: int, num_tokens: int) -> None:
        """Move a sequence's working row (to keep decoding rows contiguous)."""
        if src != dst and num_tokens > 0:
            self.wrote(dst, num_tokens)
            self.rows[:, :, dst, :, :num_tokens] = self.rows[:, :, src, :, :num_tokens]

    def nbytes(self) -> tuple[int, int]:
        """(pool bytes, working-row bytes)."""
        return (self.blocks.numel() * self.blocks.element_size(),
                self.rows.numel() * self.rows.element_size())


def _runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ids as (start index, end index, first id)."""
    out = []
    start = 0
    for j in range(1, len(ids) + 1):
        if j == len(ids) or ids[j] != ids[j - 1] + 1:
            out.append((start, j, ids[start]))
            start = j
    return out


class PagedLayer(CacheLayerMixin):
    """One model layer's view of the working rows, driven by the cache's current plan."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, cache: PagedCache, layer_idx: int) -> None:
        super().__init__()
        self.cache = cache
        self.layer_idx = layer_idx
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new K/V (after RoPE) into the rows; return all K/V attention needs."""
        plan = self.cache.plan
        rows = self.cache.store.rows
        k_all, v_all = rows[self.layer_idx, 0], rows[self.layer_idx, 1]
        r0, b, t = plan.row0, plan.batch, plan.q_len
        if b == 1:
            s = plan.starts[0]
            k_all[r0, :, s:s + t] = key_states[0]
            v_all[r0, :, s:s + t] = value_states[0]
        else:
            ridx, pidx = self.cache.index_tensors()
            # [B, H, T, D] -> [B, T, H, D] to match k_all[ridx, :, pidx] (advanced dims first)
            k_all[ridx, :, pidx] = key_states.transpose(1, 2)
            v_all[ridx, :, pidx] = value_states.transpose(1, 2)
        kv_len = plan.kv_len
        return k_all[r0:r0 + b, :, :kv_len], v_all[r0:r0 + b, :, :kv_len]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.plan.kv_len, 0

    def get_seq_length(self) -> int:
        return min(self.cache.plan.starts)

    def get_max_length(self) -> int:
        return self.cache.store.capacity


class PagedCache(Cache):
    """A `transformers` Cache over a KvStore; call `begin(plan)` before each forward.

    The model code runs unchanged: the caller passes explicit `position_ids` and a 4-D boolean
    mask from `attention_mask()`, which the library uses as-is for ragged batches.
    """

    def __init__(self, store: KvStore) -> None:
        self.store = store
        self.plan = ForwardPlan(0, [0], 0)
        self._idx: tuple[torch.Tensor, torch.Tensor] | None = None
        self._pos: torch.Tensor | None = None
        super().__init__(layers=[PagedLayer(self, i) for i in range(store.num_layers)])

    def begin(self, plan: ForwardPlan) -> None:
        assert plan.row0 + plan.batch <= self.store.max_rows
        assert plan.depths is None or (
            plan.visible is not None and len(plan.depths) == len(plan.visible) == plan.batch
            and all(len(d) == len(v) == plan.q_len
                    for d, v in zip(plan.depths, plan.visible, strict=True)))
        self.store.ensure_capacity(plan.kv_len)
        for b, start in enumerate(plan.starts):  # what the layers' `update` writes
            self.store.wrote(plan.row0 + b, start + plan.q_len)
        self.plan = plan
        self._idx = None
        self._pos = None

    def index_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(row, slot) index tensors [B, T] of the new tokens (built once per forward): their
        positions, except in a tree's row."""
        if self._idx is None:
            p = self.plan
            dev = self.store.device
            rows = torch.arange(p.row0, p.row0 + p.batch, device=dev)[:, None].expand(-1, p.q_len)
            slots = (self.position_ids() if p.depths is None else
                     torch.tensor(p.starts, device=dev)[:, None]
                     + torch.arange(p.q_len, device=dev)[None, :])
            self._idx = (rows, slots)
        return self._idx

    def position_ids(self) -> torch.Tensor:
        """[B, T] absolute positions of the plan's new tokens (built once per forward: the
        model, the mask and the KV writes all use it, and each build copies to the device)."""
        if self._pos is None:
            p = self.plan
            dev = self.store.device
            offsets = (torch.tensor(p.depths, device=dev) if p.depths is not None
                       else torch.arange(p.q_len, device=dev)[None, :])
            self._pos = torch.tensor(p.starts, device=dev)[:, None] + offsets
        return self._pos

    def attention_mask(self) -> torch.Tensor:
        """[B, 1, T, kv_len] bool: query t of row b sees keys 0..starts[b]+t (with trees: the
        row's cached keys and its `visible` new ones)."""
        p = self.plan
        dev = self.store.device
        if p.visible is not None:
            starts = torch.tensor(p.starts, device=dev)[:, None, None]
            k = torch.arange(p.kv_len, device=dev)[None, None, :]
            mask = (k < starts).expand(p.batch, p.q_len, p.kv_len).clone()
            slots = (starts + torch.arange(p.q_len, device=dev)[None, None, :]
                     ).expand(p.batch, p.q_len, p.q_len)
            mask.scatter_(2, slots, torch.tensor(p.visible, dtype=torch.bool, device=dev))
            return mask[:, None]
        q = self.position_ids()
        k = torch.arange(p.kv_len, device=dev)
        return (k[None, None, :] <= q[:, :, None])[:, None]
