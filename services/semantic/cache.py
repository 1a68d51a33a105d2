"""The semantic cache: namespaces of (prompt, answer) entries found by embedding similarity.

    lookup(ns, text) : validate -> embed -> search ns index -> policy (tier, verified bonus)
                       -> guard / verifier (strict, standard tiers) -> hit | draft | miss
    store(ns, ...)   : validate -> embed -> SQLite commit (durable) -> index -> evict (LRU)

The SQLite store is the truth; the in-memory maps and faiss indexes are rebuilt from it at start
(`load`; an HNSW graph saved by the last clean stop is taken instead of built when it matches
SQLite: snapshot.py). Everything here is plain Python: the gRPC adapter is `server.py`.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import re
import threading
import time
import unicodedata
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol

import numpy as np

from services.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    blank,
    model_id_problem,
    name_problem,
    shown,
)
from services.semantic.config import SemanticConfig
from services.semantic.guard import ParaphraseGuard, spelling_differs
from services.semantic.index import IndexParams, NamespaceIndex
from services.semantic.policy import HIT_TOLERANCE, Outcome, ThresholdPolicy
from services.semantic.snapshot import Saved, same_vectors
from services.semantic.snapshot import save as save_snapshot
from services.semantic.store import WRITE_CHUNK, EntryStore, Row, pack_tokens, unpack_tokens
from services.semantic.verifier import StaleVerifier, Verifier, VerifierModel

log = logging.getLogger(__name__)
RECENT_VECTORS = 256  # looked-up texts whose vectors a following Store may take

_HEX = re.compile(r"[0-9a-fA-F]*")
_CANDIDATES = 4  # neighbours fetched first; more (x4 each round) while they could still hit
_MAX_CANDIDATES = 256  # at most this many neighbours per lookup (each refusal costs a check)
_SEARCHES = 3  # a lookup searches again while candidates vanish under it, at most this often
_DROP_CHUNK = 1000  # entries removed from memory per hold of the cache lock
# The expiry heap is compacted once it holds this many items more than twice the entries.
_EXPIRY_HEAP_SLACK = 4096


class Embedder(Protocol):
    """What the cache needs from an embedder (`BatchingEmbedder` or a test double)."""

    name: str
    dim: int

    def embed_one(self, text: str) -> np.ndarray: ...

    def embed(self, texts: list[str]) -> np.ndarray: ...


class Namespace(NamedTuple):
    """Answers are only served under the same tenant, model and conversation context."""

    tenant: str
    model_id: str
    context_hash: str = ""


class _Reading:
    """What an Invalidate under way read (`SemanticCache._removal`): the entries of its
    namespace up to label `label`, or (`only`) that one label. Compared by identity."""

    __slots__ = ("label", "only")

    def __init__(self, label: int, only: bool = False) -> None:
        self.label, self.only = label, only

    def holds(self, label: int) -> bool:
        return label == self.label if self.only else label <= self.label


def _flight_key(probe: Entry) -> tuple:
    """What makes two Stores the same (and `_same_answer`'s entry the same as a Store): where,
    its answer, cut and tokens, its ttl and verified flag. One of them in flight writes for
    both (`SemanticCache._lead_or_wait`)."""
    return (probe.namespace, probe.prompt, probe.answer, probe.truncated, probe.answer_tokens,
            probe.ttl_seconds, probe.verified)


def _same_answer(held: Entry, new: Entry, now: float) -> bool:
    """`new` stores nothing that `held` (the same prompt's entry, not expired at `now`) does
    not (`_flight_key`: an unverified answer stored over a verified one replaces it, as any
    other Store: the flag starts over)."""
    return not held.expired(now) and _flight_key(held) == _flight_key(new)


@dataclass(frozen=True)
class Entry:
    """One cached answer (the in-memory copy of a SQLite row)."""

    id: str
    label: int
    namespace: Namespace
    prompt: str
    answer: str
    verified: bool
    created_at: float
    last_hit_at: float
    hit_count: int
    ttl_seconds: int
    truncated: int = 0  # cut short after this many model tokens (max_tokens/stop); 0 = whole
    # The prompt is longer than the embedding model's window (None = not known yet): its vector
    # stands for its first tokens only, so only an exact repeat may hit it.
    over_window: bool | None = None
    # What of the prompt the embedding model cannot read (see `OnnxEmbedder.unseen`; None =
    # not known yet).
    unseen: str | None = None
    # The model's token ids of the answer (`store.pack_tokens`); empty = not given.
    answer_tokens: bytes = b""

    @property
    def answer_token_ids(self) -> list[int]:
        return unpack_tokens(self.answer_tokens)

    def used_at(self) -> float:
        """When last used: its last hit, else its creation (the key of the LRU orders)."""
        return max(self.last_hit_at, self.created_at)

    def expires_at(self) -> float:
        """When the TTL runs out (inf = never)."""
        return self.created_at + self.ttl_seconds if self.ttl_seconds > 0 else math.inf

    def expired(self, now: float) -> bool:
        return now >= self.expires_at()


# Each namespace's entries and their vectors, as `load` reads them from SQLite.
_Groups = dict[Namespace, tuple[list[Entry], list[np.ndarray]]]


class SteadyWallClock:
    """Seconds since the epoch that a step of the system clock does not move: the wall clock
    read once, then advanced by the monotonic clock. TTLs count elapsed time: on the wall
    clock, an NTP step or a VM resumed an hour ahead had the housekeeper delete every entry
    the step carried past its TTL from SQLite (for good: stepping back restored nothing), and
    a step back served expired entries. Timestamps are stored on it, and a restart reads the
    wall clock again: a correction of the clock made while the service runs is taken then."""

    def __init__(self) -> None:
        self._wall0, self._mono0 = time.time(), _elapsed()

    def __call__(self) -> float:
        return self._wall0 + (_elapsed() - self._mono0)


def _elapsed() -> float:
    """Seconds that also count a suspend of the host (the monotonic clock stops during one),
    where the system says so (Linux's boot-time clock)."""
    try:
        return time.clock_gettime(time.CLOCK_BOOTTIME)
    except (AttributeError, OSError):
        return time.monotonic()


@dataclass(frozen=True)
class LookupResult:
    """The outcome of one lookup; `entry` is the hit or the draft candidate (or None)."""

    hit: bool
    entry: Entry | None
    similarity: float
    threshold: float
    tier: str
    guard_rejected: bool = False
    guard_reason: str = ""
    search_ms: float = 0.0
    embed_ms: float = 0.0
    # The text is the entry's own prompt: found by text, served without embedding.
    exact: bool = False
    # Where the threshold came from (the request's own, or its tier's), and its value before
    # the verified bonus: `threshold` alone did not tell a direct caller whether its explicit
    # threshold was used (a verified entry's is lowered) or held to [floor, 1].
    threshold_from_request: bool = False
    base_threshold: float = 0.0


@dataclass
class CacheStats:
    """Counters since start (see `SemanticCache.stats`)."""

    entries: int
    namespaces: int
    lookups_total: int
    hits_by_tier: dict[str, int]
    near_misses_total: int
    guard_rejections_total: int
    evictions_total: int
    expirations_total: int
    lookup_p50_ms: float
    lookup_p99_ms: float
    embedding_model: str


def _metrics():
    from services.common import metrics as m

    return {
        "lookups": m.counter("tiercache_semantic_lookups_total",
                             "Semantic lookups by tier (strict, standard, relaxed, or explicit: "
                             "the request's own threshold) and outcome (hit, draft, miss; draft: "
                             "the nearest entry was in the draft band, not a hit, counted "
                             "whether or not the caller wanted a draft)",
                             ("tier", "outcome")),
        "guard": m.counter("tiercache_semantic_guard_rejections_total",
                           "Lookups in which a candidate close enough to hit was refused (by "
                           "the guard, the verifier, or the spelling, embedding-window or "
                           "unread-characters rule), whether or not one further down hit"),
        "evictions": m.counter("tiercache_semantic_evictions_total", "Entries evicted (LRU)"),
        "expirations": m.counter("tiercache_semantic_expirations_total", "Entries expired"),
        "entries": m.gauge("tiercache_semantic_entries", "Entries held"),
        # Exact repeats are observed too (sub-millisecond, no search): on a live stack most of
        # the lowest buckets were theirs, read as searches that fast.
        "search": m.histogram("tiercache_semantic_search_seconds",
                              "Index search and the candidates' checks (guard, verifier), "
                              "excluding embedding; for a lookup served as an exact repeat, "
                              "its lookup by text instead (no search: see exact_hits_total)",
                              buckets=(0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.05, 0.1)),
        "embed": m.histogram("tiercache_semantic_embed_seconds",
                             "Embedding time of a Lookup's text (not observed for a lookup "
                             "served as an exact repeat, which embeds nothing, nor for Store)",
                             buckets=(0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.1, 0.5)),
        "exact": m.counter("tiercache_semantic_exact_hits_total",
                           "Hits on an exact repeat of a cached prompt, found without "
                           "embedding (also counted in tiercache_semantic_lookups_total; the "
                           "orchestrator may still decline a hit: its "
                           "semantic_hits_not_served_total)"),
        # A counter of its own, not a label on lookups_total: a label there would split every
        # existing hit series (dashboards and alerts read lookups_total{tier,outcome="hit"}).
        "verified": m.counter("tiercache_semantic_verified_hits_total",
                              "Hits on an entry a human verified (Verify, or feedback rated "
                              "good), held to the threshold less verified_bonus, by tier as in "
                              "tiercache_semantic_lookups_total (also counted there as hits: "
                              "the other hits are lookups_total{outcome=\"hit\"} less these)",
                              ("tier",)),
        "graphs_taken": m.gauge("tiercache_semantic_hnsw_graphs_from_snapshot",
                                "HNSW graphs the last start took from the saved snapshot "
                                "instead of building them"),
        "saves": m.counter("tiercache_semantic_snapshot_saves_total",
                           "Saves of the HNSW graphs (on stop and every snapshot_interval_s; a "
                           "save with no graph changed since the last, or none to save, writes "
                           "nothing and counts ok: the snapshot is current)",
                           ("result",)),
        "saved_at": m.gauge("tiercache_semantic_snapshot_last_save_timestamp_seconds",
                            "Unix time of the last successful save of the HNSW graphs (the "
                            "start's, before the first save; alert on its age past a few "
                            "snapshot intervals)"),
    }


def _verifier_for(cfg: SemanticConfig, embedder: Embedder,
                  guard: ParaphraseGuard) -> Verifier | None:
    """The learned verifier of `cfg.verifier_tiers`; None when no tier has one, or when its
    weights cannot judge this embedder's similarities (those tiers then keep the guard)."""
    if not cfg.verifier_tiers:
        return None
    try:
        verifier = Verifier(VerifierModel.load(cfg.resolved_verifier_path())
                            if cfg.verifier_path else None, guard)
    except StaleVerifier as e:
        # Fitted on another version's features (an upgrade changed them, or a
        # rollback): the verifier tiers keep the guard, as with weights fitted for
        # another embedder below. It stopped every shard (exit 2).
        log.warning("%s: %s; verifier off (guard only) until then", cfg.verifier_path, e)
        return None
    fitted_for = _fitted_elsewhere(verifier.model.meta or {}, embedder)
    if fitted_for:
        # Its weights read similarities of the model it was fitted with; another model's
        # scale differs. Its tiers keep the guard (verifier tiers are guard tiers too).
        log.warning("the verifier was fitted for %s, not %s: verifier off (guard only); "
                    "fit one with python -m services.semantic.fit_verifier", fitted_for,
                    getattr(embedder, "identity", embedder.name))
        return None
    return verifier


def _fitted_elsewhere(meta: dict, embedder: Embedder) -> str:
    """The model a verifier's weights were fitted for, when it is not `embedder` ("" when it
    is). By the model's weights (`embedder_weights`, the part of its identity after "@") when
    the weights file records them: by name alone, a fine-tuned model in a folder of the same
    name kept weights fitted for another's cosines, and the packaged model served under
    another name lost its verifier. Older files record the name only."""
    weights = meta.get("embedder_weights")
    ours = getattr(embedder, "identity", "").rpartition("@")[2]
    if weights and ours:
        return "" if weights == ours else f"{meta.get('embedder', '?')}@{weights}"
    name = meta.get("embedder")
    return "" if not name or name == embedder.name else name


# How often a Store waiting for an Invalidate (`store_entry`) asks whether its caller still waits.
_WAIT_CHECK_S = 0.05


def _still(wanted: Callable[[], bool] | None, what: str) -> None:
    """Raise DeadlineExceeded unless the caller still waits (`wanted` None: always); `what`:
    what had not happened yet ("the answer was written"; a Lookup said "the lookup was
    written", though it writes nothing)."""
    if wanted is not None and not wanted():
        raise DeadlineExceeded(f"the caller's deadline passed (or it went away) before "
                               f"{what}: nothing changed")


class SemanticCache:
    """Thread-safe semantic cache over one embedder, one SQLite store and per-namespace indexes.

    Args:
        cfg: limits, thresholds and index settings.
        embedder: turns text into unit vectors.
        store: the durable entry store.
        clock: seconds since the epoch (tests pass a fake one); by default a
            `SteadyWallClock`, which a step of the system clock does not move.
    """

    def __init__(self, cfg: SemanticConfig, embedder: Embedder, store: EntryStore,
                 clock: Callable[[], float] | None = None) -> None:
        self.cfg = cfg
        self.embedder = embedder
        # Tags stored vectors: entries embedded by anything else are re-embedded at load.
        self._embed_id: str = getattr(embedder, "identity", embedder.name)
        self.store = store
        self.clock = clock or SteadyWallClock()
        self.policy = ThresholdPolicy.from_config(cfg)
        self.guard = ParaphraseGuard()
        self.guard_tiers = frozenset(cfg.guard_tiers)
        self.verifier_tiers = frozenset(cfg.verifier_tiers)
        self.verifier = _verifier_for(cfg, embedder, self.guard)
        self._params = IndexParams(embedder.dim, cfg.hnsw_min_entries, cfg.hnsw_m,
                                   cfg.hnsw_ef_construction, cfg.hnsw_ef_search,
                                   cfg.delta_capacity)
        # Vectors of texts just looked up, for the Store that usually follows a miss (the
        # orchestrator stores the model's answer under the text it looked up): embedding is
        # ~95% of a Store. Bounded, newest last; a Store takes its text's vector out. Keyed by
        # (tenant, text): a tenant's erasure drops its own texts and no other tenant's.
        self._recent: OrderedDict[tuple[str, str], tuple[np.ndarray, bool]] = OrderedDict()
        self._recent_lock = threading.Lock()
        self._lock = threading.RLock()  # guards the maps below, never held during I/O waits
        self._indexes: dict[Namespace, NamespaceIndex] = {}
        self.graphs_adopted = 0  # HNSW graphs the last load took from a snapshot
        self._save_lock = threading.Lock()  # one save at a time (periodic, and at stop)
        self._saved: tuple[str, dict] = ("", {})  # the last save's folder and what it holds
        self._save_requested = False  # see take_save_request
        self._entries: dict[int, Entry] = {}  # label -> entry
        self._by_id: dict[str, int] = {}
        # (namespace, exact prompt) -> label: a second Store of the same prompt replaces the
        # first. Found by text, not by a nearest-neighbour search: MiniLM embeds case and accent
        # variants identically, and they can fill every near slot.
        self._by_prompt: dict[tuple[Namespace, str], int] = {}
        self._verify_lock = threading.Lock()  # Verify calls, one at a time (see verify)
        # What each Invalidate under way read, by namespace: a Store replacing one of those
        # entries waits for that Invalidate's end (see `_removal`).
        self._removing: dict[Namespace, list[_Reading]] = {}
        self._removed = threading.Condition(self._lock)
        # Stores in flight by `_flight_key`, each set once its Store ended: an identical Store
        # arriving meanwhile waits for it rather than write a row of its own (`_lead_or_wait`).
        self._flights: dict[tuple, threading.Event] = {}
        self._top_label = -1  # the highest label memory has held
        # Indexes of namespaces emptied while a merge of theirs ran: shutdown still waits on it.
        self._retired: list[NamespaceIndex] = []
        self._ns_lru: dict[Namespace, OrderedDict[int, None]] = {}
        # Per tenant, least recent first (there is no global order): the global capacity is
        # taken back from the tenant holding the most entries, so one tenant storing without
        # end evicts its own.
        self._tenant_lru: dict[str, OrderedDict[int, None]] = {}
        # Per tenant, the entries it holds less those an expire under way drops (`_level_of`,
        # as of the last `_settle_levels`), the tenants per such count, and per count a heap
        # of (age, label, tenant) of each such tenant's next victim: a Store past the global
        # capacity reads the oldest entries of a few tenants, not of every tenant tied at the
        # most (20,000: ~47 ms a Store, under the lock). Items go stale as tenants change
        # (`_dirty`, settled at the next such Store) and are dropped when popped.
        self._level_of: dict[str, int] = {}
        self._level_size: Counter[int] = Counter()
        self._levels: dict[int, list[tuple[float, int, str]]] = {}
        self._level_items = 0
        self._dirty: set[str] = set()
        self._lookups = 0
        self._hits: dict[str, int] = {t: 0 for t in self.policy.tiers}
        self._near = self._guarded = self._evicted = self._expired = 0
        # (expires_at, label) of every entry with a TTL, earliest first: `expire` pops only
        # what is due, where a scan of every entry under steady traffic ran every tick. Items
        # of entries removed otherwise (evicted, replaced, invalidated) stay until popped or
        # compacted away (`_compact_expiry_heap`).
        self._expiry_heap: list[tuple[float, int]] = []
        self._expiry_examined = 0  # heap items popped by `expire` (tests count the work)
        # Labels an `expire` under way popped as due and has not yet dropped from memory
        # (SQLite first), always held entries (`_drop_locked` unmarks them), with their count
        # per namespace and per tenant: a Store past capacity counts them as gone
        # (`_victims_locked`).
        self._expiring: set[int] = set()
        self._expiring_ns: Counter[Namespace] = Counter()
        self._expiring_tenant: Counter[str] = Counter()
        self._latency: deque[float] = deque(maxlen=10_000)
        self._m = _metrics()

    # ---- validation -------------------------------------------------------------------------

    def _check_namespace(self, ns: Namespace | None, erasing: bool = False) -> Namespace:
        """A namespace to store or look up under, whose tenant and model print as no other (the
        orchestrator's tokens file allows no such name, the prefix index no such model:
        errors.name_problem, model_id_problem); with `erasing`, one to remove, whose names
        may: an earlier release stored entries under such names, and they must stay erasable
        by them."""
        if ns is None:
            raise InvalidArgument("namespace", "required")
        self._check_name("namespace.tenant", ns.tenant)
        if not erasing and (problem := name_problem(ns.tenant)):
            raise InvalidArgument("namespace.tenant", problem)
        self._check_name("namespace.model_id", ns.model_id)
        if not erasing and (problem := model_id_problem(ns.model_id)):
            raise InvalidArgument("namespace.model_id", problem)
        if len(ns.context_hash) > 128 or not _HEX.fullmatch(ns.context_hash):
            raise InvalidArgument("namespace.context_hash", "must be hex, at most 128 chars")
        return Namespace(ns.tenant, ns.model_id, ns.context_hash.lower())

    def _check_name(self, field: str, value: str) -> None:
        """A tenant or model id: given, visible, at most max_tenant_chars."""
        if blank(value):  # " " or "\u3164" named nobody's tenant or model, as "" does
            raise InvalidArgument(field, "required (not empty, or only whitespace or "
                                         "invisible characters)")
        if len(value) > self.cfg.max_tenant_chars:
            raise InvalidArgument(field, f"longer than {self.cfg.max_tenant_chars} chars")

    def _check_text(self, field: str, text: str, limit: int) -> None:
        if blank(text):
            raise InvalidArgument(field,
                                  "must not be empty (or only whitespace or invisible characters)")
        if len(text) > limit:
            raise InvalidArgument(field, f"longer than the limit of {limit} characters "
                                         f"(got {len(text)})")

    # ---- lookup -----------------------------------------------------------------------------

    def lookup(self, ns: Namespace, text: str, tier: str = "", threshold: float = 0.0,
               want_draft: bool = False, wanted: Callable[[], bool] | None = None
               ) -> LookupResult:
        """Finds the nearest entry of `ns` and decides hit / draft / miss.

        `wanted`: whether the caller still waits, asked before the text is embedded (by the
        batcher, when its batch runs) and before the search: a caller gone costs no
        embedding, is not counted, and touches no entry.

        Raises:
            InvalidArgument: bad namespace, text, tier or threshold (nothing is recorded).
            DeadlineExceeded: `wanted` said no.
        """
        ns = self._check_namespace(ns)
        self._check_text("text", text, self.cfg.max_text_chars)
        resolved = self.policy.resolve(tier, threshold)
        t0 = time.perf_counter()
        _still(wanted, "the lookup was made")
        exact = self._exact_repeat(ns, text, resolved)
        if exact is not None:
            t1 = time.perf_counter()
            exact = replace(exact, search_ms=(t1 - t0) * 1000,
                            threshold_from_request=resolved.explicit,
                            base_threshold=resolved.threshold)
            self._record(exact, t1 - t0, None)
            return exact
        vec, over = self._embed(text, wanted=wanted)
        _still(wanted, "the lookup was made")
        t1 = time.perf_counter()
        result = self._search(ns, vec, text, resolved, want_draft, over)
        if not result.hit:  # the model answers, and its answer is stored under this text
            self._remember((ns.tenant, text), vec, over)
        t2 = time.perf_counter()
        result = replace(result, search_ms=(t2 - t1) * 1000, embed_ms=(t1 - t0) * 1000,
                         threshold_from_request=resolved.explicit,
                         base_threshold=resolved.threshold)
        self._record(result, t2 - t1, t1 - t0)
        return result

    def _exact_repeat(self, ns: Namespace, text: str, resolved) -> LookupResult | None:
        """The hit on the entry whose prompt is `text` itself, found by text: the embedding
        (most of a lookup: 3-6 ms of ~7 on a CPU) would only find that entry again, at
        similarity 1. None when there is no such entry or it cannot be served (expired, or
        refused by a check): then the lookup searches by similarity as usual. What is served
        is what that search finds first (the text's own entry, at similarity 1, unless another
        ties with it), except that an identical text cannot miss by a rounding error."""
        label = self._by_prompt.get((ns, text))
        e = self._entries.get(label) if label is not None else None
        now = self.clock()
        if e is None or e.expired(now):
            return None
        decision = self.policy.decide(1.0, resolved, e.verified)
        if (decision.outcome is not Outcome.HIT
                or spelling_differs(text, e.prompt, resolved.tier == "strict")
                or self._second_opinion(text, e.prompt, 1.0, resolved.tier)):
            return None
        return LookupResult(True, self._touch(e, now), 1.0, decision.threshold, resolved.tier,
                            exact=True)

    def _embed(self, text: str, *, reuse_for: str | None = None,
               wanted: Callable[[], bool] | None = None) -> tuple[np.ndarray, bool]:
        """The text's vector, and whether the model read only its start (see `over_window`).
        `reuse_for`: a tenant; take the vector its Lookup of the text that missed kept (see
        `_remember`). `wanted`: handed to a batching embedder, which drops the text of a
        caller gone."""
        if reuse_for is not None:
            with self._recent_lock:
                kept = self._recent.pop((reuse_for, text), None)
            if kept is not None:
                return kept
        checked = getattr(self.embedder, "embed_one_checked", None)
        if checked is not None:
            if wanted is not None and getattr(self.embedder, "accepts_wanted", False):
                return checked(text, wanted=wanted)
            return checked(text)
        return self.embedder.embed_one(text), False  # a test double without a window

    def _remember(self, key: tuple[str, str], vec: np.ndarray, over: bool) -> None:
        """Keep a missed Lookup's vector, under (tenant, text), for the Store that follows
        (bounded, newest last). Copied: the embedder's vectors are views of its whole batch."""
        with self._recent_lock:
            self._recent[key] = (vec.copy(), over)
            self._recent.move_to_end(key)
            while len(self._recent) > RECENT_VECTORS:
                self._recent.popitem(last=False)

    def _over_window(self, e: Entry) -> bool:
        """`e.over_window`, tokenising its prompt once for entries loaded from SQLite."""
        if e.over_window is not None:
            return e.over_window
        check = getattr(self.embedder, "exceeds_window", None)
        over = bool(check(e.prompt)) if check is not None else False
        with self._lock:
            cur = self._entries.get(e.label)
            if cur is not None:
                self._entries[e.label] = replace(cur, over_window=over)
        return over

    def _unseen(self, text: str) -> str:
        fn = getattr(self.embedder, "unseen", None)
        if fn is None:
            return ""  # a test double that reads everything
        # Composed alike (NFC): the same unread word typed decomposed (a Korean question from
        # macOS, NFD: its syllables as jamo) embeds to the same vector, but its unread
        # characters are other code points, and it missed its own entry at similarity 1.0.
        unseen = fn(text)
        return unseen if unseen.isascii() else unicodedata.normalize("NFC", unseen)

    def _entry_unseen(self, e: Entry) -> str:
        """`e.unseen`, tokenising its prompt once (entries are told on their first near hit)."""
        if e.unseen is not None:
            return e.unseen
        unseen = self._unseen(e.prompt)
        with self._lock:
            cur = self._entries.get(e.label)
            if cur is not None:
                self._entries[e.label] = replace(cur, unseen=unseen)
        return unseen

    def _unseen_refusal(self, text: str, text_unseen: list[str], e: Entry) -> str:
        """Texts that differ only in what the embedding model cannot read (an emoji, a word in
        a script outside its vocabulary, control characters) embed identically: a hit needs
        those parts to agree. `text_unseen` memoises the query's part over one lookup."""
        if text == e.prompt:
            return ""
        if not text_unseen:
            text_unseen.append(self._unseen(text))
        if text_unseen[0] == self._entry_unseen(e):
            return ""
        return ("differs in characters the embedding model cannot read (emoji, unknown "
                "scripts, control characters)")

    def _window_refusal(self, text: str, text_over: bool, e: Entry) -> str:
        """Past the embedding window two texts with the same start embed identically, however
        their ends differ (a pasted document, then another question): only an exact repeat is
        served when either side is that long."""
        if text == e.prompt or not (text_over or self._over_window(e)):
            return ""
        return (f"longer than the embedding window ({self._window_tokens()} tokens): "
                "only an exact repeat is served")

    def _window_tokens(self) -> int | str:
        inner = getattr(self.embedder, "inner", self.embedder)
        return getattr(inner, "max_seq_length", "?")

    def _search(self, ns, vec, text, resolved, want_draft, text_over=False) -> LookupResult:
        """The search (`_search_once`), again when it missed while the namespace changed
        under it: the search reads the index without the lock, and a Store replacing the entry
        it would find (the new one in, the old one out, in one hold of the lock) made a lookup
        miss although the namespace held an answer throughout: the search saw the old row but
        read its entry after the replacement, or (the index's row count read before the add,
        its tombstones after the removal) saw neither row. Only a removal (an eviction too) can
        hide a row that was there, so an add alone does not count; a miss is also searched
        again when it met a row whose entry was not yet in memory, or the namespace's index
        was created or replaced under it."""
        for _ in range(_SEARCHES):
            index = self._indexes.get(ns)
            removals = index.removals if index is not None else -1
            result, vanished = self._search_once(ns, index, vec, text, resolved, want_draft,
                                                 text_over)
            after = self._indexes.get(ns)
            if result.hit or not (vanished or after is not index
                                  or (after is not None and after.removals != removals)):
                break
        return result

    def _search_once(self, ns, index, vec, text, resolved, want_draft, text_over=False
                     ) -> tuple[LookupResult, bool]:
        """One search of `index` (ns's, None if it has none), and whether a candidate it found
        was gone from memory when read."""
        if index is None:
            return LookupResult(False, None, 0.0, resolved.threshold, resolved.tier), False
        now = self.clock()
        if text_over:
            return (self._search_over_window(ns, index, vec, text, resolved, want_draft, now),
                    False)
        vanished = False
        best: Entry | None = None
        best_sim, best_th = 0.0, resolved.threshold
        rejected, reason = False, ""
        # Below the verified threshold (the lowest any entry is held to) nothing can be a hit.
        lowest = self.policy.threshold_for(resolved, True)
        # Entries that cannot be served (expired but not yet removed, unverified near-misses
        # above the verified threshold, refused by the verifier or guard) must not hide one
        # further down that can: fetch more neighbours until similarity drops below `lowest`.
        k, seen, done = _CANDIDATES, set(), False
        text_unseen: list[str] = []
        while not done:
            found = index.search(vec, k)
            for nb in found:
                if nb.label in seen:
                    continue
                seen.add(nb.label)
                e = self._entries.get(nb.label)
                if e is None:
                    vanished = True  # a Store or a removal under way (the lock is held)
                    continue
                if e.expired(now):
                    continue
                sim = min(1.0, nb.score)
                decision = self.policy.decide(sim, resolved, e.verified)
                if best is None:
                    best, best_sim, best_th = e, sim, decision.threshold
                if decision.outcome is not Outcome.HIT:
                    if sim < lowest - HIT_TOLERANCE:  # as `decide` reads a hit
                        done = True  # results are sorted: nothing further can be a hit
                        break
                    continue  # a verified entry further down may still be one
                refusal = (self._window_refusal(text, text_over, e)
                           or self._unseen_refusal(text, text_unseen, e)
                           or spelling_differs(text, e.prompt, resolved.tier == "strict")
                           or self._second_opinion(text, e.prompt, sim, resolved.tier))
                if refusal:
                    if not rejected:
                        rejected, reason = True, refusal
                    continue
                return LookupResult(True, self._touch(e, now), sim, decision.threshold,
                                    resolved.tier, rejected, reason), vanished
            done = done or len(found) < k or k >= _MAX_CANDIDATES
            k *= 4
        draft = None
        if want_draft and best is not None and self.policy.in_draft_band(best_sim):
            draft = best
        return (LookupResult(False, draft, best_sim, best_th, resolved.tier, rejected, reason),
                vanished)

    def _search_over_window(self, ns, index, vec, text, resolved, want_draft, now
                            ) -> LookupResult:
        """A text past the embedding window hits only its identical prompt, which `lookup`
        serves by text (`_exact_repeat`) before embedding: every text with the same start ties
        at similarity 1.0, and a search among them could stop before reaching it. So here
        nothing is a hit, and the nearest entry can still be a draft. (This found the identical
        prompt by text again and served it without the checks, so an exact repeat that
        `_exact_repeat` had refused was served all the same.)"""
        near, sim = None, 0.0
        for nb in index.search(vec, _CANDIDATES):
            cand = self._entries.get(nb.label)
            if cand is not None and not cand.expired(now):
                near, sim = cand, min(1.0, nb.score)
                break
        reason = ""
        threshold = resolved.threshold
        if near is not None:
            d = self.policy.decide(sim, resolved, near.verified)
            # What applied to the candidate, after the verified bonus, as in a search.
            threshold = d.threshold
            if d.outcome is Outcome.HIT:
                # Close enough, but not the text; or the text itself (whose spelling cannot
                # differ), which the verifier or guard refused.
                reason = (self._window_refusal(text, True, near)
                          or self._second_opinion(text, near.prompt, sim, resolved.tier))
        draft = near if want_draft and self.policy.in_draft_band(sim) else None
        return LookupResult(False, draft, sim, threshold, resolved.tier,
                            bool(reason), reason)

    def _second_opinion(self, text: str, prompt: str, sim: float, tier: str) -> str:
        """Why the verifier or the guard refuses this hit ("" = serve it)."""
        if self.verifier is not None and tier in self.verifier_tiers:
            v = self.verifier.check(text, prompt, sim, tier)
            return "" if v.ok else v.reason
        if tier in self.guard_tiers:
            g = self.guard.check(text, prompt)
            return "" if g.ok else g.reason
        return ""

    def _touch(self, e: Entry, now: float) -> Entry:
        """Counts a hit (the TTL is not extended) and marks the entry most recently used."""
        with self._lock:
            cur = self._entries.get(e.label)
            if cur is None:  # removed meanwhile: still serve what was found
                return e
            cur = replace(cur, last_hit_at=now, hit_count=cur.hit_count + 1)
            self._entries[e.label] = cur
            self._ns_lru[cur.namespace].move_to_end(e.label)
            self._tenant_lru[cur.namespace.tenant].move_to_end(e.label)
            self._dirty.add(cur.namespace.tenant)
            # Buffered in order (a dict write, no SQLite): two hits recorded outside the lock
            # could land last-writer-wins with the lower count.
            self.store.record_hit(cur.label, now, cur.hit_count)
        return cur

    def _record(self, r: LookupResult, search_s: float, embed_s: float | None) -> None:
        """Count one lookup (`embed_s` None: it embedded nothing). A lookup with its own
        threshold (`r.threshold_from_request`) counts under "explicit", not under its tier
        (that mixed other thresholds into the tier's hit rate)."""
        outcome = "hit" if r.hit else ("draft" if self.policy.in_draft_band(r.similarity)
                                       else "miss")
        tier = "explicit" if r.threshold_from_request else r.tier
        with self._lock:
            self._lookups += 1
            if r.hit:
                self._hits[tier] = self._hits.get(tier, 0) + 1
            elif outcome == "draft":
                self._near += 1
            if r.guard_rejected:
                self._guarded += 1
            self._latency.append(search_s * 1000)
        self._m["lookups"].labels(tier, outcome).inc()
        if r.hit and r.entry is not None and r.entry.verified:
            self._m["verified"].labels(tier).inc()
        if r.guard_rejected:
            self._m["guard"].inc()
        self._m["search"].observe(search_s)
        if embed_s is None:
            self._m["exact"].inc()
        else:
            self._m["embed"].observe(embed_s)

    # ---- store ------------------------------------------------------------------------------

    def store_entry(self, ns: Namespace, prompt: str, answer: str, verified: bool = False,
                    ttl_seconds: int = 0, truncated: int = 0,
                    wanted: Callable[[], bool] | None = None,
                    answer_token_ids: Sequence[int] = ()) -> Entry:
        """Embeds and durably stores an answer; returns once it is committed.

        Evicts least recently used entries beyond the namespace, tenant and global capacity
        (see `_global_excess_locked`). A second store of the identical prompt in a namespace
        replaces the first: of two at once, the one committed later stands, and the other
        returns it. A store of the answer the entry already holds (`_same_answer`) returns that
        entry as it is (its TTL not renewed), writing nothing (`_held_answer`): a herd of
        identical requests gets one id. Identical Stores at once, before any entry holds the
        prompt, write one row: the first writes, the others wait for it (`_lead_or_wait`).

        `wanted`, asked once the prompt is embedded, right before the write, and again once
        the row is written, before memory takes it: False (the caller's deadline passed, or it
        went away) leaves nothing, so a caller whose deadline passed before the commit does not
        leave an entry behind it cannot name (one passing after it, or while the answer goes
        back, still can: best effort). Asked again, every `_WAIT_CHECK_S`, while the Store
        waits for an Invalidate that read the entry it replaces, or for an identical Store.

        `answer_token_ids`: the answer as the namespace's model generated it (optional; served
        back with the entry, see SemanticEntry.answer_token_ids).

        Raises:
            InvalidArgument: bad namespace, prompt, answer, token ids or ttl (nothing is
                written).
            DeadlineExceeded: `wanted` said no (nothing is written).
        """
        ns = self._check_store(ns, prompt, answer, ttl_seconds, answer_token_ids)
        answer_tokens = pack_tokens(answer_token_ids)
        ttl = ttl_seconds or self.cfg.default_ttl_seconds
        probe = Entry("", 0, ns, prompt, answer, verified, self.clock(), 0.0, 0, ttl, truncated,
                      answer_tokens=answer_tokens)
        while (flight := self._lead_or_wait(probe, wanted)) is None:
            pass  # another identical Store ended: its entry, or ours to write, is found anew
        if isinstance(flight, Entry):
            return flight
        try:
            return self._store_new(probe, wanted)
        finally:
            self._land(probe, flight)

    def _store_new(self, probe: Entry, wanted: Callable[[], bool] | None) -> Entry:
        """`store_entry`'s write of `probe`'s answer, which no entry holds: its row, then
        memory; returns the entry that stands."""
        vec, over = self._embed(probe.prompt, reuse_for=probe.namespace.tenant)
        _still(wanted, "the answer was written")
        entry = self._write_row(probe, vec, over)
        dropped: list[int] = []  # labels memory no longer holds: their rows go too
        try:
            stands, evicted, expired_now = self._put_in_memory(entry, vec, wanted, dropped)
        except BaseException:
            self._unwrite(entry.label, dropped)
            raise
        self._m["evictions"].inc(evicted)
        self._m["expirations"].inc(expired_now)
        self.store.delete(dropped)
        return stands or entry

    def _write_row(self, probe: Entry, vec: np.ndarray, over: bool) -> Entry:
        """`store_entry`'s row of `probe`'s answer, written and committed now; returns its
        entry (not in memory yet)."""
        now = self.clock()
        eid = uuid.uuid4().hex
        ns = probe.namespace
        label = self.store.insert(id=eid, tenant=ns.tenant, model_id=ns.model_id,
                                  context_hash=ns.context_hash, prompt=probe.prompt,
                                  answer=probe.answer, embedding=vec,
                                  embed_model=self._embed_id, verified=probe.verified,
                                  created_at=now, ttl_seconds=probe.ttl_seconds,
                                  truncated=probe.truncated, answer_tokens=probe.answer_tokens)
        return replace(probe, id=eid, label=label, created_at=now, over_window=over)

    def _put_in_memory(self, entry: Entry, vec: np.ndarray,
                       wanted: Callable[[], bool] | None,
                       dropped: list[int]) -> tuple[Entry | None, int, int]:
        """Memory takes `store_entry`'s written `entry` in place of the one its prompt held,
        making room; or leaves it out when the one held stands. Adds the labels of the entries
        memory no longer holds to `dropped` (their rows go too). Returns the entry that stands
        instead (None: `entry` was taken), and the numbers evicted and expired to make room."""
        ns, prompt, label, now = entry.namespace, entry.prompt, entry.label, entry.created_at
        evicted = expired_now = 0
        stands: Entry | None = None
        # Asked again once the row is written: the write waits for the store's lock
        # behind every other Store and flush (tens of ms under a burst), and a deadline
        # passing meanwhile left an answer served to everyone though its caller was told
        # DEADLINE_EXCEEDED. Refused here, its row goes (`_unwrite`) and memory never held it.
        _still(wanted, "the answer was written")
        with self._lock:
            # Same prompt again: the new answer replaces the old one.
            old = self._by_prompt.get((ns, prompt))
            while old is not None and any(r.holds(old) for r in self._removing.get(ns, ())):
                # An Invalidate under way read it (see `_removal`): it is gone once that
                # one ends (about a second per 100k entries). A caller whose deadline
                # passes meanwhile is refused and its row deleted (`_unwrite`): the Store
                # went on, and its answer stood although the caller had been told
                # DEADLINE_EXCEEDED.
                self._removed.wait(_WAIT_CHECK_S)
                _still(wanted, "the answer was written")
                old = self._by_prompt.get((ns, prompt))
            if old is not None and (
                    old > label or _same_answer(self._entries[old], entry, now)):
                # A Store of the same prompt committed after this one (a higher label)
                # took the lock first: the later answer stands, as a restart would have
                # it (load keeps the newest row). Served the earlier one instead. Or the
                # entry held is this very answer (a herd of identical requests, each
                # storing what the model gave them all): it stands, so every caller is
                # given one id; replaced, the earlier callers' ids named an entry gone.
                stands = self._entries[old]
                dropped.append(label)
            else:
                self._add_locked(entry, vec)
                if old is not None:
                    self._drop_locked(old)
                    dropped.append(old)
                evicted, expired_now = self._make_room_locked(ns, now, dropped)
                self._m["entries"].set(len(self._entries))
        return stands, evicted, expired_now

    def _unwrite(self, label: int, dropped: list[int]) -> None:
        """Undoes a `store_entry` that failed once its row was written: committed rows that
        memory does not hold would be served by nothing, missed by invalidate and brought back
        by a restart, so the new one (`label`), and any old one already dropped, leave SQLite
        too."""
        with self._lock:
            self._drop_locked(label)
            self._m["entries"].set(len(self._entries))
        self.store.delete([label, *dropped])

    def _lead_or_wait(self, probe: Entry, wanted: Callable[[], bool] | None
                      ) -> Entry | threading.Event | None:
        """The entry holding `probe`'s answer (`_held_answer`); else, when no identical Store
        is in flight, a new flight this Store leads (it writes; `_land` ends it); else None once
        the one in flight ended (asked again: it failed, or its entry went). A herd across
        orchestrators stored at once, before any entry held the prompt: each wrote a row, and
        a kill -9 before a loser's delete left two, the restart kept the newest, and the id
        callers were given went. Raises DeadlineExceeded when `wanted` says no meanwhile."""
        key = _flight_key(probe)
        with self._lock:  # one look at both: the flight may land between two
            held = self._held_answer(probe)
            if held is not None:
                return held
            flight = self._flights.get(key)
            if flight is None:
                flight = self._flights[key] = threading.Event()
                return flight
        while not flight.wait(_WAIT_CHECK_S):
            _still(wanted, "the answer was written")
        return None

    def _land(self, probe: Entry, flight: threading.Event) -> None:
        """Ends the flight `_lead_or_wait` gave `probe`'s Store: the identical Stores waiting
        on it look again."""
        with self._lock:
            if self._flights.get(_flight_key(probe)) is flight:
                del self._flights[_flight_key(probe)]
        flight.set()

    def _held_answer(self, probe: Entry) -> Entry | None:
        """The entry of `probe`'s prompt when it already holds `probe`'s answer
        (`_same_answer`) and no Invalidate under way read it: a Store of it writes nothing.
        (It wrote a row and deleted it again once it found the entry standing: a crash between
        the two left the newer row, which a restart keeps, `_newest_rows`, in place of the
        entry its callers had been given.) Two such Stores at once, with no entry yet, write
        once: the second waits for the first (`_lead_or_wait`)."""
        ns, prompt = probe.namespace, probe.prompt
        with self._lock:
            old = self._by_prompt.get((ns, prompt))
            if old is None or any(r.holds(old) for r in self._removing.get(ns, ())):
                return None
            held = self._entries[old]
        return held if _same_answer(held, probe, probe.created_at) else None

    def _check_store(self, ns: Namespace, prompt: str, answer: str, ttl_seconds: int,
                     answer_token_ids: Sequence[int]) -> Namespace:
        """`store_entry`'s checks of what it was given (InvalidArgument naming the field);
        returns the namespace checked."""
        ns = self._check_namespace(ns)
        self._check_text("prompt", prompt, self.cfg.max_text_chars)
        self._check_text("answer", answer, self.cfg.max_answer_chars)
        if ttl_seconds < 0 or ttl_seconds > self.cfg.max_ttl_seconds:
            raise InvalidArgument("ttl_seconds", f"must be in [0, {self.cfg.max_ttl_seconds}]")
        answer_bytes = len(answer.encode("utf-8", "surrogatepass"))
        if len(answer_token_ids) > answer_bytes + 1:
            # A byte-level tokenizer gives each token at least one byte of text, and the end of
            # sequence none: more ids than that are not this answer's.
            raise InvalidArgument(
                "answer_token_ids", f"{len(answer_token_ids)} token ids for an answer of "
                f"{answer_bytes} UTF-8 bytes: at most one per byte, and an end of sequence")
        if any(t < 0 or t >= 1 << 32 for t in answer_token_ids):
            raise InvalidArgument("answer_token_ids", "token ids must be in [0, 2^32)")
        return ns

    def _make_room_locked(self, ns: Namespace, now: float, dropped: list[int]
                          ) -> tuple[int, int]:
        """Drops what the namespace, its tenant and the cache hold past capacity (`dropped`
        gets their labels); returns how many were evicted and how many expired."""
        victims = self._victims_locked(ns)
        expired = 0
        if victims:
            # Past capacity: entries already expired (the housekeeper purges them every
            # expiry_interval_s) go first. By LRU alone a live answer was evicted while a
            # dead one kept its slot. (Those an expire under way took off the heap count as
            # gone in `_victims_locked`: that expire drops them.)
            due = [lab for _, lab in self._due_locked(now)]
            for lab in due:
                self._drop_locked(lab)
                dropped.append(lab)
            expired = len(due)
            self._expired += expired
            if due:
                victims = self._victims_locked(ns)
        for lab in victims:
            self._drop_locked(lab)
            dropped.append(lab)
        self._evicted += len(victims)
        return len(victims), expired

    def _due_locked(self, now: float) -> list[tuple[float, int]]:
        """Pops the expiry heap's due items; those whose entry they still stand for (gone:
        evicted, replaced, invalidated; or not this item's entry: skipped)."""
        heap, out = self._expiry_heap, []
        while heap and heap[0][0] <= now:
            at, lab = heapq.heappop(heap)
            self._expiry_examined += 1
            e = self._entries.get(lab)
            if e is not None and e.expires_at() == at:
                out.append((at, lab))
        return out

    def _add_locked(self, e: Entry, vec: np.ndarray) -> None:
        index = self._indexes.get(e.namespace)
        if index is None:
            index = self._indexes[e.namespace] = NamespaceIndex(self._params)
            self._ns_lru[e.namespace] = OrderedDict()
        index.add(e.label, vec)
        self._entries[e.label] = e
        at = e.expires_at()
        if at < math.inf:
            heapq.heappush(self._expiry_heap, (at, e.label))
        self._by_id[e.id] = e.label
        self._by_prompt[(e.namespace, e.prompt)] = e.label
        self._ns_lru[e.namespace][e.label] = None
        self._top_label = max(self._top_label, e.label)
        self._tenant_lru.setdefault(e.namespace.tenant, OrderedDict())[e.label] = None
        self._dirty.add(e.namespace.tenant)

    def _mark_expiring_locked(self, label: int, way: int) -> None:
        """Marks a held entry as taken by an expire under way (`way` 1), or unmarks it (-1;
        nothing when it is not marked)."""
        if (way > 0) == (label in self._expiring):
            return
        e = self._entries[label]
        if way > 0:
            self._expiring.add(label)
        else:
            self._expiring.remove(label)
        self._expiring_ns[e.namespace] += way
        self._expiring_tenant[e.namespace.tenant] += way
        self._dirty.add(e.namespace.tenant)
        if not self._expiring_ns[e.namespace]:
            del self._expiring_ns[e.namespace]
        if not self._expiring_tenant[e.namespace.tenant]:
            del self._expiring_tenant[e.namespace.tenant]

    def _drop_locked(self, label: int) -> Entry | None:
        if label in self._expiring:
            self._mark_expiring_locked(label, -1)
        e = self._entries.pop(label, None)
        if e is None:
            return None
        self._by_id.pop(e.id, None)
        if self._by_prompt.get((e.namespace, e.prompt)) == label:
            del self._by_prompt[(e.namespace, e.prompt)]
        ns_lru = self._ns_lru.get(e.namespace)
        if ns_lru is not None:
            ns_lru.pop(label, None)
        t_lru = self._tenant_lru.get(e.namespace.tenant)
        self._dirty.add(e.namespace.tenant)
        if t_lru is not None:
            t_lru.pop(label, None)
            if not t_lru:
                del self._tenant_lru[e.namespace.tenant]
        index = self._indexes.get(e.namespace)
        if index is not None:
            index.remove(label)
            if len(index) == 0:
                del self._indexes[e.namespace]
                del self._ns_lru[e.namespace]
                self._retired = [i for i in self._retired if i.merging]
                if index.merging:
                    self._retired.append(index)
        return e

    def _victims_locked(self, ns: Namespace) -> list[int]:
        """Least recently used labels beyond the namespace's, the tenant's and the global
        capacity. Entries an expire under way took off the heap (`_expiring`) count as gone
        and are never chosen: that expire drops them. (Chosen by LRU alone, a live entry was
        evicted beside them while their delete ran; purged here instead, a Store past
        capacity dropped the expire's whole batch in one hold of the lock, every lookup
        waiting, and deleted their rows a second time.)"""
        out = self._ns_excess_locked(ns)
        out += self._tenant_excess_locked(ns.tenant, out)
        return out + self._global_excess_locked(out)

    def _tenant_excess_locked(self, tenant: str, chosen: list[int]) -> list[int]:
        """The tenant's least recently used labels, besides `chosen`, beyond its quota."""
        quota = self.cfg.max_entries_per_tenant
        lru = self._tenant_lru.get(tenant)
        if quota <= 0 or lru is None:
            return []
        skip = set(chosen)
        # Counted over `chosen` (few), not over the tenant's LRU (up to millions).
        over = (len(lru) - sum(1 for x in skip if x in lru) - self._expiring_tenant[tenant]
                - quota)
        if over <= 0:
            return []
        going = self._expiring
        return list(itertools.islice((x for x in lru if x not in skip and x not in going),
                                     over))

    def _ns_excess_locked(self, ns: Namespace) -> list[int]:
        """The namespace's least recently used labels beyond its capacity."""
        lru = self._ns_lru.get(ns, OrderedDict())
        over = len(lru) - self._expiring_ns[ns] - self.cfg.max_entries_per_namespace
        if over <= 0:
            return []
        going = self._expiring
        return list(itertools.islice((x for x in lru if x not in going), over))

    def _global_excess_locked(self, chosen: list[int]) -> list[int]:
        """Labels beyond the global capacity, besides `chosen` (already going): each the least
        recently used of the tenant that holds the most entries at that point. (A global LRU
        let one tenant storing distinct prompts without end evict every other tenant's
        answers; now it evicts its own once it holds the most.)"""
        self._settle_levels()  # at each Store: a few tenants, not all at once
        over = (len(self._entries) - len(chosen) - len(self._expiring)
                - self.cfg.max_entries_total)
        if over <= 0:
            return []
        skip = set(chosen)
        held = self._candidates_locked(over, skip)
        going = self._expiring
        order = {t: iter(self._tenant_lru[t]) for t in held}

        def head(t: str) -> tuple | None:
            """The tenant's next victim, keyed: most entries first, then least recently used
            (between tenants holding as many, the global LRU order as before)."""
            lab = next((x for x in order[t] if x not in skip and x not in going), None)
            if lab is None:
                return None
            e = self._entries[lab]
            return (-held[t], e.used_at(), lab, t)

        # A heap: a restart under a lowered limit takes many victims over many tenants, and a
        # scan of every tenant per victim took seconds.
        heap = [h for t in order if (h := head(t)) is not None]
        heapq.heapify(heap)
        out: list[int] = []
        while len(out) < over and heap:
            _, _, lab, t = heapq.heappop(heap)
            out.append(lab)
            held[t] -= 1
            if (h := head(t)) is not None:
                heapq.heappush(heap, h)
        return out

    def _candidates_locked(self, over: int, skip: set[int]) -> dict[str, int]:
        """The tenants that can lose one of `over` victims, with the entries each holds less
        `skip` and those expiring. Each victim comes from a tenant holding the most at that
        point, which is at least one less than before it: a tenant more than `over` below the
        largest never loses one. Nor does one with `over` others holding as many whose oldest
        entries are older: each of those goes first (their number and oldest entry hold
        until one loses an entry), so only those `over` of each count are read, besides
        the tenants losing `skip`. (All of a count were: 20,000 tenants tied, ~47 ms a Store
        at capacity, under the lock.)"""
        skipped = Counter(self._entries[lab].namespace.tenant for lab in skip)
        held = {t: self._level_of[t] - n for t, n in skipped.items()}
        if over * over > len(self._level_of):  # many victims (a lowered limit at start)
            held = {**self._level_of, **held}
            floor = max(held.values(), default=0) - over + 1
            return {t: n for t, n in held.items() if n >= floor}
        # The most any other tenant holds, where it can matter.
        at = Counter(self._level_of[t] for t in skipped)
        theirs = max(held.values(), default=0)
        top = max(self._level_size, default=0)
        most = next((c for c in range(top, max(theirs - over, 0), -1)
                     if self._level_size[c] > at[c]), 0)
        floor = max(most, theirs) - over + 1
        held = {t: n for t, n in held.items() if n >= floor}
        for c in range(most, max(floor, 1) - 1, -1):
            held.update((t, c) for t in self._oldest_at_locked(c, over, skipped))
        return held

    def _oldest_at_locked(self, count: int, k: int, besides: Counter[str]) -> list[str]:
        """The `k` tenants holding `count` entries (not `besides`) whose oldest are oldest."""
        heap = self._levels.get(count, [])
        kept: list[tuple[float, int, str]] = []
        seen: set[str] = set()
        out: list[str] = []
        while heap and len(out) < k:
            item = heapq.heappop(heap)
            t = item[2]
            if (t in seen or self._level_of.get(t) != count
                    or self._head_item(t) != item):  # a copy, or stale
                self._level_items -= 1
                continue
            kept.append(item)
            seen.add(t)
            if t not in besides:
                out.append(t)
        for item in kept:
            heapq.heappush(heap, item)
        return out

    def _head_item(self, tenant: str) -> tuple[float, int, str]:
        """The tenant's least recently used entry, not expiring, as a `_levels` item."""
        lab = next(x for x in self._tenant_lru[tenant] if x not in self._expiring)
        e = self._entries[lab]
        return (e.used_at(), lab, tenant)

    def _settle_levels(self) -> None:
        """Brings `_level_of`, `_level_size` and `_levels` up to date for the tenants changed
        since (`_dirty`); builds `_levels` again once most of its items are stale."""
        for t in self._dirty:
            n = self._level_of.pop(t, 0)
            if n:
                self._level_size[n] -= 1
                if not self._level_size[n]:
                    del self._level_size[n]
            lru = self._tenant_lru.get(t)
            n = len(lru) - self._expiring_tenant[t] if lru else 0
            if n > 0:
                self._level_of[t] = n
                self._level_size[n] += 1
                heapq.heappush(self._levels.setdefault(n, []), self._head_item(t))
                self._level_items += 1
        self._dirty.clear()
        if self._level_items > 2 * len(self._level_of) + 64:
            self._levels = {}
            for t, n in self._level_of.items():
                self._levels.setdefault(n, []).append(self._head_item(t))
            for heap in self._levels.values():
                heapq.heapify(heap)
            self._level_items = len(self._level_of)

    # ---- lifecycle --------------------------------------------------------------------------

    def get(self, entry_id: str) -> Entry:
        """Raises NotFound for an unknown id."""
        label = self._by_id.get(entry_id) if entry_id else None
        # One read each: a concurrent Invalidate, eviction or expiry may drop the entry between
        # a membership check and a second read (a KeyError, INTERNAL to the caller).
        e = self._entries.get(label) if label is not None else None
        if e is None:
            raise NotFound(f"id: no entry {shown(entry_id)}")
        return e

    def verify(self, entry_id: str, verified: bool,
               wanted: Callable[[], bool] | None = None) -> Entry:
        """Sets the human-verified flag (durably). `wanted`: as in `store_entry`, asked right
        before the write and again once it is written: False then writes the old flag back
        (memory never held the new one), so a caller told DEADLINE_EXCEEDED leaves the
        thresholds its entry is served at as they were (unless the disk refuses that write:
        the new flag then stands, in memory too, and the disk's error is raised). A deadline
        that passes after the second ask, as the answer travels, is the caller's alone: the
        new flag stands and the caller sees DEADLINE_EXCEEDED (it asks again to know).

        Raises:
            InvalidArgument: empty id. NotFound: unknown id. DeadlineExceeded: not wanted.
        """
        if not entry_id:
            raise InvalidArgument("id", "required")
        e = self.get(entry_id)
        if e.expired(self.clock()):
            # Gone to every lookup; only the housekeeper's purge had not come yet, and Verify
            # wrote to a row about to be deleted, saying OK.
            raise NotFound(f"id: entry {shown(entry_id)} has expired")
        # Verify calls run one at a time, SQLite then memory: interleaved, memory could say one
        # thing and the row (after a restart) the other. Not under the cache lock, which every
        # lookup takes: it is never held across a SQLite write.
        with self._verify_lock:
            _still(wanted, "the rating was written")
            with self._lock:
                was = self._entries.get(e.label)
            if was is None:
                raise NotFound(f"id: no entry {shown(entry_id)}")
            self.store.set_verified(e.label, verified)
            try:
                # Asked again, as Store asks: the write waits for the store's lock behind
                # every Store and flush, and a flag set after the caller was told
                # DEADLINE_EXCEEDED changed the threshold every lookup of it is held to.
                _still(wanted, "the rating was written")
            except DeadlineExceeded:
                self._write_back(e, was.verified, verified)
                raise
            return self._take_flag(e, verified)

    def _take_flag(self, e: Entry, verified: bool) -> Entry:
        """Memory takes the verified flag `e`'s row now holds (`verify`); NotFound when the
        entry went meanwhile."""
        with self._lock:
            cur = self._entries.get(e.label)
            if cur is None:
                raise NotFound(f"id: no entry {shown(e.id)}")
            cur = replace(cur, verified=verified)
            self._entries[e.label] = cur
        return cur

    def _write_back(self, e: Entry, old: bool, new: bool) -> None:
        """`verify`'s undo: `e`'s row takes `old` again. Not written (a full disk), the row
        keeps `new`, and memory takes it too: holding `old`, lookups served the entry at one
        threshold and a restart at the other."""
        try:
            self.store.set_verified(e.label, old)
        except BaseException:
            with contextlib.suppress(NotFound):
                self._take_flag(e, new)
            raise

    def invalidate_id(self, entry_id: str, wanted: Callable[[], bool] | None = None) -> int:
        """Removes one entry (e.g. after feedback that its answer was wrong). `wanted`: as in
        `store_entry`, asked right before the delete, and not after it: a removal is erasure
        on request, harmless when late, and never undone (putting a bad answer back to honour
        a deadline would serve it again); a caller told DEADLINE_EXCEEDED that retries is
        told NOT_FOUND once it is gone.

        Raises:
            InvalidArgument: empty id. NotFound: unknown id, or an entry expired (gone to
                every lookup; the housekeeper's purge removes it and counts it expired, as
                `verify` says). DeadlineExceeded: not wanted.
        """
        if not entry_id:
            raise InvalidArgument("id", "required")
        try:
            return self._invalidate_id(entry_id, wanted)
        except NotFound:
            # A repeat of an Invalidate whose WAL emptying failed (a backup reading, a full
            # disk) finds no entry: it empties the WAL still holding the row's text, where it
            # had returned with the text left there.
            if self.store.wal_owed:
                self.store.truncate_wal()
            raise

    def _invalidate_id(self, entry_id: str, wanted: Callable[[], bool] | None) -> int:
        """`invalidate_id` of a non-empty id."""
        e = self.get(entry_id)
        if e.expired(self.clock()):
            # Removed here, it read "removed 1": Feedback answered a bad rating of an answer
            # already expired "invalidated" (its docs: false for an entry expired), and
            # expirations_total never counted it.
            raise NotFound(f"id: entry {shown(entry_id)} has expired")
        _still(wanted, "the removal was written")
        def held() -> list[int]:
            return [e.label] if e.label in self._entries else []

        with self._removal(e.namespace, held, whole=False) as labels:
            if not labels:  # gone since `get` (replaced, evicted, expired, invalidated)
                raise NotFound(f"id: no entry {shown(entry_id)}")
            self.store.delete(labels)
            with self._lock:
                n = 1 if self._drop_locked(e.label) is not None else 0
                self._m["entries"].set(len(self._entries))
        # A bad answer removed on request: its text is overwritten in the file (secure_delete)
        # but stayed in semantic.db-wal, as written, until later writes overwrote it.
        self.store.truncate_wal()
        return n

    @contextlib.contextmanager
    def _removal(self, ns: Namespace, read: Callable[[], list[int]],
                 whole: bool) -> Iterator[list[int]]:
        """An Invalidate of `ns`'s entries `read()` (read under the lock): from SQLite, then
        memory. Meanwhile a Store that would replace one of them waits. It dropped the entry
        between the read and the removal, and the Invalidate counted it as not there
        (removed=0 while the namespace held an answer to that prompt throughout: a count no
        order of the two calls gives). Only such a Store waits, and only for the Invalidates
        that read its entry: Stores of other prompts, or a stream of Invalidates, held every
        Store into the namespace. Expiry and evictions may still take an entry read meanwhile;
        they count it.

        `whole`: `read()` is every entry of `ns` in memory, told apart by label (at most the
        highest memory held: O(1) under the lock, where a set of a 200k-entry namespace's
        labels took ~10 ms of it). An entry of a lower label that a slower Store added after
        the read reads as read too: its replacement waits for this Invalidate for nothing."""
        with self._lock:
            labels = read()
            reading = (None if not labels else _Reading(self._top_label) if whole
                       else _Reading(labels[0], only=True))
            if reading is not None:
                self._removing.setdefault(ns, []).append(reading)
        try:
            yield labels
        finally:
            if reading is not None:
                with self._lock:
                    under_way = self._removing[ns]
                    under_way.remove(reading)  # by identity
                    if not under_way:
                        del self._removing[ns]
                    self._removed.notify_all()

    def invalidate_namespace(self, ns: Namespace) -> int:
        """Removes every entry of a namespace; returns how many were live. An entry already
        past its TTL (never served; the housekeeper had not purged it yet) is removed too but
        counted expired, as the purge would have, not invalidated: Invalidate by id calls such
        an entry NOT_FOUND, and the two must agree on what was invalidated. The WAL, which
        held the removed rows' text as written, is emptied afterwards (`truncate_wal`)."""
        ns = self._check_namespace(ns, erasing=True)
        n = self._invalidate_namespace(ns)
        self.store.truncate_wal()
        return n

    def _invalidate_namespace(self, ns: Namespace) -> int:
        """`invalidate_namespace` of a checked namespace, leaving the WAL as it is."""
        with self._removal(ns, lambda: list(self._ns_lru.get(ns, ())), whole=True) as labels:
            with self._lock:
                index = self._indexes.get(ns)
            # Its tombstones pass a quarter of the entries long before the end, and would start
            # a rebuild of an index about to be emptied and thrown away.
            held = index.merges_held() if index is not None else contextlib.nullcontext()
            gone: list[int] = []
            try:
                self.store.delete(labels, gone)
            finally:
                # What left SQLite leaves memory: all of it, or after a failure past the first
                # chunk (a full disk) the rows already deleted, which were served until the
                # next restart; a retry of the Invalidate removes the rest.
                with held:
                    n = self._drop_in_chunks(gone, expired_at=self.clock())
        if index is not None and index.kind == "hnsw":
            with self._lock:
                if ns not in self._indexes:
                    # Its graph, in a saved snapshot, holds every erased entry's embedding
                    # until the next save (snapshot_interval_s, 600 s, or the stop): the
                    # housekeeper saves at its next tick instead (`take_save_request`). The
                    # save writes the manifest and the graphs merged since the last one.
                    self._save_requested = True
        return n

    def take_save_request(self) -> bool:
        """Whether an Invalidate emptied a namespace that had an HNSW graph since the last call
        (the housekeeper then saves the snapshot at once, dropping the graph's files)."""
        with self._lock:
            asked, self._save_requested = self._save_requested, False
        return asked

    def invalidate_tenant(self, tenant: str) -> int:
        """Removes every entry of `tenant` on this shard, in every namespace (a tenant's data
        deleted on request: a namespace Invalidate needs each model id and context hash, which
        nobody outside the shard can list). Returns how many were live, counted as
        `invalidate_namespace` counts. The rows are overwritten in the database file
        (secure_delete) and the WAL, which held their text too, is emptied afterwards: deleted
        rows stayed readable there (`strings semantic.db-wal`) until later writes overwrote
        them. A Store of the tenant's racing this call may land after it: stop the tenant's
        traffic (remove its token) first."""
        self._check_name("tenant", tenant)  # one that prints as another too (_check_namespace)
        with self._lock:
            spaces = [ns for ns in self._ns_lru if ns.tenant == tenant]
        try:
            n = sum(self._invalidate_namespace(ns) for ns in spaces)
            self.store.truncate_wal()  # once, after every namespace
        finally:
            # The texts it just looked up, even when the disk failed the erasure (dropping
            # them writes nothing); other tenants' stay for their Stores.
            with self._recent_lock:
                for key in [k for k in self._recent if k[0] == tenant]:
                    del self._recent[key]
        return n

    def _drop_in_chunks(self, labels: list[int], expired_at: float | None = None) -> int:
        """Drops `labels` from memory (already deleted from SQLite), a chunk per lock hold:
        every lookup takes this lock to record itself, and 100k removals take about a second.
        Returns how many were dropped; with `expired_at`, those expired at that time are
        counted as expirations instead and left out of the figure returned."""
        n = expired = 0
        for i in range(0, len(labels), _DROP_CHUNK):
            with self._lock:
                for lab in labels[i:i + _DROP_CHUNK]:
                    e = self._drop_locked(lab)
                    if e is None:
                        continue
                    if expired_at is not None and e.expired(expired_at):
                        expired += 1
                    else:
                        n += 1
                self._expired += expired
                self._m["entries"].set(len(self._entries))
            self._m["expirations"].inc(expired)
            expired = 0
        return n

    def expire(self) -> int:
        """Removes entries past their TTL; returns how many.

        Pops the due items of the expiry heap: the work is the entries that expire (and stale
        items of entries already gone), never the entries held. A scan of every entry, as once
        ran whenever one was due, ran every tick once entries expired under steady traffic.
        """
        now = self.clock()
        with self._lock:
            due = self._due_locked(now)
            labels = [lab for _, lab in due]
            for lab in labels:
                self._mark_expiring_locked(lab, 1)
        gone: list[int] = []
        try:
            self.store.delete(labels, gone)
        finally:
            # What left SQLite leaves memory (after a failure, the rows deleted before it);
            # the rest are due again at the next tick.
            n = self._drop_in_chunks(gone)
            with self._lock:
                self._expired += n
                if len(gone) < len(labels):
                    # Their delete failed: held again, not expiring (what was dropped unmarked
                    # itself). A Store past capacity meanwhile counted them as gone, so the
                    # cache may hold more than its limits until they go: they are expired
                    # (never served), and the next Store past capacity or tick purges them.
                    done = set(gone)
                    for item in due:
                        if item[1] not in done:
                            self._mark_expiring_locked(item[1], -1)
                            heapq.heappush(self._expiry_heap, item)
            self._m["expirations"].inc(n)
        if gone or self.store.wal_owed:
            # Past its TTL an answer is gone from the file (secure_delete), and from the WAL
            # only once emptied: its text stayed in semantic.db-wal until overwritten. Owed:
            # an erasing call's emptying had not finished, and nobody repeated the call.
            self.store.truncate_wal()
        self._compact_expiry_heap()
        return n

    def _compact_expiry_heap(self) -> None:
        """Drops the items of entries no longer held once they outnumber the entries: evictions
        and replacements leave their items behind, and with day-long TTLs a churning cache
        would otherwise hold one per Store of the last day. The filtering runs outside the
        lock (every lookup takes it); items pushed meanwhile are merged back in."""
        with self._lock:
            if len(self._expiry_heap) <= 2 * len(self._entries) + _EXPIRY_HEAP_SLACK:
                return
            old, self._expiry_heap = self._expiry_heap, []
        entries = self._entries
        kept = [(at, lab) for at, lab in old
                if (e := entries.get(lab)) is not None and e.expires_at() == at]
        del old
        kept.sort()  # a sorted list is a heap
        with self._lock:
            for item in self._expiry_heap:
                heapq.heappush(kept, item)
            self._expiry_heap = kept

    def load(self, snapshot_path: str = "") -> int:
        """Rebuilds every namespace from SQLite (at start); returns the entries loaded.

        Expired entries are deleted; entries embedded by another model are re-embedded; the
        capacity limits are applied (least recently used go first). `snapshot_path`: a folder
        of saved HNSW graphs (`save_snapshot`), each taken instead of building its namespace's
        graph when it matches the namespace's entries (services/semantic/snapshot.py);
        `graphs_adopted` says how many were.
        """
        groups, stale, replaced = self._rows_at_load(self.clock())
        self._delete_at_load(stale + replaced, "expired or replaced")
        saved = issued = None
        if snapshot_path:
            saved = Saved(snapshot_path, self._params, self._embed_id)
            issued = self.store.labels_issued()
        with self._lock:
            adopted = self._load_namespaces_locked(groups, saved, issued)
            victims = self._evict_at_load_locked()
            self._evicted += len(victims)
            self._expired += len(stale)
            self._expiry_heap = [(e.expires_at(), lab) for lab, e in self._entries.items()
                                 if e.ttl_seconds > 0]
            heapq.heapify(self._expiry_heap)
            self._m["entries"].set(len(self._entries))
        self._m["evictions"].inc(len(victims))
        self._m["expirations"].inc(len(stale))
        self._delete_at_load(victims, "over capacity")
        self.graphs_adopted = adopted
        self._m["graphs_taken"].set(adopted)
        if snapshot_path:
            # The clock of the staleness alert starts here: it read 0 (1970) until the first
            # periodic save, 10 minutes in, and an alert on its age fired at every start.
            self._m["saved_at"].set(time.time())
        log.info("loaded %d entries in %d namespaces (%d expired, %d over capacity, %d replaced "
                 "by a newer answer to the same prompt; %d HNSW graphs taken from the "
                 "snapshot, not built)", len(self._entries), len(self._indexes),
                 len(stale), len(victims), len(replaced), adopted)
        return len(self._entries)

    def _rows_at_load(self, now: float) -> tuple[_Groups, list[int], list[int]]:
        """`load`'s reading of SQLite: the live rows' entries and vectors by namespace (TTLs
        counted from now where stamped ahead of it, and cut to today's limit; vectors of
        another model re-embedded), and the labels of the rows expired and of those replaced
        by a newer row of the same prompt."""
        ahead = self.store.clamp_future(now)
        if ahead:
            log.warning("%d entries were stamped after now (the clock ran ahead when they were "
                        "written): their TTL counts from now", ahead)
        self._cap_ttls_at_load()
        newest, replaced = self._newest_rows()
        stale = [r.label for r in newest.values() if self._expired_row(r, now)]
        live = [r for r in newest.values() if not self._expired_row(r, now)]
        del newest
        self._reembed(live)
        return self._group_rows(live), stale, replaced

    def _load_namespaces_locked(self, groups: _Groups, saved: Saved | None,
                                issued: int | None) -> int:
        """`load`'s step under the lock: each namespace's index and entries, least recently
        used first; returns the saved graphs taken. Empties `groups` as it goes."""
        adopted = 0
        # One namespace at a time, its per-row vectors let go as soon as they are stacked:
        # kept until the end, every row's array stayed alive beside the stacked copy, the
        # index's copy and faiss's copy of each namespace (the peak of a restart).
        for ns in list(groups):
            es, vs = groups.pop(ns)
            vecs = np.stack(vs)
            vs.clear()
            labels = np.array([e.label for e in es], np.int64)
            if self._index_at_load_locked(ns, labels, vecs, saved, issued):
                adopted += 1
            del vecs
            self._ns_lru[ns] = OrderedDict()
            for e in sorted(es, key=Entry.used_at):
                self._entries[e.label] = e
                self._by_id[e.id] = e.label
                self._by_prompt[(ns, e.prompt)] = e.label
                self._ns_lru[ns][e.label] = None
        self._top_label = max(self._top_label, max(self._entries, default=-1))
        return adopted

    def _index_at_load_locked(self, ns: Namespace, labels: np.ndarray, vecs: np.ndarray,
                              saved: Saved | None, issued: int | None) -> bool:
        """`ns`'s index at load: its saved graph taken if it matches the entries (True), else
        built."""
        index = self._indexes[ns] = NamespaceIndex(self._params)
        # A namespace shrunk below `hnsw_min_entries` since the save is built flat
        # (moments), as a merge would build it: its saved graph is not even read.
        got = (saved.take(tuple(ns)) if saved is not None
               and len(labels) >= self._params.hnsw_min_entries else None)
        if got is not None and index.adopt(got[0], got[1], labels, vecs, issued):
            return True
        if got is not None:
            log.warning("the saved HNSW graph of a namespace of tenant %r does not "
                        "match its entries in SQLite (none of its entries is live "
                        "any more, another database, a backup restored since, or "
                        "vectors re-embedded): built again",
                        ns.tenant)
        index.add_many(labels, vecs)
        return False

    def _evict_at_load_locked(self) -> list[int]:
        """`load`'s last step under the lock: the tenants' recency lists, then the entries
        over limits lowered since they were written dropped from memory; returns them."""
        for e in sorted(self._entries.values(), key=Entry.used_at):
            self._tenant_lru.setdefault(e.namespace.tenant, OrderedDict())[e.label] = None
        self._dirty.update(self._tenant_lru)
        # Limits lowered since the entries were written: each namespace's excess first,
        # then what is still over the global limit (choosing both before dropping would
        # count global victims twice and drop more than needed).
        victims = [lab for ns in self._ns_lru for lab in self._ns_excess_locked(ns)]
        for tenant in list(self._tenant_lru):
            victims += self._tenant_excess_locked(tenant, victims)
        victims += self._global_excess_locked(victims)
        for lab in victims:
            self._drop_locked(lab)
        return victims

    def save_snapshot(self, folder: str) -> int:
        """Writes every HNSW namespace's published graph to `folder` (on a clean stop, and
        every `snapshot_interval_s`), for the next `load` to take instead of building it;
        returns the namespaces the snapshot holds. Graphs unchanged since this process's last
        save into `folder` keep their files. Raises OSError (the previous snapshot then stays
        in force)."""
        with self._save_lock:
            items = self._saved_graphs()
            previous = self._saved[1] if self._saved[0] == folder else None
            try:
                state = save_snapshot(folder, self._params, self._embed_id, items, previous)
            except BaseException:
                self._m["saves"].labels("failed").inc()
                raise
            self._m["saves"].labels("ok").inc()
            self._m["saved_at"].set(time.time())
            self._saved = (folder, state)
            return len(state)

    def _saved_graphs(self) -> list[tuple]:
        """(namespace, graph, labels, version) of every namespace with an HNSW graph. The
        namespaces are walked outside the lock (a copy of the map is taken under it): walked
        under it, every Lookup and Store waited for the walk every save (40-47 ms at 300,000
        namespaces, against 12-20 ms for the copy; a shard may hold 2M). A namespace emptied
        meanwhile is left out (its graph is erased, not saved); one merged meanwhile waits
        for the next save."""
        with self._lock:
            held = dict(self._indexes)  # a C-level copy: no tuple per namespace
        found = [(ns, index, g) for ns, index in held.items()
                 if (g := index.saved_graph()) is not None]
        del held
        with self._lock:
            # Its token: a merge publishes a new main, of a new version.
            return [(tuple(ns), main, labels, version)
                    for ns, index, (main, labels, version) in found
                    if self._indexes.get(ns) is index]

    def unsaved_namespaces(self) -> tuple[int, int]:
        """Namespaces a snapshot does not hold, for the stop's line: (searched flat, under
        `hnsw_min_entries`: rebuilt at start in moments; past it but not yet merged into a
        graph: built at the next start)."""
        flat = unmerged = 0
        with self._lock:
            for index in self._indexes.values():
                if index.kind != "hnsw":
                    if len(index) < self._params.hnsw_min_entries:
                        flat += 1
                    else:
                        unmerged += 1
        return flat, unmerged

    def _cap_ttls_at_load(self) -> None:
        """Writes today's TTL limit (`_loaded_ttl`) into the rows over it, so that a cut TTL
        stays cut: kept in memory only, a later start under a higher limit gave it back,
        serving answers that had expired under the cut. On a full disk the rows not yet written
        keep theirs (memory still cuts them, and the next start writes the rest)."""
        try:
            self.store.cap_ttls(self.cfg.max_ttl_seconds, self.cfg.default_ttl_seconds > 0)
        except ResourceExhausted as e:
            log.warning("TTLs over today's limit not cut in the database: %s", e)

    def _delete_at_load(self, labels: list[int], what: str) -> None:
        """Deletes rows memory does not load. On a full disk they stay on disk (the next start
        drops them again): a restart must not fail for it, where the running service serves
        lookups on a full disk. Start-up otherwise failed (exit 2) whenever rows had expired
        meanwhile, so the shard never came back."""
        try:
            self.store.delete(labels)
        except ResourceExhausted as e:
            log.warning("%d %s rows left on disk, not loaded: %s", len(labels), what, e)

    def _rewrite_at_load(self, updates: list[tuple[int, np.ndarray, str]]) -> None:
        """Writes re-embedded vectors back; on a full disk memory keeps the new ones and the
        next start embeds those rows again."""
        try:
            self.store.set_embeddings(updates)
        except ResourceExhausted as e:
            log.warning("%d re-embedded vectors not written back: %s", len(updates), e)

    def _newest_rows(self) -> tuple[dict[tuple[Namespace, str], Row], list[int]]:
        """Every stored row, keeping the newest of each (namespace, prompt); and the labels of
        the older ones.

        Two rows of one prompt: a replacing Store that crashed between committing the new row
        and deleting the old one. The newer answer stands, expired or not (an expired newer
        answer must not bring back the one it replaced). Labels grow in commit order, which a
        wall-clock step cannot reorder as it could `created_at`."""
        newest: dict[tuple[Namespace, str], Row] = {}
        replaced: list[int] = []
        for rows in self.store.iter_all():
            for r in rows:
                key = (Namespace(r.tenant, r.model_id, r.context_hash), r.prompt)
                prev = newest.get(key)
                if prev is None or prev.label < r.label:
                    if prev is not None:
                        replaced.append(prev.label)
                    newest[key] = r
                else:
                    replaced.append(r.label)
        return newest, replaced

    def _group_rows(self, rows: list[Row]) -> _Groups:
        """Each namespace's entries and their vectors, in `rows`' order."""
        groups: _Groups = {}
        for r in rows:
            ns = Namespace(r.tenant, r.model_id, r.context_hash)
            es, vs = groups.setdefault(ns, ([], []))
            # No row is stamped after now: `load` clamped those in SQLite before reading.
            es.append(Entry(r.id, r.label, ns, r.prompt, r.answer, r.verified, r.created_at,
                            r.last_hit_at, r.hit_count, self._loaded_ttl(r), r.truncated,
                            answer_tokens=r.answer_tokens))
            vs.append(r.embedding)
        return groups

    def _expired_row(self, r: Row, now: float) -> bool:
        """Expired under its TTL as loaded (`_loaded_ttl`)."""
        ttl = self._loaded_ttl(r)
        return ttl > 0 and now >= r.created_at + ttl

    def _loaded_ttl(self, r: Row) -> int:
        """A row's TTL under today's limits. One stored under a larger limit (an older version,
        or a lowered setting) keeps at most today's `max_ttl_seconds` (past the API's uint32,
        every hit on it failed). One stored to never expire (0, under a default of 0) gets
        that limit too once today's default expires entries: else entries of a no-TTL past
        could never age out."""
        cap = self.cfg.max_ttl_seconds
        if r.ttl_seconds > 0:
            return min(r.ttl_seconds, cap)
        return cap if self.cfg.default_ttl_seconds > 0 else 0

    def _reembed(self, rows: list[Row]) -> None:
        """Re-embeds the rows of another embedder and normalises vectors that are not unit
        length, in memory and in SQLite. The writes go in batches of `WRITE_CHUNK` rows per
        transaction: one commit (an fsync) per row made a restart after a model change take
        minutes at 100k entries."""
        old = [r for r in rows if not same_vectors(r.embed_model, self._embed_id)
               or r.embedding.shape != (self.embedder.dim,)]
        if old:
            # Minutes to hours at a full shard (200k entries on 2 cores: 16 min at 208 short
            # prompts/s, 1.8 h at 31 long ones/s, measured):
            # said up front and as it goes, or a pod not yet serving looks hung.
            log.info("re-embedding %d entries stored by %s with %s (the service starts serving "
                     "once done; progress is kept across restarts)", len(old),
                     ", ".join(sorted({r.embed_model for r in old})) or "?", self._embed_id)
        t0 = time.monotonic()
        updates: list[tuple[int, np.ndarray, str]] = []
        for i in range(0, len(old), 64):
            chunk = old[i:i + 64]
            vecs = self.embedder.embed([r.prompt for r in chunk])
            for r, v in zip(chunk, vecs, strict=True):
                r.embedding, r.embed_model = v, self._embed_id
                updates.append((r.label, v, self._embed_id))
            if len(updates) >= WRITE_CHUNK:  # written as it goes: a restart keeps the work
                self._rewrite_at_load(updates)
                updates = []
                done, took = i + len(chunk), time.monotonic() - t0
                log.info("re-embedded %d of %d entries (%.0f%%) in %.0f s, ~%.0f s left", done,
                         len(old), 100 * done / len(old), took, took / done * (len(old) - done))
        self._rewrite_at_load(updates)
        if old:
            log.info("re-embedded %d entries with %s in %.0f s", len(old), self.embedder.name,
                     time.monotonic() - t0)
        # Rows stored before every vector was made unit length (a folder without a Normalize
        # module gave norms of 5-7): the index's inner product over them read as similarity
        # 1.0 for unrelated questions. Normalised once, and written back.
        fixed = 0
        for i in range(0, len(rows), WRITE_CHUNK):
            chunk = rows[i:i + WRITE_CHUNK]
            vecs = np.stack([r.embedding for r in chunk])
            norms = np.linalg.norm(vecs, axis=1)
            bad = np.flatnonzero((np.abs(norms - 1.0) > 1e-3) & (norms > 0))
            if not len(bad):
                continue
            unit = (vecs[bad] / norms[bad, None]).astype(np.float32)
            updates = []
            for j, v in zip(bad, unit, strict=True):
                r = chunk[j]
                r.embedding = v
                updates.append((r.label, v, r.embed_model))
            self._rewrite_at_load(updates)
            fixed += len(bad)
        if fixed:
            log.info("normalised %d stored vectors to unit length", fixed)

    def index_of(self, ns: Namespace) -> NamespaceIndex | None:
        """The namespace's index (benchmarks and tests)."""
        return self._indexes.get(ns)

    def close_indexes(self, timeout: float = 20.0) -> bool:
        """Waits up to `timeout` in all for running index merges to finish (shutdown); starts
        no more. False if one is still running (the process must then exit without
        finalizing: a thread still inside faiss aborts the interpreter's exit)."""
        with self._lock:
            indexes = list(self._indexes.values()) + self._retired
        end = time.monotonic() + timeout
        for index in indexes:
            index.close(max(0.0, end - time.monotonic()))
        return not any(index.merging for index in indexes)

    def stats(self) -> CacheStats:
        with self._lock:
            lat = np.array(self._latency) if self._latency else np.zeros(1)
            return CacheStats(len(self._entries), len(self._indexes), self._lookups,
                              dict(self._hits), self._near, self._guarded, self._evicted,
                              self._expired, float(np.percentile(lat, 50)),
                              float(np.percentile(lat, 99)), self.embedder.name)

    def check_integrity(self) -> None:
        """Raises AssertionError unless maps, LRU lists and indexes agree."""
        with self._lock:
            assert {t: set(lru) for t, lru in self._tenant_lru.items()} == {
                t: {lab for lab, e in self._entries.items() if e.namespace.tenant == t}
                for t in {e.namespace.tenant for e in self._entries.values()}}, "tenant LRU"
            assert {e.id: lab for lab, e in self._entries.items()} == self._by_id
            assert {(e.namespace, e.prompt): lab
                    for lab, e in self._entries.items()} == self._by_prompt, "prompt map"
            total = 0
            for ns, index in self._indexes.items():
                index.check_integrity()
                labels = set(self._ns_lru[ns])
                assert labels == {lab for lab, e in self._entries.items() if e.namespace == ns}
                assert len(index) == len(labels), f"{ns}: index size != entries"
                total += len(labels)
            assert total == len(self._entries)
            assert self._expiring <= self._entries.keys(), "expiring entries not held"
            going = [self._entries[lab].namespace for lab in self._expiring]
            assert self._expiring_ns == Counter(going), "expiring per namespace"
            assert self._expiring_tenant == Counter(ns.tenant for ns in going), "per tenant"
            self._settle_levels()
            held = {t: len(lru) - self._expiring_tenant[t] for t, lru in self._tenant_lru.items()}
            assert self._level_of == {t: n for t, n in held.items() if n}, "held per tenant"
            assert self._level_size == Counter(self._level_of.values()), "tenants per count"
            assert all(self._head_item(t) in self._levels[n] for t, n in self._level_of.items())
            # Entries an expire under way is dropping count as gone (`_victims_locked`), and
            # expired ones too: one whose delete failed stays (never served) until purged.
            now = self.clock()
            dead = sum(1 for lab, e in self._entries.items()
                       if lab not in self._expiring and e.expired(now))
            assert (len(self._entries) - len(self._expiring) - dead
                    <= self.cfg.max_entries_total), "entries past the global capacity"
