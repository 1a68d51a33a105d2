"""Wiring: build the orchestrator's parts from its config."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

from services.common.hashing import BlockHasher, hash_key_from_env, say_which_hasher
from services.common.model_store import eos_token_ids, load_resolved, load_tokenizer
from services.orchestrator.backends import ReplicaSet, SemanticBackend
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.dispatched import DispatchMemory
from services.orchestrator.pipeline import Orchestrator
from services.orchestrator.prefix_backend import PrefixBackend
from services.orchestrator.render import PromptRenderer
from services.orchestrator.routing import make_routing_policy
from services.orchestrator.server import Warmer
from services.orchestrator.tenants import (
    TenantRegistry,
    file_version,
    version_tag,
    watch_tokens_file,
)

log = logging.getLogger("services.orchestrator")


@dataclass
class App:
    orch: Orchestrator
    tenants: TenantRegistry
    warmer: Warmer
    stop: threading.Event = field(default_factory=threading.Event)  # background watchers

    def close(self) -> None:
        self.stop.set()
        self.warmer.stop()
        self.orch.replicas.stop()
        self.orch.semantic.stop()
        if self.orch.prefix is not None:
            self.orch.prefix.stop()


# A tenant's concurrent requests when tokens are configured and nothing else is said.
DEFAULT_TENANT_CONCURRENCY = 16


def tenant_concurrency(cfg: OrchestratorConfig) -> int:
    """Concurrent requests of a tenant without a limit of its own: the setting, or when it is
    0 (automatic) 16 with tokens, and every stream slot without them (one tenant, every
    caller: nobody to leave slots for)."""
    if cfg.max_concurrent_per_tenant:
        return cfg.max_concurrent_per_tenant
    if cfg.tokens or cfg.tokens_file:
        return min(DEFAULT_TENANT_CONCURRENCY, cfg.max_streams)
    return cfg.max_streams


def build(cfg: OrchestratorConfig) -> App:
    key = hash_key_from_env()

    def read_tokens() -> TenantRegistry:
        return TenantRegistry.build(
            tokens_file=cfg.tokens_file, tokens=cfg.tokens, key=key,
            max_prompt_tokens=cfg.max_prompt_tokens, max_tokens=cfg.max_tokens_limit,
            max_concurrent=tenant_concurrency(cfg))

    # Read first: a tokens file that is not JSON was refused only after the model had been
    # converted (20 s, and its files left in the cache by a start that failed) and the
    # replica and semantic pollers started.
    # The version read, taken before the read: a change in between is read again, not missed.
    version = file_version(os.path.expanduser(cfg.tokens_file)) if cfg.tokens_file else None
    tenants = read_tokens()
    if cfg.tokens_file:
        # The version in force, as each reload names the one it takes (docs/deploy.md).
        log.info("tokens file %s: %s (version %s)", os.path.expanduser(cfg.tokens_file),
                 tenants.summary(), version_tag(version))
    resolved, tok = load_resolved(cfg.model, cfg.cache_dir or None, cfg.model_id or None,
                                  load_tokenizer)
    if not getattr(tok, "chat_template", None):
        log.warning("model %s has no chat template: requests must send a raw `prompt`; "
                    "`messages` get FAILED_PRECONDITION", resolved.path)
    model_id = resolved.model_id  # cfg.model_id, else the model's
    replicas = ReplicaSet(cfg.kvpool_addresses, cfg.internal_token, cfg.replica_poll_s,
                          model_id=model_id, block_size=cfg.block_size,
                          stall_s=cfg.replica_stall_s,
                          stats_timeout_s=cfg.replica_stats_timeout_s,
                          hung_polls=cfg.replica_hung_polls)
    say_which_hasher()
    replicas.start()
    semantic = SemanticBackend(cfg.semantic_address, cfg.internal_token, cfg.semantic_timeout_s)
    semantic.start()
    prefix = (PrefixBackend(cfg.prefix_addresses, cfg.internal_token, cfg.prefix_timeout_s,
                            cfg.block_size) if cfg.prefix_addresses else None)
    if prefix is not None:
        prefix.start()
    orch = Orchestrator(
        renderer=PromptRenderer(tok, cfg.max_message_chars, cfg.max_prompt_tokens),
        tokenizer=tok, model_id=model_id,
        hasher=BlockHasher(model_id, cfg.block_size, key), replicas=replicas, semantic=semantic,
        prefix=prefix,
        routing=make_routing_policy(cfg.routing_policy, cfg.routing_epsilon,
                                    cfg.min_prefix_tokens, cfg.routing_load_window_s,
                                    cfg.routing_load_floor),
        internal_token=cfg.internal_token, default_tier=cfg.semantic_tier,
        enable_drafts=cfg.enable_drafts, store_sampled=cfg.store_sampled,
        serve_sampled=cfg.serve_sampled, coalesce=cfg.coalesce,
        eos_token_ids=eos_token_ids(resolved.path, tok),
        max_attempts=cfg.max_attempts, min_prefix_tokens=cfg.min_prefix_tokens,
        dispatched=(DispatchMemory(cfg.block_size, cfg.dispatch_memory_s)
                    if cfg.dispatch_memory_s > 0 else None))
    if orch.dispatched is not None:
        replicas.on_lost.append(orch.dispatched.forget)
    stop = threading.Event()
    if cfg.tokens_file and cfg.tokens_reload_s > 0:
        watch_tokens_file(tenants, read_tokens, cfg.tokens_file, cfg.tokens_reload_s, stop,
                          seen=version)
    warmer = Warmer(orch, cfg, tenants)
    warmer.start()
    return App(orch, tenants, warmer, stop)
