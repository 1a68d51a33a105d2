"""The engine: one thread owns the model, the KV store and the block pool.

RPC handlers `submit` requests and read results from the request's own queue; everything that
changes ref counts happens on the engine thread. Each loop iteration:

 1. drains the inbox (new requests, cancellations, calls such as a resync snapshot);
 2. drops sequences whose deadline passed, expires pins;
 3. starts the next waiting sequence's prefill when a row is free (it references its longest
    cached prefix; copy-on-write for the block holding the first token to recompute);
 4. runs one prefill chunk (at most `max_prefill_chunk` tokens) of the prefilling sequence;
 5. runs one batched decode forward for every decoding sequence (continuous batching);
 6. copies newly filled blocks into the pool and commits them (they become reusable at once).

Row layout (see paged_cache): decoding sequences hold rows 0..D-1, the prefilling one row D.

A sequence's KV covers `tokens[:num_computed]`; a forward always computes
`tokens[num_computed:]` (or a chunk of it) and, once all is computed, samples the next token.

Cache-assisted generation: a request may carry draft tokens (a cached near-miss answer). Its
`Draft` (see drafting.py) proposes the next gamma tokens: from where the end of what has been
generated matches the draft longest (so it re-aligns after a mismatch), or from the sequence's
own prompt and output where they match longer (prompt lookup). A forward also computes them;
the sampler accepts the longest admissible prefix (`Sampler.verify`) and the model's own next
token follows it, so one forward emits 1..gamma+1 tokens. KV of rejected positions is dropped
by not counting it (`num_computed`) and `BlockPool.truncate` releases the blocks allocated for
it; only full, verified blocks are ever committed. With nothing to propose the sequence decodes
normally. In a batch, rows share one query length (the longest proposal + 1): plain rows fill
the extra positions with filler whose K/V lies beyond their `num_computed` and is overwritten
before it is ever attended to, and whose logits are ignored. Since every row pays for the
longest proposal, a batch cuts its proposals to the length expected to emit the most tokens per
forward cost (`drafting.batch_keep`). A sequence decoding alone verifies its proposal
and up to `draft_branches` - 1 alternatives as one tree (`drafting.Tree`) where they pay for
their longer forward; a batch's row does where they fit in the filler it would be padded with
anyway. The tree's tokens go to the row's next slots, each at the position of its depth and
seeing only its ancestors; the accepted path's K/V is then moved to the slots of its positions
(`KvStore.move_slots`).
"""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple

import torch

from services.common import errors
from services.kvpool import attention
from services.kvpool.block_pool import BlockPool, PoolEvent, PoolExhausted
from services.kvpool.drafting import (
    BRANCHES,
    BatchTrust,
    Draft,
    LadderChoice,
    ServedCosts,
    Tree,
    batch_keep,
    default_ladder,
)
from services.kvpool.linear import PackedLinear, Packing, packed_layers
from services.kvpool.metrics import KvMetrics
from services.kvpool.paged_cache import ForwardPlan, KvStore, PagedCache
from services.kvpool.sampling import (
    NonFiniteLogits,
    Sampler,
    SamplingSpec,
    sample_batch,
    verify_batch,
)

log = logging.getLogger(__name__)


class FinishReason(Enum):
    EOS = "eos"
    LENGTH = "length"
    STOP = "stop"
    PREFILLED = "prefilled"


@dataclass(frozen=True)
class EngineRequest:
    """A validated request for the engine (generation, or a pure prefill when prefill_only)."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingSpec
    cache_salt: str = ""
    skip_prefix_cache: bool = False
    deadline: float | None = None  # time.monotonic() limit
    prefill_only: bool = False
    pin_ttl_seconds: float = 0.0
    # Expected continuation (e.g. a cached near-miss answer) to verify instead of generating
    # token by token; empty = no draft.
    draft_token_ids: tuple[int, ...] = ()


class TokenDelta(NamedTuple):
    token_ids: list[int]
    last: bool = False  # the sequence ends with these; its Finished follows at once


class Finished(NamedTuple):
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft_ms: float
    forward_passes: int
    computed_tokens: int
    pinned_blocks: int
    elapsed_ms: float
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    # Of draft_tokens_accepted: proposed from the sequence's own context (prompt lookup) while
    # the draft had nothing aligned, not from the draft itself.
    lookup_tokens_accepted: int = 0


class Failed(NamedTuple):
    error: Exception


STALL_AFTER_FAILURES = 3  # model steps failed in a row that make the engine read as stalled


class Phase(Enum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2


@dataclass
class Sequence:
    """Engine-side state of one request."""

    req: EngineRequest
    out: queue.Queue
    seq_id: str
    tokens: list[int]
    sampler: Sampler
    arrival: float
    phase: Phase = Phase.WAITING
    row: int = -1
    num_computed: int = 0
    stored_blocks: int = 0  # leading blocks already copied into the pool
    cached_tokens: int = 0
    computed_tokens: int = 0
    generated: int = 0
    forward_passes: int = 0
    first_token_at: float | None = None
    admitted_once: bool = False
    draft: Draft | None = None
    order: int = 0  # submission order: preemption takes the latest submitted
    queued: bool = False  # counted in Engine._queued (submitted, not yet admitted or ended)

    @property
    def prompt_len(self) -> int:
        return len(self.req.token_ids)


@dataclass(frozen=True)
class ModelInfo:
    """Shape facts of the served model."""

    model_id: str
    num_layers: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    max_context: int
    eos_token_ids: frozenset[int]


def sliding_window(cfg: Any) -> int | None:
    """The attention window of a model with sliding-window layers (Mistral, Gemma 3, Qwen 2
    with use_sliding_window, ...); None when every layer attends to the whole context."""
    window = getattr(cfg, "sliding_window", None)
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return None
    types = getattr(cfg, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def rope_switch(cfg: Any) -> int | None:
    """The context past which a longrope model (Phi-3 128k, Phi-3.5, ...) changes its rotary
    frequencies: transformers takes the long factors for a whole forward once any of its
    positions is past the original context, so a key's rotation depends on how far the forward
    that computed it reached. generate() from scratch and the engine (prefill chunks, cached
    prefixes) then give the same position different keys; within it nothing switches. None
    for every other rope (a dynamic one rescales only past max_position_embeddings)."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None)
    if not isinstance(params, dict) or not params:
        return None
    # One set, or one per layer type ({"full_attention": {...}, "sliding_attention": {...}}).
    sets = (list(params.values()) if all(isinstance(v, dict) for v in params.values())
            else [params])
    limits = [int(p.get("original_max_position_embeddings")
                  or getattr(cfg, "original_max_position_embeddings", 0) or 0)
              for p in sets if p.get("rope_type", p.get("type")) == "longrope"]
    limits = [n for n in limits if n > 0]
    return min(limits) if limits else None


def kv_shape(cfg: Any) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of a model's config: what its KV blocks hold per token.
    The config alone, so a pool's size can be judged before the weights load."""
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, getattr(cfg, "num_key_value_heads", heads), head_dim


def model_info(model: Any, model_id: str) -> ModelInfo:
    """Read the facts the engine needs from a HF causal LM.

    The context of a sliding-window model is its window: the paged cache gives every layer
    one causal mask over the whole context, which transformers takes as it is (it builds no
    window into a mask it is given), so past the window the answer would not be the model's.
    Within it the two masks are the same. A longrope model's is its original context
    (`rope_switch`), for the same reason."""
    cfg = model.config
    num_layers, kv_heads, head_dim = kv_shape(cfg)
    eos: Any = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = cfg.eos_token_id
    eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))
    max_context = cfg.max_position_embeddings
    for limit, why in ((sliding_window(cfg), "attends through a sliding window of %d tokens"),
                       (rope_switch(cfg), "switches its rotary frequencies (longrope) past %d "
                                          "tokens")):
        if limit is not None and limit < max_context:
            log.warning("%s " + why + ": serving contexts of at most %d tokens (not %d), where "
                        "the answer stays the model's", model_id, limit, limit, max_context)
            max_context = limit
    return ModelInfo(model_id, num_layers, kv_heads, head_dim, cfg.vocab_size, max_context,
                     eos_ids)


