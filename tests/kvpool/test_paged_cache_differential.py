"""A differential review of the kvpool's KV storage (paged_cache.KvStore, PagedCache) and the
attention that reads it (attention.py): seeded random steps against a model of the documented
rules, compared after every step.

The model (`Model`) is a dense map per working row from slot to that slot's K/V ([layers, 2,
kv_heads, head_dim]; zeros where never written: new rows are zeros) and a dict of pool blocks,
written from the docstrings: `load_row` puts token t of a sequence (token t % block_size of its
block t // block_size) at slot t; `store_blocks` copies full blocks first_block.. of a row into
the given pool blocks; `copy_block`; `move_slots` reads every source slot before writing any
destination; `move_row` copies a row's first n slots; a forward (`begin(plan)` then every
layer's `update`) writes row row0+b's token t to slot starts[b] + t and returns rows
row0..row0+B-1 up to the plan's kv_len; the rows hold `ensure_capacity`'s tokens, growing
only to the smallest rung of the ladder max_context, max_context/2, /4, ... (each rounded up
to a block) that holds them, every row's contents kept. Positions are starts[b] + t (with a
tree: starts[b] + depths[b][t]); query t of row b sees the cached slots before starts[b] and
the new slots its `visible` row marks (without a tree: the new tokens up to it).

Checked after every step: every working row, slot for slot up to the capacity, and every pool
block equal the model bit for bit; position ids, the mask and each layer's returned K/V as the
model says. After each forward the attention over what it returned (the kvpool's grouped SDPA
path and transformers' stock one, 4 query heads over 2 KV heads) equals a float64 softmax over
exactly the positions the model says each query sees (slots outside that hold stale or random
values). A second test runs the tiny Llama (tests/kvpool/conftest.py) through PagedCache as the
engine does — prefill chunks, batched forwards of rows at different starts, drafts whose
rejected tail is dropped by not counting it, trees whose accepted path `move_slots` moves,
full blocks stored in the pool and a sequence re-joined from them (`load_row`), rows moved
(`move_row`), rows growing mid-answer — and compares every counted position's logits with one
plain forward over the accepted tokens (and the greedy token where its margin is clear).

Run by the review: 23,000 store seeds (40 steps each) and 6,000 model seeds (2,000 on each of
three random weights). Found: a row growing from rung c to hold c + 1 tokens went to the
smallest rung holding 2c, past the smallest rung holding what was asked, wherever the ladder
is not a power of two (max_context 3,000, block 16: from 384 to 1,504 slots, not 752) — fixed
in `ensure_capacity` (test_paged_cache_rules.py guards it; 53 of 2,000 store seeds failed on
it). Nothing else diverged; the grouped and stock attention were bit-equal in every forward
checked (3,000 store seeds assert it).
Bugs injected to check the harness, failing store seeds of 200 / model seeds of 50: load_row's
partial block one token short 141 / 8; move_slots writing as it reads 35 / 0 (the engine's
moves are safe in order); a batched tree row's slots taken from its depths 111 / 15; a tree
row's mask hiding the last cached slot 186 / 42; growth dropping each row's last slot 36 / 13;
store_blocks one block late 157 / 6; the grouped path's heads tiled, not interleaved 200 / 50.
`KVPOOL_PAGED_DIFFERENTIAL_SEEDS=N` (default 100) and `KVPOOL_PAGED_DIFFERENTIAL_MODEL_SEEDS=N`
(default 60) run more.
"""

from __future__ import annotations

import math
import os
import random
import types

import torch

from services.kvpool import attention
from services.kvpool.paged_cache import ForwardPlan, KvStore, PagedCache
from tests.kvpool.conftest import TINY_VOCAB

SEEDS = int(os.environ.get("KVPOOL_PAGED_DIFFERENTIAL_SEEDS", "100"))
MODEL_SEEDS = int(os.environ.get("KVPOOL_PAGED_DIFFERENTIAL_MODEL_SEEDS", "60"))
STEPS = 40
L, H, D, QH = 2, 2, 4, 4  # layers, KV heads, head dim, query heads (grouped 2 per KV head)


def ladder(max_context: int, bs: int) -> list[int]:
    """The documented rungs: max_context, max_context/2, /4, ..., each rounded up to a block."""
    rungs, k = set(), 0
    while True:
        r = math.ceil(math.ceil(max_context / 2 ** k) / bs) * bs
        rungs.add(r)
        if r <= bs:
            return sorted(rungs)
        k += 1


