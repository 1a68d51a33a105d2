"""Configuration of a kvpool replica (`TIERCACHE_KVPOOL_<FIELD>` or `--field-name`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from services.common.config import (
    announce_problem,
    moved,
    require,
    require_addresses,
    require_listen_address,
    require_model_id,
    require_shard_list,
)
from services.common.errors import blank
from services.common.model_store import MODEL_SPEC_RULE

SERVICE = "kvpool"
LINEAR_KERNELS = ("onednn", "torch")  # see `KvPoolConfig.linear_kernels`
# Bounds past any real pool or host: beyond them the pool's bookkeeping list alone grew
# until the OOM killer, and a thread count overflowed inside torch on the engine thread.
MAX_BLOCKS = 1 << 22
MAX_THREADS = 1024
# A multi-token forward timed under this share of a 1-token one: noise. On oneDNN kernels a
# forward of 2-6 tokens costs about what one token's does: 0.94x on a quiet host
# (`python -m benchmarks.linear`) and 0.84x at one replica's start beside the other services,
# where the former bar, 0.85, refused a plausible timing and left the worst fixed ladder.
IMPLAUSIBLE = 0.7
_DECIMAL = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")


@dataclass(frozen=True)
class KvPoolConfig:
    """Settings of one kvpool replica.

    The pool is sized either in blocks (`num_blocks` > 0) or in bytes (`kv_cache_bytes`, used when
    `num_blocks` is 0); a block holds `block_size` tokens of K and V for every layer.
    """

    # "smollm2" (the packaged model, converted once) or the path of a local HF model folder.
    model: str = "smollm2"
    # Served model id; empty = derived from the model (SmolLM2-135M-Instruct or the folder name).
    model_id: str = ""
    # Where converted models are cached; empty = $TIERCACHE_CACHE_DIR or ~/.cache/tiercache.
    cache_dir: str = ""
    # "cpu" or "cuda[:N]".
    device: str = "cpu"
    # float32, float16 or bfloat16 (weights and KV).
    dtype: str = "float32"
    # KV blocks in the pool; 0 = as many as kv_cache_bytes holds.
    num_blocks: int = 0
    # Pool size in bytes when num_blocks is 0 (docs/capacity.md: bytes per block). One that
    # holds no block of the model is refused at start, from its config.json, before it loads.
    kv_cache_bytes: int = 512 * 1024 * 1024
    # Tokens per KV block (the same on every replica, the index and orchestrators).
    block_size: int = 16
    # Sequences decoded together in one forward (running = prefilling + decoding).
    max_batch_size: int = 8
    # Prompt tokens computed per forward of one sequence (bounds decode stalls).
    max_prefill_chunk: int = 512
    # Largest max_tokens a request may ask for (INVALID_ARGUMENT past it). Orchestrators'
    # max_tokens_limit must not exceed it (they do not learn it from the replicas).
    max_new_tokens_limit: int = 2048
    # Requests allowed to wait for admission before new ones are refused.
    max_waiting: int = 256
    # This replica's name in the index, Stats and CacheReport.
    replica_id: str = "kvpool-0"
    # host:port the replica listens on (0 = any free port).
    address: str = "127.0.0.1:50054"
    # Address other services dial for this replica; empty = `address` (with a prefix index,
    # needed when `address` has port 0: the index refuses to be told port 0).
    advertise_address: str = ""
    # Prometheus /metrics and /healthz port; -1 = off, 0 = any free port.
    metrics_port: int = 9104
    # Credential callers must send, and sent to the index; "" = none.
    internal_token: str = ""
    # host:port of the prefix index, or its shards comma-separated; empty = do not publish.
    prefix_address: str = ""
    # How often the replica renews its lease at the index (>= 0.1).
    heartbeat_seconds: float = 2.0
    # Events are published at least this often (seconds) while there are any.
    publish_interval_seconds: float = 0.2
    # False = no prefix reuse and nothing cached (every block is freed at the end); for
    # measuring what caching costs.
    prefix_caching: bool = True
    # Verify requests' draft tokens (cache-assisted generation); False = ignore drafts.
    drafts: bool = True
    # Most draft tokens of one proposal verified in one forward (the bound of the adaptive
    # gamma). A tree (draft_branches) adds alternatives, each within this bound, in the same
    # forward: alone, a sequence's forward may verify up to draft_branches x this many (less
    # what the branches share); in a batch only within the padding its row has anyway.
    max_draft_tokens: int = 16
    # Draft proposal lengths: "auto" = chosen at start from forwards of 1..max_draft_tokens+1
    # tokens timed on this device (15-20 s on a quiet 2-core CPU, longer while other processes
    # keep it busy: disturbed timings are dropped; services/kvpool/calibrate.py), or from
    # draft_costs untimed; or three ascending lengths "a,b,c" in 1..max_draft_tokens (after a
    # miss, after a match, while proposals verify). Only used when drafts are on (validated
    # always: a malformed value refuses the start with drafts off too).
    draft_ladder: str = "auto"
    # The forward costs "auto" chooses from, given instead of timed at start (which takes
    # 15-20 s of each replica's start on a 2-core CPU): max_draft_tokens + 1 numbers, what a
    # forward of q = 1, 2, ... new tokens costs over a 1-token one, as a replica of the same
    # model on the same hardware measured them (its start log prints the value to give; or
    # its Stats draft_forward_costs, comma-separated). Used as that timing would be (the
    # lengths, the batch rule, the start of the costs learned as served). Empty = time them
    # at start. Only read when drafts are on and draft_ladder is auto (validated always).
    draft_costs: str = ""
    # With several sequences decoding, cut draft proposals to the length expected to emit the
    # most tokens per forward cost (every row of a batch's forward pays for its longest
    # proposal; services/kvpool/drafting.py `batch_keep`). Needs "auto" lengths from costs
    # timed or given (draft_costs). False = every proposal rides the batch's forward
    # (fastest for the drafting requests, slower for the others).
    draft_batch_gate: bool = True
    # Learn what steps cost as served: steps of one sequence are timed by their tokens, and
    # once a length has 8 of them its cost replaces the start-up timing's in the choices by
    # cost (proposal lengths, the batch rule; services/kvpool/drafting.py `ServedCosts`).
    # Needs "auto" lengths from costs timed or given (draft_costs). False = the start-up
    # timing (or the costs given) throughout.
    draft_costs_learned: bool = True
    # Most branches a sequence decoding alone verifies in one forward: its proposal
    # and the continuations after other draft positions its context's end matches, as a tree
    # (services/kvpool/drafting.py `Draft.alternatives`, `Tree`). 1 = the proposal alone.
    # Only used when drafts are on (validated always).
    draft_branches: int = 4
    # Prompt lookup for requests without a draft too: they propose continuations of where the
    # end of their context (prompt + output) occurred earlier in it, verified like a draft's
    # (greedy tokens unchanged; sampled ones distributed as without). Pays where answers copy
    # their prompt or repeat themselves and forwards of a few tokens cost about one (see
    # `python -m benchmarks.prompt_lookup`). Only read when drafts are on.
    prompt_lookup: bool = False
    # Kernels of the model's linear layers: "onednn" = float32 CPU models run them on oneDNN
    # with weights packed once at start (1.5x faster decode steps and 1.8x faster 17-token
    # verify forwards than torch's MKL on a 2-core AVX-512 host; services/kvpool/linear.py),
    # and bfloat16 ones where this CPU runs bfloat16 natively (AVX-512 BF16, AMX); other models
    # keep torch's. "torch" = always torch's.
    linear_kernels: str = "onednn"
    # Allocate the working rows for the whole max_context at start instead of growing them by
    # doubling. Growing holds the old and new rows at once while copying (1.5x the full size at
    # the last step); allocated up front the peak is the full size, known at start (GPUs).
    preallocate_rows: bool = False
    # "hybrid" (LFU under shallow_tokens, LRU deeper) or "lru".
    eviction_policy: str = "hybrid"
    # Blocks starting before this token are ranked by use count (LFU; a count halves per hour
    # since the block's last use) under hybrid eviction, deeper ones by recency (LRU) and
    # evicted first.
    shallow_tokens: int = 128
    # Longest pin a Prefill may ask for (a longer one is cut to it, without a word: orchestrators'
    # warm_pin_ttl_max_s should not exceed it).
    pin_ttl_max_seconds: int = 3600
    # Share of the pool that pins (warm-up) may hold at once, so that one tenant's Warm cannot
    # starve every request: a pin past it pins the prompt's leading blocks up to the limit
    # (the rest stay cached), one with no room left is refused (RESOURCE_EXHAUSTED).
    max_pinned_fraction: float = 0.5
    # Share of the pool the pins of one cache salt (one tenant) may hold: one tenant's Warm
    # with a long TTL must not take every pin the pool allows from the others.
    max_pinned_per_tenant_fraction: float = 0.25
    # torch intra-op threads of the engine thread, which runs the model; 0 = torch's default.
    # The replica's main thread loads the model with one (services/kvpool/__main__.py).
    torch_threads: int = 0
    # Forwards of fewer new tokens than this (rows x tokens per row: decode steps, draft
    # verifies, short prefill chunks) run on one thread, longer ones on torch_threads. With
    # OMP_WAIT_POLICY=PASSIVE (the process default) waking the OpenMP workers for each of a
    # SmolLM2 forward's ~200 small matmuls cost more than the second core gave: a lone
    # replica's decode step took 134-163 ms on two threads, 74-79 ms on one (2-core host),
    # and two threads only paid from prefills of 256 tokens on (`python -m benchmarks.threads`
    # measures where they start to pay on a host). 0 = every forward on torch_threads (a
    # replica with cores of its own, spinning OpenMP workers: GOMP_SPINCOUNT;
    # services/kvpool/README.md).
    one_thread_below: int = 256
    # Longest sequence (prompt + generated) served; 0 = the model's max_position_embeddings
    # (or sliding window, or a longrope model's original context), which also caps a larger
    # value.
    # The working rows grow to max_batch_size x this many tokens of KV on top of the pool
    # (SmolLM2 fp32: 46 KB per token, so 8 x 8,192 tokens = 3.0 GB; up to 1.5x that while the
    # last growth step copies, unless preallocate_rows): bound it to fit.
    max_context: int = 0
    # Drain time on SIGTERM: streams under way finish, new calls are refused.
    grace_seconds: float = 10.0
    # Health turns NOT_SERVING (the liveness probe then restarts the replica) when one engine
    # step has not finished in this long, or every step has failed for this long: a hung step
    # holds every stream, a broken device fails each one. Far above any real
    # step (a 512-token prefill chunk of SmolLM2 takes ~0.5 s on 2 CPU cores); raise it for
    # large models on CPU. 0 = off.
    engine_stall_seconds: float = 300.0
    # A Generate stream whose client has taken no message for this long (its send held by
    # flow control: a direct caller that stopped reading) is ended with DEADLINE_EXCEEDED.
    # Such a stream held a worker thread for good (the engine had long finished), and as many
    # as the server has (max_batch_size + max_waiting + 16) took the replica down. The
    # orchestrator reads ahead of its own clients and never stalls here. 0 = off.
    send_stall_seconds: float = 60.0

    def validate(self) -> None:
        """Fail fast with the name of the offending variable."""
        s = SERVICE
        require(bool(self.model.strip()), s, "model", MODEL_SPEC_RULE)
        self._check_engine()
        self._check_ids()
        require(self.num_blocks <= MAX_BLOCKS, s, "num_blocks",
                f"must be at most {MAX_BLOCKS:,} (a pool that large fits no memory)")
        require(self.torch_threads <= MAX_THREADS, s, "torch_threads",
                f"must be at most {MAX_THREADS}")
        self._check_addresses()
        require(-1 <= self.metrics_port <= 65535, s, "metrics_port",
                "must be -1 (off), 0 or a port")
        # Floors: at 1e-9 an idle replica sent the index ~1,500 heartbeats a second (half a
        # core on each side), and its publisher woke as often.
        require(self.heartbeat_seconds >= 0.1, s, "heartbeat_seconds",
                f"must be >= 0.1, got {self.heartbeat_seconds}")
        require(self.publish_interval_seconds >= 0.01, s, "publish_interval_seconds",
                f"must be >= 0.01, got {self.publish_interval_seconds}")
        require(self.eviction_policy in ("hybrid", "lru"), s, "eviction_policy",
                "must be 'hybrid' or 'lru'")
        self._check_decoding()
        require(self.shallow_tokens >= 0, s, "shallow_tokens", "must be >= 0")
        require(self.pin_ttl_max_seconds >= 1, s, "pin_ttl_max_seconds", "must be >= 1")
        require(self.grace_seconds >= 0, s, "grace_seconds", "must be >= 0")
        # Under a few seconds an idle engine's own wait between turns read as a stall: health
        # stayed NOT_SERVING, and a liveness probe would restart the replica for good.
        require(self.engine_stall_seconds == 0 or self.engine_stall_seconds >= 5, s,
                "engine_stall_seconds",
                f"must be 0 (off) or >= 5, got {self.engine_stall_seconds}")
        require(self.send_stall_seconds == 0 or self.send_stall_seconds >= 1, s,
                "send_stall_seconds", "must be 0 (off) or >= 1")
        self._check_pinning()
        require(self.torch_threads >= 0, s, "torch_threads", "must be >= 0")
        require(self.one_thread_below >= 0, s, "one_thread_below", "must be >= 0")

    def _check_engine(self) -> None:
        """`validate`'s checks of where the model runs and what the engine holds and takes."""
        s = SERVICE
        # N as torch reads it: "cuda:00" and non-ASCII digits passed, and torch refused them
        # only after the model had loaded (a traceback, exit 1).
        require(self.device == "cpu"
                or re.fullmatch(r"cuda(:(0|[1-9][0-9]*))?", self.device) is not None,
                s, "device",
                f"must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        require(self.dtype in ("float32", "float16", "bfloat16"), s, "dtype",
                f"must be float32, float16 or bfloat16, got {self.dtype!r}")
        require(self.num_blocks >= 0, s, "num_blocks", "must be >= 0 (0 = size by kv_cache_bytes)")
        # 1 was taken, and then every Generate refused (a prompt and one token need 2).
        require(self.max_context == 0 or self.max_context >= 2, s, "max_context",
                "must be 0 (the model's) or >= 2")
        require(self.num_blocks > 0 or self.kv_cache_bytes > 0, s, "kv_cache_bytes",
                "must be > 0 when num_blocks is 0")
        require(1 <= self.block_size <= 1024, s, "block_size", "must be in 1..1024")
        require(1 <= self.max_batch_size <= 256, s, "max_batch_size", "must be in 1..256")
        require(self.max_prefill_chunk >= 1, s, "max_prefill_chunk", "must be >= 1")
        require(self.max_new_tokens_limit >= 1, s, "max_new_tokens_limit", "must be >= 1")
        require(self.max_waiting >= 1, s, "max_waiting", "must be >= 1 (0 refuses everything)")

    def _check_ids(self) -> None:
        """`validate`'s checks of the replica id and model id, by the prefix index's rules at
        Register: an id it refuses leaves the replica serving but never indexed."""
        s = SERVICE
        # The index's rule (errors.blank): an id of only invisible characters ("\u3164")
        # passed strip() and isprintable(), and named a replica nobody could see in Stats.
        require(not blank(self.replica_id), s, "replica_id",
                "must not be empty (or only whitespace or invisible characters)")
        # The prefix index refuses longer ids at Register: the replica would never be indexed.
        require(len(self.replica_id) <= 256, s, "replica_id", "must be at most 256 characters")
        # The index's own rules at Register: broken, the replica served but was never indexed
        # (INVALID_ARGUMENT, retried every 5 s for good).
        require(self.replica_id.isprintable() and not any(c.isspace() for c in self.replica_id),
                s, "replica_id", "printable characters without spaces only")
        # The index refuses another at Register: the replica would serve but never be indexed.
        require_model_id(self.model_id, s)

    def _check_decoding(self) -> None:
        """`validate`'s checks of drafting (lengths, branches, ladder and costs) and the
        linear kernels."""
        s = SERVICE
        require(1 <= self.max_draft_tokens <= 64, s, "max_draft_tokens", "must be in 1..64")
        require(1 <= self.draft_branches <= 16, s, "draft_branches", "must be in 1..16")
        require(self.linear_kernels in LINEAR_KERNELS, s, "linear_kernels",
                f"must be one of {', '.join(LINEAR_KERNELS)}, got {self.linear_kernels!r}")
        require(self.draft_ladder == "auto" or self.fixed_ladder() is not None, s,
                "draft_ladder", "must be 'auto' or three ascending integers 'a,b,c' in "
                f"1..max_draft_tokens ({self.max_draft_tokens})")
        require(self.draft_costs.strip() == "" or self.given_costs() is not None, s,
                "draft_costs", f"must be empty (timed at start) or max_draft_tokens + 1 "
                f"({self.max_draft_tokens + 1}) comma-separated costs, the first 1 (a "
                f"1-token forward's), every one finite and at least {IMPLAUSIBLE:g} (a forward "
                f"of more tokens timed under that share of one token's is noise), got "
                f"{self.draft_costs!r}")
        require(self.draft_costs.strip() == "" or self.draft_ladder == "auto", s,
                "draft_costs", "given with a fixed draft_ladder: the costs choose the lengths "
                "'auto' would time them for (give one or the other)")

    def _check_pinning(self) -> None:
        """`validate`'s checks of the shares of the pool pinned blocks may hold."""
        s = SERVICE
        require(0 < self.max_pinned_fraction <= 1, s, "max_pinned_fraction", "must be in (0, 1]")
        require(0 < self.max_pinned_per_tenant_fraction <= self.max_pinned_fraction, s,
                moved(self, "max_pinned_per_tenant_fraction", "max_pinned_fraction")
                if self.max_pinned_per_tenant_fraction > 0 else "max_pinned_per_tenant_fraction",
                f"max_pinned_per_tenant_fraction ({self.max_pinned_per_tenant_fraction:g}) must "
                f"be in (0, max_pinned_fraction ({self.max_pinned_fraction:g})]")

    def _check_addresses(self) -> None:
        """`validate`'s checks of where the replica listens, the prefix index it registers
        with and the address it announces there."""
        s = SERVICE
        require_listen_address(self.address, s)
        require_shard_list(self.prefix_address, s, "prefix_address")  # "" = no prefix index
        if self.advertise_address:
            require_addresses([self.advertise_address], s, "advertise_address",
                              allow_none=False, dialed=False)  # a pod IP, bare IPv6 too
        if self.prefix_address.strip():
            # The index's rule at Register for the address announced (`announce_problem`):
            # broken, the replica served but was never indexed. Port 0 is the listen
            # address's "any free port", not where the replica is: it needs an
            # advertise_address.
            a = self.public_address
            why = announce_problem(a)
            require(not why, s, "advertise_address" if self.advertise_address else "address",
                    f"{a[:60]!r} cannot be announced to the prefix index: {why} (host:port with "
                    "a port 1..65535, at most 256 printable characters without spaces"
                    + ("" if self.advertise_address else
                       "; with port 0 set TIERCACHE_KVPOOL_ADVERTISE_ADDRESS") + ")")

    @property
    def public_address(self) -> str:
        """Address announced to the prefix index."""
        return self.advertise_address or self.address

    def given_costs(self) -> tuple[float, ...] | None:
        """`draft_costs` as numbers (index q - 1: a forward of q tokens over a 1-token one);
        None when empty or malformed."""
        parts = [p.strip() for p in self.draft_costs.split(",")]
        # Plain decimals, as a replica prints them (float() also takes "1_0", "nan" and other
        # scripts' digits)
        if not all(_DECIMAL.fullmatch(p) for p in parts):
            return None
        costs = tuple(float(p) for p in parts)
        # 400 digits are a float's inf, which the rule's "finite" excludes
        ok = (len(costs) == self.max_draft_tokens + 1 and costs[0] == 1.0
              and all(IMPLAUSIBLE <= c and math.isfinite(c) for c in costs))
        return costs if ok else None

    def fixed_ladder(self) -> tuple[int, int, int] | None:
        """`draft_ladder` as three lengths; None for "auto" or a malformed value."""
        parts = self.draft_ladder.split(",")
        if len(parts) != 3 or not all(p.strip().isascii() and p.strip().isdigit()
                                      for p in parts):
            return None
        a, b, c = (int(p) for p in parts)
        return (a, b, c) if 1 <= a <= b <= c <= self.max_draft_tokens else None