# Config attributes of architectures whose logits are more than lm_head(hidden states).
_LOGIT_POSTPROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                         "output_multiplier_scale")


class Head(NamedTuple):
    """The base model and its head, to compute float32 logits from the hidden states."""

    base: Any
    logits: Callable[[torch.Tensor], torch.Tensor]  # float32 hidden states -> float32 logits
    weight: torch.Tensor | None  # the float32 weight it multiplies by; None when packed


def fp32_head(model: Any) -> Head | None:
    """The base model and a float32 head (lm_head's own when it is float32 already, or packed
    for oneDNN by `linear.pack_linears`), to compute the logits from the hidden states; None
    for a model whose logits are not a plain `lm_head(hidden)` (those keep their own forward,
    with `.float()` on its logits).

    Two uses:
    - a half-precision model's logits are computed in float32. In bfloat16 the top logits often
      tie exactly (8 bits of mantissa), and batches, cached prefixes and draft verification
      (other matmul shapes) then break the tie differently: greedy answers would depend on
      them. Costs a float32 copy of lm_head's weight (a float32 model's is used as it is; a
      packed bfloat16 model's head is that copy already);
    - a batch whose rows verify drafts of different lengths computes logits only at the
      positions each row uses (`Engine._forward`'s `need`), not at every padded position.
    """
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if not isinstance(base, torch.nn.Module) or not isinstance(head, (torch.nn.Linear,
                                                                        PackedLinear)):
        return None
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, a, None) not in (None, 0, 1, 1.0) for a in _LOGIT_POSTPROCESSING):
        return None
    if isinstance(head, PackedLinear):  # float32: `pack_linears` packs every head so
        return Head(base, head, None)
    weight = head.weight.detach().float()
    bias = head.bias.detach().float() if head.bias is not None else None
    return Head(base, functools.partial(torch.nn.functional.linear, weight=weight, bias=bias),
                weight)


class EngineStats(NamedTuple):
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_pinned: int
    blocks_in_use: int
    running: int
    waiting: int
    prompt_tokens_total: int
    cached_tokens_total: int
    requests_total: int
    evictions_total: int
    preemptions_total: int
    draft_tokens_proposed_total: int = 0
    draft_tokens_accepted_total: int = 0
    draft_tokens_withheld_total: int = 0
    draft_tree_forwards_total: int = 0
    draft_tree_branch_wins_total: int = 0
    prefills_total: int = 0
    prefill_computed_tokens_total: int = 0


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is an allocation that failed: torch's OutOfMemoryError (a GPU), or the
    CPU allocator's RuntimeError."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    msg = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in msg
                                              or "can't allocate memory" in msg)


