"""`python -m services.orchestrator` — the public TierCache service."""

from __future__ import annotations

import logging

from tiercache.v1 import orchestrator_pb2_grpc

from services.common.bootstrap import (
    create_server,
    exit_process,
    load_service_config,
    run_until_signal,
    service_main,
)
from services.common.hashing import DEFAULT_KEY, hash_key_from_env
from services.common.model_store import ModelStoreError, conversion_not_writable
from services.common.shard_list import said
from services.orchestrator.app import build
from services.orchestrator.config import OrchestratorConfig
from services.orchestrator.server import OrchestratorServicer

log = logging.getLogger("services.orchestrator")


def shard_lists_said(orch) -> str:
    """The cache tiers' lists as `orch`'s clients send them, named as the shards' mismatch
    notes name them ("; semantic shard list 2 shards (3b72...)"): a note says which
    fingerprints differ, and this says whose each is."""
    tiers = (("semantic", orch.semantic.shard_list if orch.semantic.enabled else None),
             ("prefix", orch.prefix.client.shard_list if orch.prefix is not None else None))
    return "".join(f"; {tier} shard list {said(sent)}" for tier, sent in tiers
                   if sent is not None)


def main(argv: list[str] | None = None) -> int:
    return service_main("orchestrator", _main, argv)


def _main(argv: list[str] | None) -> int:
    cfg = load_service_config(OrchestratorConfig, "orchestrator", argv)
    if cfg is None:
        return 2
    cfg.check_paths()  # a ConfigError: named as given by service_main, exit 2
    if (cfg.tokens or cfg.tokens_file) and hash_key_from_env() == DEFAULT_KEY:
        # The key signs the entry references tenants get and derives their cache salts: with
        # the public development key a tenant could sign another's entry id and invalidate it.
        log.error("bad configuration: TIERCACHE_HASH_KEY must be set (the same secret on every "
                  "service) when tenant tokens are configured; the default is public")
        return 2
    if not (cfg.tokens or cfg.tokens_file):
        # Said at every start: a deployment that lost its tokens setting serves everyone as
        # the admin tenant.
        log.warning("no tenant tokens configured (TIERCACHE_ORCHESTRATOR_TOKENS / _TOKENS_FILE):"
                    " no authentication, every caller is the default (admin) tenant")
    # Bind first (health NOT_SERVING) so probes see the process while the tokenizer loads.
    servicer = OrchestratorServicer(cfg)
    handle = create_server(  # a port that cannot be bound: ConfigError, exit 2 (service_main)
        service="orchestrator", address=cfg.address,
        services=[(orchestrator_pb2_grpc.add_OrchestratorServicer_to_server, servicer,
                   "tiercache.v1.Orchestrator")],
        metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port,
        max_workers=cfg.max_workers, max_concurrent_rpcs=cfg.max_concurrent_rpcs or None,
        max_connection_age_s=cfg.max_connection_age_s,
        # A stream (or a Warm, up to 120 s) under way ends as it would have.
        connection_age_grace_s=max(cfg.request_timeout_s, 120.0),
        max_message_bytes=cfg.max_request_bytes,
        # The bearer token, checked before the request is parsed.
        authenticate=servicer.authenticate_call,
        # Its id in every call's response headers (a client that sent none can quote it).
        request_id_headers=True)
    try:
        app = build(cfg)
    except (ModelStoreError, OSError, ValueError) as exc:
        # A model folder or tokens file that is missing or malformed: a configuration error
        # (exit 2, one line), found only now because the paths exist only where it runs. A
        # cache folder it cannot write is no setting's fault but the volume's.
        why = conversion_not_writable(exc, "TIERCACHE_ORCHESTRATOR_CACHE_DIR", cfg.cache_dir)
        if why:
            log.error("cannot start: %s", why)
        else:
            log.error("bad configuration: %s", exc)
        handle.stop(None)
        return 2
    servicer.attach(app.orch, app.tenants, app.warmer)
    # Ready (/readyz, the readiness probe) only while a replica serving this model is healthy;
    # health (/healthz, liveness and gRPC health, which the launcher waits on) does not wait
    # for replicas: a kvpool outage must not restart every orchestrator.
    handle.readiness = app.orch.replicas.unready
    handle.set_serving()
    log.info("orchestrator ready on port %d (model %s, %d replicas%s)", handle.port,
             app.orch.model_id, len(cfg.kvpool_addresses), shard_lists_said(app.orch))
    run_until_signal(handle, cfg.grace_s, on_stop=app.close)
    return 0


if __name__ == "__main__":
    exit_process(main())