class Model:
    """Working rows as dense slot -> K/V maps, pool blocks as a dict, the capacity by rungs."""

    def __init__(self, rows: int, bs: int, max_context: int, initial: int) -> None:
        self.rows: list[dict[int, torch.Tensor]] = [{} for _ in range(rows)]
        self.blocks: dict[int, torch.Tensor] = {}
        self.bs, self.rungs = bs, ladder(max_context, bs)
        self.capacity = 0
        self.grow(min(initial, self.rungs[-1]))

    def grow(self, n: int) -> None:
        if n > self.capacity:
            self.capacity = min(r for r in self.rungs if r >= n)

    def slot(self, r: int, t: int) -> torch.Tensor:
        return self.rows[r].get(t, torch.zeros(L, 2, H, D))

    def dense(self, r: int, n: int) -> torch.Tensor:
        """[L, 2, H, n, D]: row r's first n slots."""
        return torch.stack([self.slot(r, t) for t in range(n)], dim=3) if n else \
            torch.zeros(L, 2, H, 0, D)

    def block(self, b: int) -> torch.Tensor:
        return self.blocks.get(b, torch.zeros(L, 2, H, self.bs, D))

    def load_row(self, r: int, ids: list[int], n: int) -> None:
        for t in range(n):
            self.rows[r][t] = self.block(ids[t // self.bs])[:, :, :, t % self.bs].clone()

    def store_blocks(self, r: int, ids: list[int], first: int) -> None:
        for j, b in enumerate(ids):
            s = (first + j) * self.bs
            self.blocks[b] = torch.stack([self.slot(r, s + t) for t in range(self.bs)], dim=3)

    def copy_block(self, src: int, dst: int) -> None:
        self.blocks[dst] = self.block(src).clone()

    def move_slots(self, r: int, src: list[int], dst: list[int]) -> None:
        read = [self.slot(r, s).clone() for s in src]
        for d, v in zip(dst, read, strict=True):
            self.rows[r][d] = v

    def move_row(self, src: int, dst: int, n: int) -> None:
        read = [self.slot(src, t).clone() for t in range(n)]
        for t, v in enumerate(read):
            self.rows[dst][t] = v

    def sees(self, plan: ForwardPlan, b: int, t: int) -> list[int]:
        """The slots query t of row b attends to."""
        s = plan.starts[b]
        new = (range(t + 1) if plan.visible is None
               else [j for j in range(plan.q_len) if plan.visible[b][t][j]])
        return list(range(s)) + [s + j for j in new]


def random_tree(rng: random.Random, q: int) -> tuple[tuple[int, ...], list[list[bool]]]:
    """A row's layout: token 0 the root; each later token a child of an earlier one (seeing
    itself and its ancestors), or, now and then, filler that sees only itself."""
    depths, anc = [0], [{0}]
    for t in range(1, q):
        if rng.random() < 0.15:
            depths.append(rng.randrange(q + 2))
            anc.append({t})
        else:
            p = rng.randrange(t)
            depths.append(depths[p] + 1)
            anc.append(anc[p] | {t})
    return tuple(depths), [[j in anc[t] for j in range(q)] for t in range(q)]


def chain(q: int) -> tuple[tuple[int, ...], list[list[bool]]]:
    """A row without a tree in a tree plan: q tokens in order."""
    return tuple(range(q)), [[j <= t for j in range(q)] for t in range(q)]


def random_plan(rng: random.Random, rows: int, max_context: int) -> ForwardPlan:
    b = rng.randint(1, rows)
    row0 = rng.randrange(rows - b + 1)
    q = rng.choice([1, 1, 2, 3, 4, 5])
    starts = [rng.randrange(max_context - q + 1) for _ in range(b)]
    plan = ForwardPlan(row0, starts, q)
    if q > 1 and rng.random() < 0.4:
        layouts = [random_tree(rng, q) if rng.random() < 0.7 else chain(q) for _ in range(b)]
        plan.depths, plan.visible = [d for d, _ in layouts], [v for _, v in layouts]
    return plan


def brute_attention(m: Model, plan: ForwardPlan, query: torch.Tensor, layer: int
                    ) -> torch.Tensor:
    """[B, T, QH, D] float64: each query's softmax over exactly the slots the model says it
    sees, keys and values from the model."""
    b_, _, t_, _ = query.shape
    out = torch.zeros(b_, t_, QH, D, dtype=torch.float64)
    for b in range(b_):
        r = plan.row0 + b
        for t in range(t_):
            seen = m.sees(plan, b, t)
            kv = torch.stack([m.slot(r, s)[layer] for s in seen]).double()  # [S, 2, H, D]
            for h in range(QH):
                g = h // (QH // H)
                scores = kv[:, 0, g] @ query[b, h, t].double() / math.sqrt(D)
                out[b, t, h] = torch.softmax(scores, 0) @ kv[:, 1, g]
    return out


def check_store(s: KvStore, m: Model, ctx) -> None:
    assert s.capacity == m.capacity, (ctx, "capacity", s.capacity, m.capacity)
    assert s.rows.shape[-2] == s.capacity, ctx
    for r in range(s.max_rows):
        assert torch.equal(s.rows[:, :, r, :, :], m.dense(r, s.capacity)), (ctx, "row", r)
    for b in range(s.blocks.shape[0]):
        assert torch.equal(s.blocks[b], m.block(b)), (ctx, "block", b)


def check_forward(s: KvStore, cache: PagedCache, m: Model, plan: ForwardPlan,
                  rng: random.Random, gen: torch.Generator, ctx) -> None:
    """Begin `plan`, write random K/V through every layer; positions, mask, returned K/V and
    both attention paths as the model says."""
    cache.begin(plan)
    m.grow(plan.kv_len)
    b_, q = plan.batch, plan.q_len
    pos = [[plan.starts[b] + (t if plan.depths is None else plan.depths[b][t]) for t in range(q)]
           for b in range(b_)]
    assert cache.position_ids().tolist() == pos, (ctx, "positions")
    mask = cache.attention_mask()
    assert mask.dtype == torch.bool and mask.shape == (b_, 1, q, plan.kv_len), ctx
    for b in range(b_):
        for t in range(q):
            seen = m.sees(plan, b, t)
            want = [k in seen for k in range(plan.kv_len)]
            assert mask[b, 0, t].tolist() == want, (ctx, "mask", b, t)
    assert cache.layers[0].get_mask_sizes(q) == (plan.kv_len, 0), ctx
    module = types.SimpleNamespace(num_key_value_groups=QH // H)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    for layer in range(L):
        k = torch.randn(b_, H, q, D, generator=gen)
        v = torch.randn(b_, H, q, D, generator=gen)
        for b in range(b_):  # each layer's update writes its own layer of the slots
            for t in range(q):
                slot = m.slot(plan.row0 + b, plan.starts[b] + t).clone()
                slot[layer] = torch.stack([k[b, :, t], v[b, :, t]])
                m.rows[plan.row0 + b][plan.starts[b] + t] = slot
        k_all, v_all = cache.layers[layer].update(k, v)
        assert k_all.shape == v_all.shape == (b_, H, plan.kv_len, D), ctx
        for b in range(b_):
            want = m.dense(plan.row0 + b, plan.kv_len)[layer]
            assert torch.equal(k_all[b], want[0]) and torch.equal(v_all[b], want[1]), (
                ctx, "returned K/V", layer, b)
        query = torch.randn(b_, QH, q, D, generator=gen)
        want = brute_attention(m, plan, query, layer)
        grouped, _ = attention._sdpa(module, query, k_all, v_all, mask)
        stock, _ = sdpa_attention_forward(module, query, k_all, v_all, mask)
        assert grouped.shape == (b_, q, QH, D), ctx
        assert (grouped.double() - want).abs().max() < 1e-5, (ctx, "grouped attention")
        # The same attention, bit for bit, as the exactness tests assume (test_attention.py).
        assert torch.equal(grouped, stock), (ctx, "grouped and stock paths differ")


def run_store(seed: int, steps: int = STEPS) -> dict[str, int]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    bs = rng.choice([2, 3, 4])
    rows = rng.randint(1, 4)
    nblocks = rng.randint(2, 8)
    max_context = rng.choice([5, 8, 9, 12, 16, 19, 24, 31])
    initial = rng.choice([1, 2, 4, 7, 256])
    s = KvStore(num_layers=L, kv_heads=H, head_dim=D, num_blocks=nblocks, block_size=bs,
                max_rows=rows, max_context=max_context, dtype=torch.float32, device="cpu",
                initial_capacity=initial)
    m = Model(rows, bs, max_context, initial)
    cache = PagedCache(s)
    seen: dict[str, int] = {}
    check_store(s, m, (seed, "init"))
    for step in range(steps):
        op = rng.choice(["grow", "load", "store", "copy", "slots", "row", "scribble",
                         "forward", "forward", "forward"])
        ctx = (seed, step, op)
        if op == "grow":
            n = rng.randint(1, max_context)
            s.ensure_capacity(n)
            m.grow(n)
        elif op == "load":
            k = rng.randint(1, nblocks)
            if rng.random() < 0.5:  # one run of consecutive ids (a single strided copy)
                b0 = rng.randrange(nblocks - k + 1)
                ids = list(range(b0, b0 + k))
            else:
                ids = rng.sample(range(nblocks), k)
            n = rng.randint(0, min(k * bs, max_context))
            s.ensure_capacity(n)
            m.grow(n)
            r = rng.randrange(rows)
            s.load_row(r, ids, n)
            m.load_row(r, ids, n)
        elif op == "store":
            full = s.capacity // bs
            nb = rng.randint(0, min(full, nblocks))
            first = rng.randint(0, full - nb)
            ids = rng.sample(range(nblocks), nb)
            r = rng.randrange(rows)
            s.store_blocks(r, ids, first)
            m.store_blocks(r, ids, first)
        elif op == "copy":
            a, b = rng.randrange(nblocks), rng.randrange(nblocks)
            s.copy_block(a, b)
            m.copy_block(a, b)
        elif op == "slots":  # a tree's path: distinct sources, distinct targets, may overlap
            n = rng.randint(0, min(4, s.capacity))
            if rng.random() < 0.5:  # as the engine: node i of the path to slot start + 1 + k
                start = rng.randrange(s.capacity - n + 1) if n else 0
                nodes = sorted(rng.sample(range(s.capacity - start), n))
                src, dst = [start + i for i in nodes], [start + k for k in range(n)]
            else:
                src = rng.sample(range(s.capacity), n)
                dst = rng.sample(range(s.capacity), n)
            r = rng.randrange(rows)
            s.move_slots(r, src, dst)
            m.move_slots(r, src, dst)
        elif op == "row":
            a, b = rng.randrange(rows), rng.randrange(rows)
            n = rng.randint(0, s.capacity)
            s.move_row(a, b, n)
            m.move_row(a, b, n)
        elif op == "scribble":  # stale K/V of an earlier sequence, anywhere in a row
            r = rng.randrange(rows)
            for t in rng.sample(range(s.capacity), rng.randint(1, s.capacity)):
                val = torch.randn(L, 2, H, D, generator=gen)
                s.rows[:, :, r, :, t] = val
                m.rows[r][t] = val
        else:
            plan = random_plan(rng, rows, max_context)
            kind = "tree" if plan.depths else "batch" if plan.batch > 1 else "single"
            seen[kind] = seen.get(kind, 0) + 1
            before = m.capacity
            check_forward(s, cache, m, plan, rng, gen, ctx)
            if m.capacity != before:
                seen["grown in a forward"] = seen.get("grown in a forward", 0) + 1
        seen[op] = seen.get(op, 0) + 1
        check_store(s, m, ctx)
    return seen


def test_the_store_and_the_cache_keep_the_documented_rules_step_by_step() -> None:
    seen: dict[str, int] = {}
    for seed in range(SEEDS):
        for k, v in run_store(seed).items():
            seen[k] = seen.get(k, 0) + v
    if SEEDS >= 100:  # the bounded run reaches every path it is meant to check
        for kind in ("tree", "batch", "single", "grown in a forward", "load", "slots"):
            assert seen.get(kind, 0) >= 20, (kind, seen)


class Seq:
    """A sequence whose tokens are all known: what a forward may count is a prefix of them."""

    def __init__(self, tokens: list[int], ref: torch.Tensor, row: int) -> None:
        self.tokens, self.ref, self.row = tokens, ref, row
        self.computed = 0  # its row holds tokens[:computed]
        self.table: list[int] = []  # its pool blocks, in order
        self.stored = 0  # full blocks of it copied into the pool

    @property
    def done(self) -> bool:
        return self.computed == len(self.tokens)


def _tree_row(rng: random.Random, seq: Seq, q: int, vocab: int
              ) -> tuple[list[int], tuple[int, ...], list[list[bool]], list[int]]:
    """A tree of q tokens after seq's computed ones: the root (its next token), a path of its
    true tokens and decoy nodes in a random order (parents first), now and then filler that
    sees only itself. Returns tokens, depths, visible and the path's nodes (query indices)."""
    c, n = seq.computed, len(seq.tokens)
    true_len = rng.randint(0, min(q - 1, n - c - 1))
    kinds = ["true"] * true_len + ["decoy"] * (q - 1 - true_len)
    rng.shuffle(kinds)
    tokens, depths, parents = [seq.tokens[c]], [0], [-1]
    anc: list[set[int]] = [{0}]
    path: list[int] = []
    filler: list[bool] = [False]
    for kind in kinds:
        t = len(tokens)
        if kind == "true":
            p = path[-1] if path else 0
            depth = len(path) + 1
            tokens.append(seq.tokens[c + depth])
            path.append(t)
        elif rng.random() < 0.15:
            tokens.append(rng.randrange(1, vocab))
            depths.append(rng.randrange(q))
            parents.append(-1)
            anc.append({t})
            filler.append(True)
            continue
        else:
            p = rng.choice([i for i in range(t) if not filler[i]])
            depth = depths[p] + 1
            tokens.append(rng.randrange(1, vocab))
        depths.append(depth)
        parents.append(p)
        anc.append(anc[p] | {t})
        filler.append(False)
    visible = [[j in anc[t] for j in range(q)] for t in range(q)]
    return tokens, tuple(depths), visible, path


def run_model(seed: int, model, vocab: int, refs: dict) -> dict[str, int]:
    """Sequences run through PagedCache in random forwards; every counted position's logits
    equal the plain forward's."""
    rng = random.Random(seed)
    bs = rng.choice([2, 3, 4])
    nseq = rng.randint(1, 3)
    max_context = rng.choice([17, 24, 30])
    cfg = model.config
    store = KvStore(num_layers=cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads,
                    head_dim=cfg.hidden_size // cfg.num_attention_heads,
                    num_blocks=nseq * 2 * (max_context // bs + 1), block_size=bs,
                    max_rows=nseq + 1, max_context=max_context, dtype=torch.float32,
                    device="cpu", initial_capacity=rng.choice([1, 4, 8]))
    cache = PagedCache(store)
    free_blocks = list(range(store.blocks.shape[0]))
    rng.shuffle(free_blocks)
    seqs = []
    for i in range(nseq):
        toks = [rng.randrange(1, vocab) for _ in range(rng.randint(4, max_context))]
        if rng.random() < 0.3 and seqs:  # a shared prefix
            toks = seqs[0].tokens[:rng.randint(1, len(seqs[0].tokens))] + toks
            toks = toks[:max_context]
        key = tuple(toks)
        if key not in refs:
            with torch.inference_mode():
                refs[key] = model(torch.tensor([toks])).logits[0].float()
        seqs.append(Seq(toks, refs[key], i))
    at: list[Seq | None] = [*seqs, None]
    seen: dict[str, int] = {}

    def count(kind: str) -> None:
        seen[kind] = seen.get(kind, 0) + 1

    def compare(s: Seq, logits: torch.Tensor, positions: list[int], ctx) -> None:
        want = s.ref[positions]
        assert (logits - want).abs().max() < 1e-4, (ctx, positions, (logits - want).abs().max())
        top = want.topk(2, dim=-1).values
        clear = (top[:, 0] - top[:, 1]) > 1e-3
        assert torch.equal(logits.argmax(-1)[clear], want.argmax(-1)[clear]), ctx

    def commit(s: Seq) -> None:
        full = s.computed // bs
        while len(s.table) < full:
            s.table.append(free_blocks.pop())
        if full > s.stored:
            store.store_blocks(s.row, s.table[s.stored:full], s.stored)
            s.stored = full
            count("stored")

    for step in range(400):
        if all(s.done for s in seqs):
            break
        ctx = (seed, step)
        op = rng.choice(["forward"] * 6 + ["commit", "rejoin", "move"])
        live = [r for r, s in enumerate(at) if s is not None and not s.done]
        if op == "commit":
            for s in seqs:
                commit(s)
            continue
        if op == "move":  # to the free row, as compaction moves a row down
            src = rng.choice([r for r, s in enumerate(at) if s is not None])
            dst = at.index(None)
            s = at[src]
            store.move_row(src, dst, s.computed)
            at[src], at[dst], s.row = None, s, dst
            count("moved")
            continue
        if op == "rejoin":  # its row given up; later its prefix comes back from the pool
            s = rng.choice(seqs)
            if not s.stored:
                continue
            n = rng.randint(0, s.stored * bs)
            dst = rng.choice([at.index(None), s.row])
            keep = -(-n // bs)
            free_blocks[:0] = s.table[keep:]  # given back: reused, stale, by later stores
            s.table = s.table[:keep]
            if n % bs:  # copy-on-write: the block holding the first token to recompute
                fresh = free_blocks.pop()
                store.copy_block(s.table[-1], fresh)
                free_blocks.insert(0, s.table[-1])
                s.table[-1] = fresh
            s.stored = n // bs
            store.ensure_capacity(n)
            store.load_row(dst, s.table, n)
            at[s.row], at[dst], s.row, s.computed = None, s, dst, n
            count("rejoined")
            continue
        # A forward of a contiguous run of rows with something left to compute.
        r0 = rng.choice(live)
        r1 = r0 + 1
        while r1 < len(at) and r1 in live and rng.random() < 0.7:
            r1 += 1
        batch = [at[r] for r in range(r0, r1)]
        room = max_context - max(s.computed for s in batch)
        q = rng.randint(1, min(6, room))
        rows, layouts, counted = [], [], []
        for s in batch:
            c, n = s.computed, len(s.tokens)
            if q > 1 and rng.random() < 0.35:
                toks, depths, vis, path = _tree_row(rng, s, q, vocab)
                rows.append(toks)
                layouts.append((depths, vis))
                counted.append(("tree", path))
                continue
            k = rng.randint(1, min(q, n - c))  # its own tokens (a prefill chunk, a decode)
            p = rng.randint(0, q - k)  # a proposal: the first a of it right
            a = rng.randint(0, min(p, n - c - k))
            wrong = [(t % (vocab - 1)) + 1 for t in s.tokens[c + k + a:c + k + p]]
            wrong += [rng.randrange(1, vocab) for _ in range(p - a - len(wrong))]
            own = s.tokens[c:c + k + a] + wrong
            rows.append(own + [own[-1]] * (q - len(own)))  # filler, as the engine pads
            layouts.append(chain(q))
            counted.append(("plain", k + a))
        plan = ForwardPlan(r0, [s.computed for s in batch], q)
        if any(kind == "tree" for kind, _ in counted):
            plan.depths = [d for d, _ in layouts]
            plan.visible = [v for _, v in layouts]
        cap = store.capacity
        cache.begin(plan)
        count("grown mid-answer" if store.capacity != cap and step else "forward")
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor(rows), cache=cache,
                           position_ids=cache.position_ids(),
                           attention_mask=cache.attention_mask(), use_cache=True).logits.float()
        for b, (s, (kind, what)) in enumerate(zip(batch, counted, strict=True)):
            c = s.computed
            if kind == "plain":
                compare(s, logits[b, :what], list(range(c, c + what)), (ctx, b, "plain"))
                s.computed += what
                continue
            count("tree")
            nodes = [0, *what]
            compare(s, logits[b, nodes], list(range(c, c + len(nodes))), (ctx, b, "tree"))
            moves = [(c + i, c + d) for d, i in enumerate(nodes) if i != d]
            store.move_slots(s.row, [x for x, _ in moves], [y for _, y in moves])
            s.computed += len(nodes)
        if len(batch) > 1:
            count("batch")
    assert all(s.done for s in seqs), (seed, "ran out of steps")
    return seen


def test_logits_through_the_paged_cache_equal_one_plain_forward(tiny_model) -> None:
    """The model runs with the kvpool's attention, as an engine sets it; the reference is a
    forward without a cache or a mask (transformers' stock causal SDPA)."""
    if tiny_model.config._attn_implementation == "sdpa":
        tiny_model.set_attn_implementation(attention.register())
    refs: dict = {}
    seen: dict[str, int] = {}
    for seed in range(MODEL_SEEDS):
        for k, v in run_model(seed, tiny_model, TINY_VOCAB, refs).items():
            seen[k] = seen.get(k, 0) + v
    if MODEL_SEEDS >= 60:
        for kind in ("tree", "batch", "stored", "rejoined", "moved", "grown mid-answer"):
            assert seen.get(kind, 0) >= 20, (kind, seen)