def device_done(device: torch.device) -> None:
    """Wait until `device` has run the work queued on it: CUDA kernels are launched
    asynchronously, so a clock read right after a forward there times the launches, not the
    forward. Nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release_cached_device_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def result_unless_late(fut: Future, timeout: float | None) -> Any:
    """The result of `fut` (an `Engine.call`), waited for up to `timeout` s. Not started by
    then, it is cancelled and FutureTimeout raised: left in the engine's inbox it would still
    run later, its effect (events taken, blocks dropped) unseen by a caller that gave up.
    Already running, it is waited for (quick once started) rather than abandoned."""
    try:
        return fut.result(timeout=timeout)
    except FutureTimeout:
        if fut.cancel():
            raise
        return fut.result()


class Engine:
    """Continuous-batching engine over a paged, ref-counted KV pool.

    Args:
        model: a HF causal LM (eval mode, on its device).
        info: model facts (see `model_info`).
        pool: the block pool bookkeeping (its block size is the store's).
        max_batch_size: running sequences (decoding + the prefilling one).
        max_prefill_chunk: tokens per prefill forward.
        max_waiting: waiting requests before new ones are refused.
        drafts: verify requests' draft tokens (False = ignore drafts, decode normally).
        max_draft_tokens: most draft tokens verified per sequence and forward (gamma's bound).
        preallocate_rows: allocate the working rows for the whole context now (peak memory at
            start, no 1.5x copy peak while growing later).
        metrics: Prometheus metrics (optional).
        threads: torch intra-op threads of the engine thread, set when it starts (0 = as
            torch has them). A replica process loads the model on its main thread with one
            thread and leaves OpenMP to the engine thread: see `services/kvpool/__main__.py`.
        one_thread_below: forwards of fewer new tokens than this run on one thread (0 = all on
            `threads`); see `KvPoolConfig.one_thread_below`.
        batch_gate: with several sequences decoding, cut proposals to what pays for the
            batch's longer forward (`drafting.batch_keep`; needs a measured `draft_ladder`).
        prompt_lookup: requests without draft tokens propose from their own context too (an
            empty `Draft`: prompt lookup only); with drafts on.
        draft_ladder: the drafts' proposal lengths (`drafting.choose_ladder`) and where they
            came from; None = the fixed `drafting.LADDER` (topped at max_draft_tokens).
        learn_costs: with a measured `draft_ladder`, time steps of one sequence and let what
            they cost replace the timing's figures (`drafting.ServedCosts`, `costs`).
        draft_branches: most branches of the tree a decoding sequence verifies
            (`drafting.Draft.alternatives`); 1 = its proposal alone.
    """

    def __init__(self, model: Any, info: ModelInfo, pool: BlockPool, *, max_batch_size: int = 8,
                 max_prefill_chunk: int = 512, max_waiting: int = 256,
                 prefix_caching: bool = True, drafts: bool = True, max_draft_tokens: int = 16,
                 preallocate_rows: bool = False, metrics: KvMetrics | None = None,
                 draft_ladder: LadderChoice | None = None, threads: int = 0,
                 one_thread_below: int = 0, batch_gate: bool = True,
                 prompt_lookup: bool = False, learn_costs: bool = True,
                 draft_branches: int = BRANCHES) -> None:
        if getattr(model.config, "_attn_implementation", None) == "sdpa":
            # SDPA with grouped-query heads kept grouped in multi-token forwards on CPU
            # (services/kvpool/attention.py); set on the model object itself.
            model.set_attn_implementation(attention.register())
        self.model = model
        self.info = info
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_prefill_chunk = max_prefill_chunk
        self.max_waiting = max_waiting
        self.prefix_caching = prefix_caching
        self.drafts = drafts
        self.max_draft_tokens = max_draft_tokens
        self.draft_branches = draft_branches
        self.threads = threads
        self.one_thread_below = one_thread_below
        self.batch_gate = batch_gate
        self.prompt_lookup = prompt_lookup
        self.learn_costs = learn_costs
        self._threads_now = 0  # what the engine thread runs with (set when it starts)
        # Proposal lengths, where they came from and the relative forward costs they were
        # chosen from (measured on this device by the replica on the engine thread, right after
        # `start` and before it serves; Stats reports it).
        self.draft_ladder = draft_ladder or LadderChoice(
            default_ladder(max_draft_tokens), "fixed: the engine was given no lengths")
        self.metrics = metrics
        param = next(model.parameters())
        self.device = param.device
        self.store = KvStore(num_layers=info.num_layers, kv_heads=info.kv_heads,
                             head_dim=info.head_dim, num_blocks=pool.num_blocks,
                             block_size=pool.block_size, max_rows=max_batch_size,
                             max_context=info.max_context, dtype=param.dtype, device=self.device)
        if preallocate_rows:
            self.store.ensure_capacity(info.max_context)
        self.cache = PagedCache(self.store)
        self._head = fp32_head(model)
        # The kernels of the model's linear layers, as the model has them (a replica that
        # loaded the model sets what `pack_linears` did, with why not; Stats reports it).
        packed = packed_layers(model)
        self.packing = Packing("onednn", packed) if packed else Packing("torch", 0, "not packed")
        self._inbox: queue.Queue = queue.Queue()
        # Ids whose cancel is in the inbox, not yet taken: a warm-up prefill cancelled during
        # its last forward checks this before pinning (set.add and discard are atomic).
        self._cancel_asked: set[str] = set()
        self._waiting: deque[Sequence] = deque()
        self._decoding: list[Sequence] = []  # row i holds _decoding[i]
        self._prefilling: Sequence | None = None  # holds row len(_decoding)
        self._by_id: dict[str, Sequence] = {}
        self._ids = itertools.count(1)
        self._queue_lock = threading.Lock()
        self._closed = False  # the loop has ended: submit and call refuse (Unavailable)
        self._queued = 0  # submitted and not yet admitted or ended (max_waiting)
        self._events: deque[PoolEvent] = deque()
        self._events_cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._turned_at = time.monotonic()  # when the last turn without an error ended
        self._looped_at = time.monotonic()  # when the last turn ended, failed or not
        self.prompt_tokens_total = 0
        self.cached_tokens_total = 0
        self.requests_total = 0
        # Warm-up prefills, apart: counted with requests, the replica's hit ratio and
        # request count drifted from what the orchestrator served.
        self.prefills_total = 0
        self.prefill_computed_tokens_total = 0
        self.preemptions_total = 0
        self.step_failures_total = 0  # engine steps that raised (their sequences failed)
        self.draft_tokens_proposed_total = 0
        self.draft_tokens_accepted_total = 0
        # Proposed tokens a batch's forward left out: not worth what they made every row pay.
        self.draft_tokens_withheld_total = 0
        self.draft_tree_forwards_total = 0
        self.draft_tree_branch_wins_total = 0
        # What batches' kept proposals verified against what the batch rule expected of them.
        self.batch_trust = BatchTrust()
        self._stats = self._compute_stats()

    # ---- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Engine:
        # Counted from now, not from construction: a replica loaded the model and built the
        # pool in between (seconds), and the engine reported that time as a stall until its
        # first turn. (It times draft forwards on this thread next, as one call.)
        self._turned_at = self._looped_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvpool-engine", daemon=True)
        self._thread.start()
        return self

    @property
    def running(self) -> bool:
        """True while the engine thread serves requests."""
        return self._thread is not None and self._thread.is_alive()

    def stalled_for(self) -> float:
        """Seconds since the engine loop last ended a turn without an error: about one step
        while busy, at most ~0.5 s while idle. Large only when one step (or a call run between
        steps) is stuck, or once model steps keep failing (`STALL_AFTER_FAILURES` in a row;
        idle turns between them do not count): either way the replica serves nobody."""
        return time.monotonic() - self._turned_at

    def stuck_for(self) -> float:
        """Seconds since the engine loop last ended a turn, whether it failed or not: about one
        step while busy, at most ~0.5 s while idle; large only while a step (or a call run
        between steps) does not return. Unlike `stalled_for`, failing steps do not count: they
        fail their requests (which fail over), and an idle replica has no step to succeed."""
        return time.monotonic() - self._looped_at

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake",))
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- API for handlers (any thread) ---------------------------------------------------

    def submit(self, req: EngineRequest) -> tuple[str, queue.Queue]:
        """Queue a request; returns (sequence id, output queue of TokenDelta/Finished/Failed).

        Raises:
            ResourceExhausted: the request can never fit the pool.
            Overloaded: too many requests are waiting (another replica may take it).
        """
        # The last generated token is emitted, never run through the model: its KV is not kept.
        kv_tokens = len(req.token_ids) + max(req.sampling.max_tokens - 1, 0)
        need = self.pool.blocks_needed(kv_tokens)
        if need > self.pool.num_blocks:
            if req.prefill_only:
                what, fits = "the prefix needs", ""
            else:
                # The figures said: "prompt + max_tokens" alone left a caller to guess which of
                # the two to cut, and by how much. (The orchestrator says when max_tokens was its
                # default, the client having set none.)
                n, m = len(req.token_ids), req.sampling.max_tokens
                what = f"prompt ({n} tokens) + sampling.max_tokens ({m}) need"
                fits = errors.pool_room(self.pool.num_blocks, self.pool.block_size, n)
            raise errors.ResourceExhausted(
                f"token_ids: {what} {need} KV blocks, the pool has {self.pool.num_blocks}{fits}")
        out: queue.Queue = queue.Queue()
        # Built before a waiting slot is taken: a failure here must not use one up for good.
        sampler = Sampler(req.sampling)
        draft = (Draft.of(list(req.draft_token_ids), top=self.max_draft_tokens,
                          ladder=self.draft_ladder.ladder,
                          cheap_guesses=self.draft_ladder.cheap_guesses, costs=self.costs(),
                          branches=self.draft_branches)
                 if self.drafts and (req.draft_token_ids or self.prompt_lookup)
                 and not req.prefill_only else None)
        with self._queue_lock:
            if self._closed:
                raise errors.Unavailable("replica is shutting down")
            # Counted here, not from the last step's stats: a burst arriving between two steps
            # must meet the limit too (every waiting stream holds a gRPC thread).
            if self._queued >= self.max_waiting:
                # Naming the limit and what to do: "too many waiting requests" left a direct
                # caller (and the orchestrator's log line) to guess which limit and whether
                # to send it again.
                raise errors.Overloaded(
                    f"replica busy: {self._queued} request{'s' * (self._queued != 1)} waiting "
                    f"for admission (max_waiting "
                    f"{self.max_waiting}); retry later or on another replica")
            self._queued += 1
            order = next(self._ids)
            seq = Sequence(req, out, f"{req.request_id or 'req'}#{order}", list(req.token_ids),
                           sampler, time.monotonic(), order=order, queued=True)
            seq.draft = draft
            # Under the lock that closes the engine: queued before the loop's last drain, or
            # refused (a request slipping in after it waited for an answer for good).
            self._inbox.put(("submit", seq))
        return seq.seq_id, out

    def _dequeue(self, seq: Sequence) -> None:
        """`seq` was admitted or ended: it no longer counts against max_waiting."""
        if seq.queued:
            seq.queued = False
            with self._queue_lock:
                self._queued -= 1

    def cancel(self, seq_id: str) -> None:
        """Stop a sequence and release its blocks (no-op if it already ended)."""
        self._cancel_asked.add(seq_id)
        self._inbox.put(("cancel", seq_id))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the engine thread (between steps) and return its future."""
        fut: Future = Future()
        with self._queue_lock:
            if self._closed:
                fut.set_exception(errors.Unavailable("replica is shutting down"))
            else:
                self._inbox.put(("call", fn, fut))
        return fut

    def flush_salt(self, cache_salt: str) -> tuple[int, int]:
        """Erase one tenant's cached KV (on the engine thread, through `call`): the pool drops
        its blocks (`BlockPool.flush_salt`), then what no running sequence holds is overwritten
        with zeros before this returns (on a GPU too: it waits for the fills), instead of
        staying until the next allocation writes there: every free block (those just dropped,
        the tenant's evicted before, a duplicate a commit swapped for its twin) and every
        working-row slot of no running sequence (an ended request's whole KV stays in its
        row). Blocks and rows in use keep theirs. Only what was written since it was last
        zeroed is filled (`KvStore` notes every write): the rest is zero already, and a fill
        of the whole pool and rows held every step (timings: services/kvpool/README.md, on
        `KvPool.Flush`). Returns (dropped, kept)."""
        flushed = self.pool.flush_salt(cache_salt)
        self.store.zero_blocks(self.pool.free_blocks())
        self.store.zero_unused_rows({s.row: s.num_computed for s in self._running()})
        device_done(self.device)
        return len(flushed.block_ids), flushed.kept

    def threads_for(self, tokens: int) -> int:
        """The torch threads a forward of `tokens` new tokens (all rows) runs with, on the
        engine thread once it started (before that, `threads` 0 means torch's count now)."""
        if tokens < self.one_thread_below:
            return 1
        return self.threads or torch.get_num_threads()

    def ladder(self) -> tuple[int, ...]:
        """The drafts' proposal lengths in use (() with drafts off)."""
        if not self.drafts:
            return ()
        return self.draft_ladder.ladder

    def stats(self) -> EngineStats:
        """Figures as of the last engine step."""
        return self._stats

    def take_events(self) -> list[PoolEvent]:
        """Pool events (stored/removed/cleared) since the last call, in order.

        Atomic: the publisher thread and a snapshot on the engine thread may both take events;
        each event goes to exactly one of them.
        """
        with self._events_cv:
            out, self._events = list(self._events), deque()
        return out

    def wait_events(self, timeout: float) -> bool:
        """Block until events are pending or `timeout` passes; True if any are pending."""
        with self._events_cv:
            if not self._events:
                self._events_cv.wait(timeout)
            return bool(self._events)

    # ---- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        if self.threads > 0:
            torch.set_num_threads(self.threads)
        self.threads = self._threads_now = torch.get_num_threads()
        failed_in_a_row = 0  # turns, for the back-off
        # Turns with model work that failed in a row: past STALL_AFTER_FAILURES the device is
        # taken for broken, and idle turns in between (requests a second apart) no longer
        # count as progress for the stall watch.
        work_failed = 0
        while not self._stop.is_set():
            busy = bool(self._waiting or self._decoding or self._prefilling)
            worked = False
            try:
                self._drain_inbox(block=not busy)
                self._expire()
                worked = bool(self._waiting or self._decoding or self._prefilling)
                self._step()
                failed_in_a_row = 0
                if worked:
                    work_failed = 0
                if work_failed < STALL_AFTER_FAILURES:
                    self._turned_at = time.monotonic()
            except Exception:  # noqa: BLE001 - the engine must survive a bad step
                failed_in_a_row += 1
                work_failed += worked
                if failed_in_a_row > 1:
                    # A step that fails again and again (a broken device) spun the thread at
                    # thousands of tracebacks a second: back off, up to 1 s between turns.
                    self._stop.wait(min(1.0, 0.01 * 2 ** (failed_in_a_row - 2)))
                # The engine thread has no request id of its own: name the sequences (each
                # id starts with its request id) so their clients' INTERNAL can be traced.
                log.exception("engine step failed; failing the running sequences: %s",
                              ", ".join(s.seq_id for s in self._running()) or "none")
                self.step_failures_total += 1
                if self.metrics is not None:
                    self.metrics.step_failures.inc()
                try:
                    self._fail_all_running(
                        errors.TierCacheError("internal error in the engine step"))
                except Exception:  # noqa: BLE001 - nor a failure while failing them
                    log.exception("failing the running sequences failed")
            try:
                self._publish_state()
            except Exception:  # noqa: BLE001 - a dead engine thread would hang every caller
                log.exception("publishing the engine's stats and events failed")
            self._looped_at = time.monotonic()
        with self._queue_lock:
            self._closed = True  # nothing is queued after the drain below
        self._drain_inbox(block=False)  # requests that raced with the stop get an answer too
        self._fail_everything(errors.Unavailable("replica is shutting down"))

    def _drain_inbox(self, block: bool) -> None:
        timeout = 0.5 if block else None
        while True:
            try:
                msg = self._inbox.get(block=block, timeout=timeout)
            except queue.Empty:
                return
            block = False
            kind = msg[0]
            if kind == "submit":
                seq = msg[1]
                self._by_id[seq.seq_id] = seq
                self._waiting.append(seq)
            elif kind == "cancel":
                self._cancel_asked.discard(msg[1])
                seq = self._by_id.get(msg[1])
                if seq is not None:
                    self._finish(seq, Failed(errors.Cancelled("request cancelled")))
            elif kind == "call":
                _, fn, fut = msg
                if not fut.set_running_or_notify_cancel():
                    # The caller gave up (cancelled): running it anyway could take something
                    # (a snapshot takes the pending events) and hand it to nobody.
                    continue
                try:
                    fut.set_result(fn())
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(exc)

    def _expire(self) -> None:
        now = time.monotonic()
        for seq in list(self._by_id.values()):
            if seq.req.deadline is not None and now >= seq.req.deadline:
                self._finish(seq, Failed(errors.DeadlineExceeded("deadline exceeded")))

    def _step(self) -> None:
        self._admit()
        if self._prefilling is not None:
            self._prefill_chunk(self._prefilling)
        if self._decoding:
            self._decode_step()

    def _admit(self) -> None:
        while (self._prefilling is None and self._waiting
               and len(self._decoding) < self.max_batch_size):
            seq = self._waiting[0]
            keep = 0 if seq.req.prefill_only else 1
            reuse = self.prefix_caching and not seq.req.skip_prefix_cache
            try:
                adm = self.pool.open(seq.seq_id, seq.tokens, seq.req.cache_salt,
                                     use_cache=reuse, keep_uncached=keep)
            except PoolExhausted as exc:
                # Warm-up pins yield first, as few as needed: a request that fits the pool was
                # refused for the pins' whole lifetime (up to an hour), or held the head of the
                # queue until every running answer ended, only to be refused then.
                if self.pool.release_pins(max(1, exc.short)):
                    continue
                if not self._decoding:
                    # Nothing running will free blocks. A preempted answer (part streamed)
                    # may still finish on another replica; a new request fits no replica of
                    # this size.
                    error = errors.Overloaded if seq.admitted_once else errors.ResourceExhausted
                    self._finish(seq, Failed(error(
                        f"KV pool exhausted: {exc} (more than the pool can free for it)")))
                    continue
                return  # wait for running sequences to finish
            except Exception:  # noqa: BLE001 - only this request fails, not every step
                # Left at the head of the queue it would fail the step again and again,
                # taking the running sequences with it each time.
                log.exception("admitting %s failed", seq.seq_id)
                self._finish(seq, Failed(errors.TierCacheError(
                    "internal error admitting the request")))
                continue
            self._waiting.popleft()
            # The prefilling sequence from here on, before any tensor work that may raise (an
            # allocation on a GPU): a failure then ends it with the others, releasing its blocks.
            seq.phase = Phase.PREFILL
            seq.row = len(self._decoding)
            self._prefilling = seq
            for src, dst in adm.copies:
                self.store.copy_block(src, dst)
            seq.num_computed = adm.cached_tokens
            seq.stored_blocks = adm.cached_tokens // self.pool.block_size
            try:
                self.store.ensure_capacity(len(seq.tokens))
            except RuntimeError as exc:  # OutOfMemoryError is one
                if not out_of_memory(exc):
                    raise
                # The working rows could not grow to this prompt (device memory, which runs
                # out far sooner on a GPU): only it fails, as busy, so the orchestrator tries
                # another replica. Raised from the step, it failed every running answer.
                log.warning("%s: no memory to grow the working rows to %d tokens (%s); "
                            "refused as busy", seq.seq_id, len(seq.tokens),
                            str(exc).splitlines()[0][:200])
                _release_cached_device_memory()
                self._finish(seq, Failed(errors.Overloaded(
                    f"device memory exhausted growing the working rows to {len(seq.tokens)} "
                    "tokens; another replica may take it (TIERCACHE_KVPOOL_PREALLOCATE_ROWS "
                    "reserves them at start)")))
                continue
            self.store.load_row(seq.row, self.pool.blocks_of(seq.seq_id), adm.cached_tokens)
            if not seq.admitted_once:
                seq.admitted_once = True
                self._dequeue(seq)
                seq.cached_tokens = adm.cached_tokens
                if not seq.req.prefill_only:  # a prefill counts when done (prefills_total)
                    self.prompt_tokens_total += seq.prompt_len
                    self.cached_tokens_total += adm.cached_tokens
                    if self.metrics:
                        self.metrics.prompt_tokens.inc(seq.prompt_len)
                        self.metrics.cached_tokens.inc(adm.cached_tokens)

    def _prefill_chunk(self, seq: Sequence) -> None:
        start = seq.num_computed
        # Equal chunks of at most max_prefill_chunk: with 512, 1,056 tokens as 352 x 3, not
        # 512 + 512 + 32 (every forward reads all the weights, so a small last chunk is dear).
        left = len(seq.tokens) - start
        end = start + -(-left // max(1, -(-left // self.max_prefill_chunk)))
        # The last chunk already verifies the first draft tokens.
        prop = self._proposal(seq) if end == len(seq.tokens) > start else []
        if end > start:
            t0 = time.perf_counter()
            ids = torch.tensor([seq.tokens[start:end] + prop], device=self.device)
            logits = self._forward(ids, ForwardPlan(seq.row, [start], end - start + len(prop)),
                                   keep=1 + len(prop))
            seq.num_computed = end
            seq.computed_tokens += end - start
            if self.metrics:
                # Nothing of a chunk before the last reaches the host: on a GPU the clock
                # read at once timed the kernels' launches (a fraction of the forward).
                device_done(self.device)
                self.metrics.step_seconds.labels("prefill").observe(time.perf_counter() - t0)
        else:
            logits = None
        # The first token goes out before the last chunk's blocks are copied into the pool (the
        # copy is all that caching adds to a miss's TTFT); they are committed before it, so a
        # sequence that ends with that token still leaves them cached.
        late = (self._commit_full_blocks(seq)
                if end == len(seq.tokens) and logits is not None and not prop
                and not seq.req.prefill_only else None)
        if late is None:
            self._store_full_blocks(seq)
        if seq.num_computed < len(seq.tokens):
            return
        self._prefilling = None
        if seq.req.prefill_only:
            self._finish_prefill(seq)
            return
        assert logits is not None, "a generating sequence always recomputes >= 1 token"
        if seq.generated:
            # A preempted answer recomputed: this forward emits its next token(s) as a decode
            # step would. Uncounted, forward_passes fell below completion - 1 - accepted and
            # the orchestrator counted the gap as passes that drafts saved.
            seq.forward_passes += 1
        seq.phase = Phase.DECODE
        self._decoding.append(seq)
        assert seq.row == len(self._decoding) - 1
        if prop:
            seq.num_computed += len(prop)
            try:
                a, tok = seq.sampler.verify(logits[0], prop)
            except NonFiniteLogits as exc:
                self._fail_numerics(seq, exc)
                return
            self._apply_verified(seq, prop, a, tok, count_pass=False)
        else:
            try:
                tok = sample_batch([seq.sampler], logits[:, -1])[0]
                if isinstance(tok, NonFiniteLogits):
                    self._fail_numerics(seq, tok)
                    return
                self._accept(seq, tok)
            finally:
                # Committed blocks are in the hash table already: their KV must be copied
                # even when sampling fails, or a later request would reuse stale KV.
                if late is not None:
                    self.store.store_blocks(*late)
            if seq.draft is not None and seq.seq_id in self._by_id:
                # A draft whose proposal was withdrawn (no room) moves past this token too.
                seq.draft.update(0, [tok])

    def _make_decode_room(self) -> None:
        # Every decoding sequence needs room for one more token; preempt the newest if short.
        for seq in list(self._decoding):
            if seq.phase is not Phase.DECODE:
                continue
            while True:
                try:
                    self.pool.ensure_capacity(seq.seq_id, seq.num_computed + 1)
                    break
                except PoolExhausted:
                    # The latest submitted waits (rows are swap-removed, so not the last row);
                    # if that is the prefilling sequence (it holds its whole prompt's blocks)
                    # it is preempted at once, a decoding answer only once warm-up pins have
                    # yielded.
                    running = [*self._decoding, *([self._prefilling] if self._prefilling
                                                  else [])]
                    victim = max(running, key=lambda s: s.order)
                    if victim is not self._prefilling:
                        if self.pool.release_pins(1):
                            log.info("released a warm-up pin for decoding sequence %s",
                                     seq.seq_id)
                            continue
                        if victim is seq and len(running) == 1:
                            self._finish(seq, Failed(errors.Overloaded(
                                "KV pool exhausted while decoding")))
                            break
                    self._preempt(victim)
                    if victim is seq:
                        break

    def _decode_step(self) -> None:
        self._make_decode_room()
        seqs = list(self._decoding)
        if not seqs:
            return
        props = [self._proposal(s) for s in seqs]
        rates = None  # each row's acceptance rate, where the batch rule cut by it
        if any(props) and len(seqs) > 1 and self.batch_gate and self.draft_ladder.measured:
            rates = [s.draft.pending_rate if p else 0.0 for s, p in zip(seqs, props, strict=True)]
            keep = batch_keep(self.costs(), [len(p) for p in props], rates,
                              self.batch_trust.factor)
            props = self._cut_proposals(seqs, props, keep, withheld=True)
        if len(seqs) == 1 and props[0]:
            tree = self._tree(seqs[0], props[0])
            if tree is not None:
                self._decode_tree(seqs[0], tree)
                return
        if any(props):
            self._decode_with_drafts(seqs, props, rates)
            return
        t0 = time.perf_counter()
        ids = torch.tensor([[s.tokens[s.num_computed]] for s in seqs], device=self.device)
        plan = ForwardPlan(0, [s.num_computed for s in seqs], 1)
        logits = self._forward(ids, plan)[:, -1]
        for s in seqs:
            s.num_computed += 1
            s.computed_tokens += 1
            s.forward_passes += 1
        toks = sample_batch([s.sampler for s in seqs], logits)
        for s, tok in zip(seqs, toks, strict=True):
            if isinstance(tok, NonFiniteLogits):
                self._fail_numerics(s, tok)  # its new KV is not committed either
                continue
            self._store_full_blocks(s)
            self._accept(s, tok)
            if s.draft is not None and s.seq_id in self._by_id:
                s.draft.update(0, [tok])
        self._step_done(seqs, 1, t0)

    def _decode_with_drafts(self, seqs: list[Sequence], props: list[list[int]],
                            rates: list[float] | None = None) -> None:
        """One forward for the batch: each row its last token plus its proposal (maybe none),
        or a tree where the proposal's alternatives fit in what pads it to the longest row.
        `rates`: the rows' acceptance rates the batch rule cut the proposals by; what the
        proposals it kept verified is weighed against what it expected (`BatchTrust`)."""
        t0 = time.perf_counter()
        # Every row is as long as the longest proposal; shorter ones are padded with filler
        # positions, which must stay inside the context (the working rows are sized to it, and
        # position ids past it are outside the model's range): trim proposals that would not.
        room = min(self.info.max_context - s.num_computed for s in seqs) - 1
        props = self._cut_proposals(seqs, props, room)
        q = 1 + max(len(p) for p in props)
        # What the rule expects of the proposals as verified (after the cut to the context).
        expected = (None if rates is None
                    else sum(r * len(p) for r, p in zip(rates, props, strict=True)))
        # The padding costs the forward as much as draft tokens would: alternatives fill it.
        trees = [self._tree(s, p, room=q - 1 - len(p)) if p and len(p) < q - 1 else None
                 for s, p in zip(seqs, props, strict=True)]
        drafted = [p if t is None else list(t.tokens) for p, t in zip(props, trees, strict=True)]
        starts = [s.num_computed for s in seqs]
        rows = []
        for s, d in zip(seqs, drafted, strict=True):
            last = s.tokens[s.num_computed]
            rows.append([last] + d + [last] * (q - 1 - len(d)))  # filler, see module docstring
        ids = torch.tensor(rows, device=self.device)
        plan = ForwardPlan(0, starts, q)
        if any(t is not None for t in trees):
            layouts = [_row_layout(t, q) for t in trees]
            plan.depths, plan.visible = [d for d, _ in layouts], [v for _, v in layouts]
        # Logits only where a row has a draft token to check (a row without one: its first).
        need = [1 + len(d) for d in drafted]
        logits = self._forward(ids, plan, keep=q, need=need)
        results = _verify_rows(seqs, props, trees, logits, need)
        for s, d in zip(seqs, drafted, strict=True):
            # Everything just written counts until verified, so a row moved while an earlier
            # sequence finishes keeps it (`_apply_verified` then drops the rejected part).
            s.num_computed += 1 + len(d)
        if expected is not None:
            self.batch_trust.observe(expected, sum(
                len(r[0]) if isinstance(r[0], list) else r[0]
                for r in results if not isinstance(r, NonFiniteLogits)))
        for i, s in enumerate(seqs):
            r = results[i]
            if isinstance(r, NonFiniteLogits):
                self._fail_numerics(s, r)
                continue
            tree = trees[i]
            if tree is None:
                a, tok = r
                self._apply_verified(s, props[i], a, tok, count_pass=True)
            else:
                path, tok = r
                self._apply_tree(s, tree, starts[i], path, tok)
        self._step_done(seqs, q, t0)

    def _tree(self, seq: Sequence, prop: list[int], room: int | None = None) -> Tree | None:
        """The tree to verify instead of `prop` alone (the sequence's pending proposal), or
        None: only with alternatives to add. `room`: a batch's row, padded by `room` tokens
        anyway (`Draft.alternatives`); else the only decoding sequence. Pool blocks are
        reserved for its deepest branch (what can be accepted); without room, None."""
        d = seq.draft
        if self.draft_branches <= 1 or d is None:
            return None
        limit = self._draft_limit(seq)
        if room is not None:
            limit = min(limit, len(prop) + room)
        alts = d.alternatives(seq.tokens, limit, room)
        if not alts:
            return None
        tree = Tree.of([d.branch(), *alts])
        if len(seq.tokens) + tree.size >= self.info.max_context:
            return None  # its slots would run past the rows' context (its positions do not)
        try:
            self.pool.ensure_capacity(seq.seq_id, len(seq.tokens) + max(tree.depths))
        except PoolExhausted:
            return None  # the proposal alone fits (reserved by `_proposal`)
        return tree

    def _decode_tree(self, seq: Sequence, tree: Tree) -> None:
        """One forward verifying `tree` after the sequence's last token: the path the model's
        choices follow is accepted, then the model's own token (`Sampler.verify_tree`)."""
        t0 = time.perf_counter()
        n, start = tree.size, seq.num_computed
        ids = torch.tensor([[seq.tokens[start], *tree.tokens]], device=self.device)
        depths, visible = _row_layout(tree, n + 1)
        plan = ForwardPlan(seq.row, [start], n + 1, depths=[depths], visible=[visible])
        logits = self._forward(ids, plan, keep=n + 1)[0]
        seq.num_computed += 1 + n  # until `_apply_verified` keeps what verified
        try:
            path, tok = seq.sampler.verify_tree(logits, tree)
        except NonFiniteLogits as exc:
            self._fail_numerics(seq, exc)
            return
        self._apply_tree(seq, tree, start, path, tok)
        self._step_done([seq], n + 1, t0)

    def _apply_tree(self, seq: Sequence, tree: Tree, start: int, path: list[int], tok: int
                    ) -> None:
        """`tree`, written to the sequence's row from slot `start` (its root there), verified
        along `path`, the model's token `tok` after it: emit and roll back as
        `_apply_verified`, the draft following the branch that held the path."""
        # The path's K/V to the slots of its positions: node i was written at slot start+1+i.
        moves = [(start + 1 + i, start + 1 + k) for k, i in enumerate(path) if i != k]
        self.store.move_slots(seq.row, [a for a, _ in moves], [b for _, b in moves])
        assert seq.draft is not None
        b = seq.draft.follow(tree, path)
        self.draft_tree_forwards_total += 1
        self.draft_tree_branch_wins_total += b > 0
        if self.metrics:
            self.metrics.draft_tree_forwards.inc()
            if b:
                self.metrics.draft_tree_branch_wins.inc()
        self._apply_verified(seq, tree.branches[b].tokens, len(path), tok, count_pass=True,
                             proposed=tree.size)

    def _step_done(self, seqs: list[Sequence], q: int, t0: float) -> None:
        """A decode step of `seqs`, q tokens per row, begun at perf_counter `t0`, is over: its
        metrics, and what it cost if it had one sequence (`ServedCosts`). Its results reached
        the host (tokens were sampled), so on a GPU too the time is the step's."""
        dt = time.perf_counter() - t0
        if self.served_costs is not None and len(seqs) == 1:
            self.served_costs.observe(q, dt)
        if self.metrics:
            self.metrics.step_seconds.labels("decode").observe(dt)
            self.metrics.batch_size.observe(len(seqs))

    @property
    def draft_ladder(self) -> LadderChoice:
        """The drafts' proposal lengths and the timing they were chosen from; setting one
        starts learning served costs afresh over its timing (when measured)."""
        return self._draft_ladder

    @draft_ladder.setter
    def draft_ladder(self, ladder: LadderChoice) -> None:
        self._draft_ladder = ladder
        self.served_costs = (ServedCosts(ladder.costs) if ladder.measured and self.learn_costs
                             else None)

    def costs(self) -> tuple[float, ...]:
        """Relative costs of a forward of 1.. tokens per row, as decisions by cost read them:
        learned from served steps over the measured timing (`ServedCosts`), or the timing; ()
        when the ladder was not measured (decisions by cost are off)."""
        if self.served_costs is not None:
            return self.served_costs.now
        return self.draft_ladder.costs if self.draft_ladder.measured else ()

    def _cut_proposals(self, seqs: list[Sequence], props: list[list[int]], n: int,
                       withheld: bool = False) -> list[list[int]]:
        """`props` with every proposal cut to at most `n` tokens (0 = withdrawn), the pool
        blocks reserved for the cut tokens given back. `withheld`: the cut is the batch's
        choice (`batch_keep`), counted as withheld draft tokens."""
        if max(len(p) for p in props) <= n:
            return props
        cut = []
        for s, p in zip(seqs, props, strict=True):
            if len(p) > n and s.draft is not None:
                if withheld:
                    gone = len(p) - max(n, 0)
                    self.draft_tokens_withheld_total += gone
                    if self.metrics:
                        self.metrics.draft_withheld.inc(gone)
                p = s.draft.trim(n)
                self.pool.truncate(s.seq_id, len(s.tokens) + len(p))  # the reserved rest
            cut.append(p)
        return cut

    def _proposal(self, seq: Sequence) -> list[int]:
        """The draft tokens to verify in this sequence's next forward (often none).

        Pool blocks for them are reserved here; `_apply_verified` gives back what was rejected.
        """
        d = seq.draft
        if d is None or seq.req.prefill_only:
            return []
        prop = d.propose(seq.tokens, self._draft_limit(seq))
        if not prop:
            return []
        try:
            self.pool.ensure_capacity(seq.seq_id, len(seq.tokens) + len(prop))
        except PoolExhausted:
            d.withdraw()
            return []  # no room for speculation now; decode normally
        try:
            self.store.ensure_capacity(len(seq.tokens) + len(prop))
        except RuntimeError as exc:  # OutOfMemoryError is one
            if not out_of_memory(exc):
                raise
            # No memory to grow the rows for the proposal: decode normally, as with no
            # blocks for it (raised, it failed every running answer).
            self.pool.truncate(seq.seq_id, len(seq.tokens))
            d.withdraw()
            _release_cached_device_memory()
            return []
        return prop

    def _draft_limit(self, seq: Sequence) -> int:
        """Most draft tokens the sequence's next forward may verify after its last token."""
        return min(self.max_draft_tokens, seq.req.sampling.max_tokens - seq.generated - 1,
                   self.info.max_context - len(seq.tokens) - 1)

    def _apply_verified(self, seq: Sequence, prop: list[int], accepted: int, tok: int,
                        count_pass: bool, proposed: int | None = None) -> None:
        """Emit the accepted draft tokens and the model's token; roll back the rest.
        `proposed`: the draft tokens the forward verified, where a tree verified more than
        `prop` (the branch followed)."""
        valid = len(seq.tokens) + accepted  # KV computed and verified after this forward
        proposed = len(prop) if proposed is None else proposed
        if count_pass:
            seq.forward_passes += 1
            seq.computed_tokens += 1 + proposed
        else:
            seq.computed_tokens += proposed
        # Accepted draft tokens the answer really uses: a stop, EOS or the length limit among
        # them ends it there (and the model's own token is not emitted).
        used = accepted
        for i, t in enumerate(prop[:accepted]):
            if self._stop_reason(seq, t, seq.generated + i + 1, len(seq.tokens) + i + 1):
                used = i + 1
                break
        if prop:
            self.draft_tokens_proposed_total += proposed
            self.draft_tokens_accepted_total += used
            if self.metrics:
                self.metrics.draft_proposed.inc(proposed)
                self.metrics.draft_accepted.inc(used)
        emitted = prop[:accepted] + [tok]
        if seq.draft is not None:
            seq.draft.record(accepted, used, proposed)
        seq.num_computed = valid
        if prop:
            self.pool.truncate(seq.seq_id, valid)
        # Commit verified blocks before emitting: emitting may finish the sequence.
        self._store_full_blocks(seq, seq.tokens + prop[:accepted])
        for t in emitted:
            self._accept(seq, t)
            if seq.seq_id not in self._by_id:
                return  # finished (EOS, stop, length): the pool already released everything
        if seq.draft is not None:
            seq.draft.advance(emitted)

    def _forward(self, ids: torch.Tensor, plan: ForwardPlan, keep: int = 1,
                 need: list[int] | None = None) -> torch.Tensor:
        """Logits in float32: of the last `keep` positions of each row ([B, keep, vocab]); or,
        given `need` (a count per row, keep = the plan's q_len), of the first need[b] positions
        of row b only, rows in order ([sum(need), vocab]). With drafts of different lengths in
        one batch, that spares the padded positions' logits (at batch 64 and 16 draft tokens,
        about 200 MB of float32 per step for a 49k vocabulary) — for models with a plain head
        (`fp32_head`); one whose logits are post-processed computes them all, then selects."""
        assert need is None or (keep == plan.q_len and len(need) == plan.batch)
        n = self.threads_for(plan.batch * plan.q_len)
        if n != self._threads_now:
            torch.set_num_threads(n)
            self._threads_now = n
        self.cache.begin(plan)
        kw = dict(input_ids=ids, cache=self.cache, position_ids=self.cache.position_ids(),
                  attention_mask=self.cache.attention_mask(), use_cache=True)
        with torch.inference_mode():
            if self._head is None:
                logits = self.model(**kw, logits_to_keep=keep).logits.float()
                return logits if need is None else torch.cat(
                    [logits[b, :n] for b, n in enumerate(need)])
            hidden = self._head.base(**kw).last_hidden_state
            if need is None:
                hidden = hidden[:, -keep:, :]
            else:
                q = plan.q_len
                at = torch.tensor([b * q + t for b, n in enumerate(need) for t in range(n)],
                                  device=hidden.device)
                hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, at)
            return self._head.logits(hidden.float())

    def _store_full_blocks(self, seq: Sequence, tokens: list[int] | None = None) -> None:
        late = self._commit_full_blocks(seq, tokens)
        if late is not None:
            self.store.store_blocks(*late)

    def _commit_full_blocks(self, seq: Sequence, tokens: list[int] | None = None
                            ) -> tuple[int, list[int], int] | None:
        """Commit the sequence's newly filled blocks; returns the copy (row, block ids, first
        block) that must follow before this thread does anything else, or None."""
        if not self.prefix_caching:
            return None
        bs = self.pool.block_size
        full = seq.num_computed // bs
        if full <= seq.stored_blocks:
            return None
        # The table before the commit: blocks that it swaps for an identical block already in
        # the pool are freed (copying into them is harmless), shared ones are never written.
        table = self.pool.blocks_of(seq.seq_id)
        copy = (seq.row, table[seq.stored_blocks:full], seq.stored_blocks)
        seq.stored_blocks = full
        self.pool.commit(seq.seq_id, seq.tokens if tokens is None else tokens, seq.num_computed)
        return copy

    def _accept(self, seq: Sequence, tok: int) -> None:
        """Append a sampled token, stream it, and finish the sequence if it should stop."""
        now = time.monotonic()
        if seq.first_token_at is None:
            seq.first_token_at = now
            if self.metrics:
                self.metrics.ttft_seconds.observe(now - seq.arrival)
        seq.tokens.append(tok)
        seq.generated += 1
        reason = self._stop_reason(seq, tok, seq.generated, len(seq.tokens))
        # The server sends a last token together with the final message, so no reader can see
        # the end of an answer without knowing that it ended (and resume it elsewhere).
        seq.out.put(TokenDelta([tok], reason is not None))
        if reason is not None:
            self._finish(seq, self._final(seq, reason, 0))

    def _stop_reason(self, seq: Sequence, tok: int, generated: int, length: int
                     ) -> FinishReason | None:
        """Why a sequence ends with `tok` as its `generated`-th token (None: it goes on)."""
        sp = seq.req.sampling
        if tok in self.info.eos_token_ids and not sp.ignore_eos:
            return FinishReason.EOS
        if tok in sp.stop_token_ids:
            return FinishReason.STOP
        if generated >= sp.max_tokens or length >= self.info.max_context:
            return FinishReason.LENGTH
        return None

    def _finish_prefill(self, seq: Sequence) -> None:
        table = self.pool.blocks_of(seq.seq_id)
        full = seq.num_computed // self.pool.block_size
        pinned = 0
        if seq.req.pin_ttl_seconds > 0:
            # A Warm cancelled (or past its deadline) during its last forward, seen only at the
            # next turn, still pinned its blocks for the whole TTL against the tenant's quota,
            # its caller told CANCELLED: ended as such instead (the blocks stay cached).
            if seq.seq_id in self._cancel_asked:
                self._finish(seq, Failed(errors.Cancelled("request cancelled")))
                return
            if seq.req.deadline is not None and time.monotonic() >= seq.req.deadline:
                self._finish(seq, Failed(errors.DeadlineExceeded("deadline exceeded")))
                return
            try:
                pinned = self.pool.pin(table[:full], seq.req.pin_ttl_seconds)
            except PoolExhausted as exc:  # computed and cached, but not pinned
                # What was done is said: the error alone read as "nothing computed".
                # The figures also go out as trailers, for the Warm result's fields.
                self._finish(seq, Failed(errors.PinRefused(
                    f"pin refused: {exc} (the prompt is computed and cached: "
                    f"{seq.computed_tokens} of its {seq.prompt_len} tokens computed now, "
                    f"{full} blocks cached, none pinned)",
                    seq.prompt_len, seq.cached_tokens, seq.computed_tokens)))
                return
        self._finish(seq, self._final(seq, FinishReason.PREFILLED, pinned))

    def _final(self, seq: Sequence, reason: FinishReason, pinned: int) -> Finished:
        now = time.monotonic()
        ttft = ((seq.first_token_at or now) - seq.arrival) * 1000.0
        d = seq.draft
        return Finished(reason, seq.prompt_len, seq.generated, seq.cached_tokens, ttft,
                        seq.forward_passes, seq.computed_tokens, pinned,
                        (now - seq.arrival) * 1000.0, d.proposed if d else 0,
                        d.accepted if d else 0, d.accepted_lookup if d else 0)

    def _count_prefilled(self, computed: int) -> None:
        self.prefill_computed_tokens_total += computed
        if self.metrics:
            self.metrics.prefill_computed_tokens.inc(computed)

    def _preempt(self, seq: Sequence) -> None:
        """Release a decoding sequence's blocks; it is recomputed (mostly from cache) later."""
        log.info("preempting %s to free KV blocks", seq.seq_id)
        try:
            self._remove_from_rows(seq)
        finally:  # out of the rows whatever the row copies did: waiting, recomputed later
            self.pool.close(seq.seq_id)
            seq.phase, seq.row, seq.num_computed, seq.stored_blocks = Phase.WAITING, -1, 0, 0
            self._waiting.appendleft(seq)
        self.preemptions_total += 1
        if self.metrics:
            self.metrics.preemptions.inc()

    def _remove_from_rows(self, seq: Sequence) -> None:
        """Take `seq` out of the rows; the last decoding row (and the prefilling one) move
        down. The bookkeeping is done before any row's KV is copied: a copy that raises (a
        device error) leaves every sequence in exactly one place, for the step-failure
        handler to fail, instead of one in no row and never stepped, and one stepped that no
        one answers."""
        moves = []
        if seq.phase is Phase.DECODE:
            i = self._decoding.index(seq)
            last = self._decoding.pop()
            if last is not seq:
                moves.append((last.row, i, last.num_computed))
                last.row = i
                self._decoding[i] = last
            if self._prefilling is not None:
                p = self._prefilling
                moves.append((p.row, len(self._decoding), p.num_computed))
                p.row = len(self._decoding)
        elif seq.phase is Phase.PREFILL and self._prefilling is seq:
            self._prefilling = None
        for src, dst, n in moves:
            self.store.move_row(src, dst, n)

    def _finish(self, seq: Sequence, result: Finished | Failed) -> None:
        self._dequeue(seq)
        if self._by_id.pop(seq.seq_id, None) is None:
            return
        try:
            if seq.phase is Phase.WAITING:
                self._waiting.remove(seq)
            else:
                self._remove_from_rows(seq)
        finally:  # a row copy that raised still ends this sequence and frees its blocks
            self.pool.close(seq.seq_id)
            seq.phase = Phase.WAITING
            if isinstance(result, Finished):  # completed: not cancelled, timed out or refused
                if seq.req.prefill_only:
                    self.prefills_total += 1
                    if self.metrics:
                        self.metrics.prefills.inc()
                    self._count_prefilled(result.computed_tokens)
                else:
                    self.requests_total += 1
            elif isinstance(result, Failed) and isinstance(result.error, errors.PinRefused):
                # Computed and cached all the same, only not pinned: its tokens count.
                self._count_prefilled(result.error.work[2])
            # Stats first, so a caller who sees the result also sees its blocks released.
            self._stats = self._compute_stats()
            seq.out.put(result)

    def _fail_numerics(self, seq: Sequence, exc: NonFiniteLogits) -> None:
        """NaN/inf logits end this sequence only (INTERNAL); the rest of its batch goes on.

        Its KV (inf/NaN) stays in the working rows past where later sequences write: a
        batched forward reads every row up to the batch's longest, and a masked position
        still adds NaN to its scores (NaN + -inf) and multiplies 0 by it, so a later, shorter
        request on that row failed too. Non-finite values are zeroed in every row (finite
        ones are untouched, and a live row holding any is failing itself); the row the
        sequence sits on now may not be the one it wrote, after a row move."""
        log.warning("%s: %s", seq.seq_id, exc)
        self.store.rows.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        self._finish(seq, Failed(errors.TierCacheError(str(exc))))

    def _running(self) -> list[Sequence]:
        """The sequences holding a row: decoding, and the one prefilling."""
        return list(self._decoding) + ([self._prefilling] if self._prefilling else [])

    def _fail_all_running(self, exc: Exception) -> None:
        self._fail_each(self._running(), exc)

    def _fail_everything(self, exc: Exception) -> None:
        self._fail_each(list(self._by_id.values()), exc)

    def _fail_each(self, seqs: list[Sequence], exc: Exception) -> None:
        """Fails every one of `seqs`, whatever failing one raises: a row copy that raised
        while one left its row stopped the loop, and the others decoded on, one of them on a
        row whose KV was never copied in, and finished as if all were well."""
        for seq in seqs:
            try:
                self._finish(seq, Failed(exc))
            except Exception:  # noqa: BLE001 - answered already (_finish's finally)
                log.exception("failing %s raised; the others are failed all the same",
                              seq.seq_id)

    def _publish_state(self) -> None:
        events = self.pool.take_events()
        if events:
            with self._events_cv:
                self._events.extend(events)
                self._events_cv.notify_all()
        self._stats = self._compute_stats()
        if self.metrics:
            self.metrics.observe(self._stats)

    def _compute_stats(self) -> EngineStats:
        p = self.pool.stats()
        return EngineStats(p.total, p.free, p.cached, p.pinned, p.in_use,
                           len(self._decoding) + (self._prefilling is not None),
                           len(self._waiting), self.prompt_tokens_total,
                           self.cached_tokens_total, self.requests_total,
                           self.pool.evictions_total, self.preemptions_total,
                           self.draft_tokens_proposed_total, self.draft_tokens_accepted_total,
                           self.draft_tokens_withheld_total, self.draft_tree_forwards_total,
                           self.draft_tree_branch_wins_total, self.prefills_total,
                           self.prefill_computed_tokens_total)

    # ---- test hooks -----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Pool integrity, the KV store's (what erasure relies on) plus: every pool table
        belongs to a live sequence (engine thread)."""
        self.pool.check_integrity()
        self.store.check_integrity()
        live = {s.seq_id for s in self._decoding}
        if self._prefilling is not None:
            live.add(self._prefilling.seq_id)
        for sid in list(self.pool._seqs):  # noqa: SLF001 - integrity check reads internals
            assert sid in live, f"pool holds a table for dead sequence {sid}"
        for i, s in enumerate(self._decoding):
            assert s.row == i
            # Between steps a sequence holds blocks for its computed tokens only: the blocks
            # of rejected draft tokens were given back (`truncate`) in the step that
            # rejected them, not at its next step or its end.
            t = self.pool._seqs.get(s.seq_id)  # noqa: SLF001 - as above
            if t is not None:
                keep = max(self.pool.blocks_needed(s.num_computed), t.committed)
                assert len(t.blocks) <= keep, (
                    f"sequence {s.seq_id} holds {len(t.blocks)} blocks for {s.num_computed} "
                    f"computed tokens ({keep} needed)")


def _row_layout(tree: Tree | None, q: int) -> tuple[tuple[int, ...], list[list[bool]]]:
    """A forward row of `q` tokens (`ForwardPlan.depths`, `visible`): its last token (the
    root) and `tree`'s nodes, each at its depth seeing its ancestors, then filler tokens
    that see only themselves; without a tree, q tokens in order, each seeing those before."""
    if tree is None:
        return tuple(range(q)), [[j <= t for j in range(q)] for t in range(q)]
    n = tree.size + 1
    assert n <= q
    vis = [row + [False] * (q - n) for row in tree.visible()]
    vis += [[j == t for j in range(q)] for t in range(n, q)]
    return (0, *tree.depths, *range(n, q)), vis


def _verify_rows(seqs: list[Sequence], props: list[list[int]], trees: list[Tree | None],
                 logits: torch.Tensor, need: list[int]
                 ) -> list[tuple[int, int] | tuple[list[int], int] | NonFiniteLogits]:
    """Each row's verdict on a batch's forward (`logits`: need[b] rows of row b, in order):
    (accepted, next token) for a proposal (`verify_batch`, together), (path, next token) for
    a tree (`Sampler.verify_tree`), or the NonFiniteLogits that fails the row alone."""
    out: list[Any] = [None] * len(seqs)
    offsets = list(itertools.accumulate(need, initial=0))  # row b: offsets[b]..offsets[b + 1]
    plain = [b for b, t in enumerate(trees) if t is None]
    if plain:
        sub = logits
        if len(plain) < len(seqs):
            rows = [r for b in plain for r in range(offsets[b], offsets[b + 1])]
            sub = logits.index_select(0, torch.tensor(rows, device=logits.device))
        verdicts = verify_batch([seqs[b].sampler for b in plain], sub, [props[b] for b in plain])
        for b, v in zip(plain, verdicts, strict=True):
            out[b] = v
    for b, tree in enumerate(trees):
        if tree is not None:
            try:
                out[b] = seqs[b].sampler.verify_tree(logits[offsets[b]:offsets[b + 1]], tree)
            except NonFiniteLogits as exc:
                out[b] = exc
    return out
