"""Orchestrator configuration (env `TIERCACHE_ORCHESTRATOR_<FIELD>`, flags `--field-name`)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from services.common.config import (
    moved,
    require,
    require_addresses,
    require_listen_address,
    require_model_id,
    require_shard_list,
)
from services.common.model_store import MODEL_SPEC_RULE
from services.orchestrator.tenants import parse_token_pairs

SVC = "orchestrator"


# Worker threads never taken by Generate streams or Warm calls (health probes, Stats, Feedback).
STREAM_HEADROOM = 8

@dataclass(frozen=True)
class OrchestratorConfig:
    """Settings of the public service. Addresses are host:port."""

    # host:port the public gRPC service listens on (0 = any free port).
    address: str = "127.0.0.1:50051"
    # Prometheus /metrics and /healthz port; -1 = off, 0 = any free port.
    metrics_port: int = 9101
    # Credential sent to internal services (semantic, prefix, kvpool); "" = none.
    internal_token: str = ""
    # KvPool replicas to route to.
    kvpool_addresses: tuple[str, ...] = ("127.0.0.1:50054",)
    # Semantic cache: one address or comma-separated shards (by namespace); "" = tier off.
    semantic_address: str = ""
    # Prefix index shards; empty = no index (ring routing only).
    prefix_addresses: tuple[str, ...] = ()
    # Model whose tokenizer and chat template render prompts ("smollm2" or an HF folder).
    model: str = "smollm2"
    # Model id override; "" = the id resolve_model reports (must match the replicas').
    model_id: str = ""
    # Where converted models are cached (as kvpool's cache_dir); empty = $TIERCACHE_CACHE_DIR or
    # ~/.cache/tiercache.
    cache_dir: str = ""
    # Tokens per KV block (must match kvpool and the index).
    block_size: int = 16
    # Bearer tokens: a file (JSON {"token": {"tenant": ..., limits...}}) and/or "tok=tenant,..."
    tokens_file: str = ""
    # "token=tenant,..." pairs, beside or instead of tokens_file; "" = none.
    tokens: str = ""
    # How often the tokens file is checked for changes and read again (0 = once, at start: a
    # token removed from it then works until the orchestrator restarts).
    tokens_reload_s: float = 5.0
    # Defaults and limits per request.

    # max_tokens of a request that sets none (0), capped by its tenant's limit and by what
    # the model's context leaves.
    default_max_tokens: int = 256
    # Largest max_tokens a request may ask for (INVALID_ARGUMENT past it); tenants may have less.
    # At most the replicas' max_new_tokens_limit (2048 by default): past theirs the replica
    # refuses the request ("must be <= 2048") though this limit allowed it.
    max_tokens_limit: int = 2048
    # Longest rendered prompt, in tokens (INVALID_ARGUMENT past it); tenants may have less
    # (RESOURCE_EXHAUSTED past theirs).
    max_prompt_tokens: int = 8192
    # Longest message content or raw prompt, in characters (INVALID_ARGUMENT past it).
    max_message_chars: int = 100_000
    # Largest request message the server reads (a Generate's messages, a Warm's prompts). Past
    # it gRPC refuses the call before anything is parsed, in its own words, which name no
    # setting: RESOURCE_EXHAUSTED "SERVER: Received message larger than max (<request bytes>
    # vs. <this limit>)", logged nowhere (the CLI names this setting beside it). At gRPC's 16
    # MiB a request of 7.5 M empty messages took 1.2 s and 420 MB to parse, only to be
    # refused. Raise it with max_prompt_tokens (about 4 bytes a token is ample for text).
    max_request_bytes: int = 4 * 1024 * 1024
    # Concurrent requests of a tenant without a limit of its own. 0 = automatic: 16 with
    # tenant tokens (under max_streams, 56 by default: one tenant must not take every stream
    # slot), and every slot without them (one tenant, every caller).
    max_concurrent_per_tenant: int = 0
    # Deadline for a whole Generate: when the client sets none, and the most a client's own
    # deadline gets (a longer one is cut to this; the client then sees DEADLINE_EXCEEDED).
    # Then the per-hop budgets.
    request_timeout_s: float = 300.0
    # Most one semantic call may take (a lookup gets at most a quarter of the time the request
    # has left, the Store after the answer half).
    semantic_timeout_s: float = 2.0
    # Most a prefix index Match may take (and at most a quarter of the time the request has
    # left).
    prefix_timeout_s: float = 0.5
    # Semantic tier defaults.

    # The tier of a request whose cache_policy names none (strict, standard or relaxed).
    semantic_tier: str = "standard"
    # Send semantic near-misses to replicas as drafts (cache-assisted generation).
    enable_drafts: bool = True
    # Store answers of sampled (temperature > 0) requests in the semantic tier too.
    store_sampled: bool = False
    # Serve semantic hits to sampled (temperature > 0) requests too (CachePolicy.serve_sampled
    # per request). Off: they get the model's own sample, the hit as its draft.
    serve_sampled: bool = False
    # Coalesce identical greedy requests in flight together: the first runs the model, the
    # others (same tenant, prompt and sampling; caches not skipped) read its tokens as they
    # come instead of calling a replica (CacheReport.coalesced_with). Off: each runs its own.
    coalesce: bool = True
    # How requests choose a replica: by matched prefix against load, or round robin.
    routing_policy: str = "prefix"  # "prefix" or "round_robin" (a baseline for benchmarks)
    # Bounded-load slack: a replica past (1 + epsilon) x the mean load is skipped.
    routing_epsilon: float = 0.25
    # Time constant of the decaying count of requests routed to each replica; routing keeps
    # each replica's share of new conversations within (1 + routing_epsilon) / n (later
    # turns stay with their replica; see routing.PrefixAwarePolicy).
    routing_load_window_s: float = 30.0
    # A replica running at most this many requests is never over the bounded-load cap (with
    # many replicas and little traffic the cap alone is 0, and prefix holders lost their
    # requests to cold replicas for running one).
    routing_load_floor: int = 2
    # Matched prompt tokens that make a replica a prefix holder worth routing to.
    min_prefix_tokens: int = 32
    # How long routing remembers the prompts it sent to each replica, for requests that share
    # one before the prefix index has learnt it (a long prefill takes seconds); 0 = off.
    dispatch_memory_s: float = 10.0
    # Replica polling (health + load) interval.
    replica_poll_s: float = 1.0
    # A replica's Stats is a read of its last step's figures, answered off the engine thread:
    # ~1 ms at p50 and under 70 ms at worst on a 2-core CPU running three 1,500-token prefills
    # beside two busy processes. A poll unanswered for this long counts as missed; this many
    # missed in a row mark the replica hung (out of routing, its streams fail over), so a
    # replica that stops answering (SIGSTOP, a wedged server) is found in about
    # replica_hung_polls x (replica_stats_timeout_s + replica_poll_s), ~9 s by default.
    replica_stats_timeout_s: float = 2.0
    # Missed Stats polls in a row that mark a replica hung (see above).
    replica_hung_polls: int = 3
    # A replica whose engine has not finished a turn for this long (Stats' stalled_for_s: a
    # stuck step or device) is taken out of routing and its requests in flight fail over; it
    # comes back once it turns again. Above the longest step the model takes (a 512-token
    # prefill chunk of a large model on CPU takes tens of seconds). 0 = off.
    replica_stall_s: float = 60.0
    # Background warm-up: a cycle about every warm_interval_s (each wait drawn within 10% of
    # it, so pods started together drift apart); off when warm_interval_s <= 0 or
    # warm_top_k == 0.
    warm_interval_s: float = 30.0
    # Hot prefixes the loop asks the index for each cycle (0 = loop off).
    warm_top_k: int = 8
    # Mean load (active sequences) per healthy replica at or under which the loop warms (0 =
    # only while no healthy replica has a sequence running).
    warm_max_load: float = 0.25
    # Most prefills the loop sends per cycle.
    warm_max_prompts_per_cycle: int = 4
    # Hits (in the index's half-life) a prefix needs before the loop copies it to replicas
    # that lack it. At 1 a conversation's own history (hit once, by its next turn) was copied
    # to every replica, where session affinity never sends it.
    warm_min_hits: int = 2
    # A Warm call's pin when it gives no pin_ttl_seconds. The background loop pins nothing:
    # its pins counted against each tenant's pin quota and refused the tenant's own Warm.
    warm_pin_ttl_s: int = 600
    # Longest pin a Warm call may ask for (pin_ttl_seconds); longer is INVALID_ARGUMENT. At most
    # the replicas' pin_ttl_max_seconds (3600 by default): they cut a longer pin to theirs, and
    # the Warm call's answer does not say so.
    warm_pin_ttl_max_s: int = 3600
    # Prefills one Warm call may ask for (its prompts and top_k prefixes x their target
    # replicas); more is INVALID_ARGUMENT. 64 prompts on 64 replicas would be 4,096.
    warm_max_prefills_per_call: int = 256
    # Failover attempts per request: replicas that failed it (lost, busy, refused). A replica
    # whose KV pool is too small for it, with a larger one left to try or down, is not one.
    max_attempts: int = 3
    # Server.

    # Worker threads of the gRPC server. A Generate stream (or a Warm call) holds one until it
    # ends: past max_workers - STREAM_HEADROOM they are refused (RESOURCE_EXHAUSTED), so
    # health checks, Stats and Feedback always find a thread. While its replica call runs, a
    # Generate stream also has a thread of its own outside the pool, reading the replica's
    # answer at the replica's pace (a slow client must not hold the replica): at most as many
    # as streams.
    max_workers: int = 64
    # Calls of every kind under way or waiting for a worker thread. Past it gRPC refuses a new
    # call at once (RESOURCE_EXHAUSTED "Concurrent RPC limit exceeded!") rather than queue it
    # without bound behind busy workers: a flood of cheap calls (unauthenticated ones too) is
    # capped in memory, not only refused one by one. Must exceed max_workers, so that streams
    # alone never reach it. 0 = `create_server`'s default, 4 x max_workers.
    max_concurrent_rpcs: int = 0
    # Drain time on SIGTERM: streams under way finish, new calls are refused.
    grace_s: float = 10.0
    # Client connections are closed (GOAWAY) after this long and clients reconnect: behind a
    # Kubernetes Service (balanced per connection) long-lived connections otherwise stay on
    # the pods that existed when they opened, and pods the HPA adds get no traffic. Streams
    # under way finish (grace: request_timeout_s, at least 120 s: a Warm call's longest).
    # 0 = never.
    max_connection_age_s: float = 300.0

    def check_paths(self) -> None:
        """The files this host must have, checked at start before anything binds, naming the
        setting: found only by the build, a missing tokens file or a cache_dir that is a file
        failed with a bare OSError. Apart from `validate`, which judges values alone (a
        manifest's settings are checked where its paths do not exist)."""
        if self.tokens_file:
            path = os.path.expanduser(self.tokens_file)
            require(os.path.isfile(path) and os.access(path, os.R_OK), SVC, "tokens_file",
                    f"{self.tokens_file!r} is no readable file")
        if self.cache_dir:
            path = os.path.expanduser(self.cache_dir)
            require(not os.path.exists(path) or os.path.isdir(path), SVC, "cache_dir",
                    f"{self.cache_dir!r} is not a directory")

    def validate(self) -> None:
        require(-1 <= self.metrics_port <= 65535, SVC, "metrics_port",
                "must be -1 (off), 0 or a port")
        # An empty model read the working directory as a model folder (as kvpool, refused).
        require(bool(self.model.strip()), SVC, "model", MODEL_SPEC_RULE)
        # 0 or less made every replica a prefix holder (routing lost its session ring).
        require(self.min_prefix_tokens >= 1, SVC, "min_prefix_tokens", "must be >= 1")
        try:
            parse_token_pairs(self.tokens)
        except ValueError as exc:
            require(False, SVC, "tokens", str(exc).split(": ", 1)[-1])
        self._check_addresses()
        # As kvpool's (the block hasher's native chain takes at most 2^20, and the replicas'
        # blocks must be the same size anyway).
        require(1 <= self.block_size <= 1024, SVC, "block_size", "must be in 1..1024")
        # kvpool's rules for the same id (the index's at Register and Match).
        require_model_id(self.model_id, SVC)
        self._check_request_limits()
        self._check_timeouts()
        self._check_routing()
        self._check_replica_polls()
        self._check_warming()
        require(self.max_workers > STREAM_HEADROOM, SVC, "max_workers",
                f"must be > {STREAM_HEADROOM} (threads kept for health checks and Stats)")
        require(self.max_concurrent_rpcs == 0 or self.max_concurrent_rpcs > self.max_workers,
                SVC, "max_concurrent_rpcs",
                "must be 0 (4 x max_workers) or > max_workers (streams must not fill it)")

    def _check_addresses(self) -> None:
        """`validate`'s checks of where the orchestrator listens and the shards it dials."""
        require_listen_address(self.address, SVC)
        require(bool(self.kvpool_addresses), SVC, "kvpool_addresses", "at least one replica")
        require_addresses(self.kvpool_addresses, SVC, "kvpool_addresses", allow_none=False)
        require_addresses(self.prefix_addresses, SVC, "prefix_addresses", allow_none=True)
        require_shard_list(self.semantic_address, SVC, "semantic_address")

    def _check_request_limits(self) -> None:
        """`validate`'s checks of how large a request may be and how many a tenant may run."""
        require(0 < self.default_max_tokens <= self.max_tokens_limit, SVC,
                moved(self, "default_max_tokens", "max_tokens_limit")
                if self.default_max_tokens > 0 else "default_max_tokens",
                f"default_max_tokens ({self.default_max_tokens}) must be in (0, "
                f"max_tokens_limit ({self.max_tokens_limit})]")
        # Sent to the replicas in int32 SamplingParams.max_tokens: larger failed every request.
        require(self.max_tokens_limit <= 2**31 - 1, SVC, "max_tokens_limit",
                f"must be at most {2**31 - 1}")
        require(self.max_prompt_tokens > 0, SVC, "max_prompt_tokens", "must be > 0")
        require(self.max_message_chars > 0, SVC, "max_message_chars", "must be > 0")
        require(64 * 1024 <= self.max_request_bytes <= 2**31 - 1, SVC, "max_request_bytes",
                f"must be in [65536, {2**31 - 1}] (gRPC's message size is an int32)")
        require(self.max_concurrent_per_tenant >= 0, SVC, "max_concurrent_per_tenant",
                "must be >= 0 (0 = automatic)")

    def _check_timeouts(self) -> None:
        """`validate`'s checks of the calls' timeouts, the drain, the tokens file's reload and
        the connections' age."""
        require(self.request_timeout_s > 0, SVC, "request_timeout_s", "must be > 0")
        for name in ("semantic_timeout_s", "prefix_timeout_s"):
            require(getattr(self, name) > 0, SVC, name, "must be > 0")
        require(self.grace_s >= 0, SVC, "grace_s", "must be >= 0")
        require(self.tokens_reload_s == 0 or self.tokens_reload_s >= 0.5, SVC, "tokens_reload_s",
                f"must be 0 (read once) or >= 0.5, got {self.tokens_reload_s}")
        require(self.max_connection_age_s >= 0, SVC, "max_connection_age_s", "must be >= 0")

    def _check_routing(self) -> None:
        """`validate`'s checks of the semantic tier asked for and how requests are routed."""
        require(self.semantic_tier in ("strict", "standard", "relaxed"), SVC, "semantic_tier",
                "must be strict, standard or relaxed")
        require(self.routing_policy in ("prefix", "round_robin"), SVC, "routing_policy",
                "must be prefix or round_robin")
        require(self.routing_epsilon > 0, SVC, "routing_epsilon", "must be > 0")
        require(self.routing_load_window_s > 0, SVC, "routing_load_window_s", "must be > 0")
        require(0 <= self.routing_load_floor <= 1024, SVC, "routing_load_floor",
                "must be in [0, 1024]")
        require(self.dispatch_memory_s >= 0, SVC, "dispatch_memory_s", "must be >= 0")
        require(self.max_attempts >= 1, SVC, "max_attempts", "must be >= 1")

    def _check_replica_polls(self) -> None:
        """`validate`'s checks of how often the replicas are polled (and warmed) and when one
        counts as hung or stalled."""
        # Tiny values were taken and made the poller (and the warm loop) spin.
        require(self.replica_poll_s >= 0.01, SVC, "replica_poll_s", "must be >= 0.01")
        require(self.warm_interval_s <= 0 or self.warm_interval_s >= 1, SVC, "warm_interval_s",
                "must be <= 0 (off) or >= 1")
        require(self.replica_stats_timeout_s > 0, SVC, "replica_stats_timeout_s", "must be > 0")
        require(1 <= self.replica_hung_polls <= 100, SVC, "replica_hung_polls",
                "must be in 1..100")
        require(self.replica_stall_s >= 0, SVC, "replica_stall_s", "must be >= 0 (0 = off)")

    def _check_warming(self) -> None:
        """`validate`'s checks of the warm-up of hot prefixes: pins, choice and bounds."""
        require(self.warm_pin_ttl_s > 0, SVC, "warm_pin_ttl_s", "must be > 0")
        require(self.warm_pin_ttl_max_s >= self.warm_pin_ttl_s, SVC,
                moved(self, "warm_pin_ttl_max_s", "warm_pin_ttl_s"),
                f"warm_pin_ttl_max_s ({self.warm_pin_ttl_max_s:g}) must be >= warm_pin_ttl_s "
                f"({self.warm_pin_ttl_s:g})")
        # Sent in uint32 PrefillRequest.ttl_seconds: larger failed every warm-up.
        require(self.warm_pin_ttl_max_s <= 2**32 - 1, SVC, "warm_pin_ttl_max_s",
                f"must be at most {2**32 - 1}")
        require(self.warm_top_k >= 0, SVC, "warm_top_k", "must be >= 0")
        # Its bound stated: past 2^63 the refusal said "must be >= 1" (of 2^64, say).
        require(1 <= self.warm_min_hits <= 2**63, SVC, "warm_min_hits", "must be in 1..2^63")
        require(1 <= self.warm_max_prefills_per_call <= 4096, SVC,
                "warm_max_prefills_per_call", "must be in 1..4096 (64 prompts x 64 replicas)")
        require(self.warm_max_load >= 0, SVC, "warm_max_load", "must be >= 0")
        require(self.warm_max_prompts_per_cycle >= 0, SVC, "warm_max_prompts_per_cycle",
                "must be >= 0")

    @property
    def max_streams(self) -> int:
        """Concurrent Generate streams the server takes before RESOURCE_EXHAUSTED."""
        return self.max_workers - STREAM_HEADROOM
