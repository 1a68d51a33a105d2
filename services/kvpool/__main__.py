"""`python -m services.kvpool` — one model replica with its paged KV pool."""

from __future__ import annotations

import os

# Before torch loads OpenMP: spinning worker threads waste shared CPUs (NOTES: a decode step
# went from 173 to 87 ms under contention with passive waiting).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Before torch loads oneDNN, which reads it once: oneDNN's primitive cache keeps a compiled
# kernel (~0.65 MiB) for every size of forward a packed linear layer has run (each new prefill
# length adds four), up to 1,024 by default. Under steady short chat traffic a replica's RSS
# rose 20 MiB a minute with that and 10.6 with 256, at the same tokens/s; malloc_trim and
# MALLOC_ARENA_MAX=2 did not slow it (docs/deploy.md, Memory; `python -m benchmarks.kvpool_rss`).
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "256")

import dataclasses  # noqa: E402
import logging  # noqa: E402

import torch  # noqa: E402
from tiercache.v1 import kvpool_pb2_grpc  # noqa: E402

from services.common.bootstrap import (  # noqa: E402
    create_server,
    exit_process,
    load_service_config,
    run_until_signal,
    service_main,
)
from services.common.config import ConfigError  # noqa: E402
from services.common.model_store import (  # noqa: E402
    ModelStoreError,
    conversion_not_writable,
)
from services.kvpool.app import Replica, build_replica, device_problem, pool_problem  # noqa: E402
from services.kvpool.config import KvPoolConfig  # noqa: E402
from services.kvpool.engine import out_of_memory  # noqa: E402
from services.kvpool.publisher import Publisher  # noqa: E402
from services.kvpool.server import KvPoolServicer, watch_engine  # noqa: E402

log = logging.getLogger("services.kvpool")


def main(argv: list[str] | None = None) -> int:
    return service_main("kvpool", _main, argv)


def _main(argv: list[str] | None) -> int:
    cfg = load_service_config(KvPoolConfig, "kvpool", argv)
    if cfg is None:
        return 2
    problem = device_problem(cfg.device)
    if problem:
        # service_main names it as given (`--device cuda` was blamed on the variable, unset),
        # as load_config's refusals are: one line, exit 2.
        raise ConfigError(f"TIERCACHE_KVPOOL_DEVICE: {cfg.device!r}: {problem}")
    # A kv_cache_bytes that holds no block of the model, judged from its config.json before
    # anything binds or loads (the same refusal once loaded was the first word after it).
    problem = pool_problem(cfg)
    if problem:
        raise ConfigError(problem)
    servicer = KvPoolServicer(cfg)
    # Bind first (health NOT_SERVING) so probes see the process while the model loads.
    handle = create_server(  # a port that cannot be bound: ConfigError, exit 2 (service_main)
        service="kvpool", address=cfg.address,
        services=[(kvpool_pb2_grpc.add_KvPoolServicer_to_server, servicer,
                   "tiercache.v1.KvPool")],
        internal_token=cfg.internal_token or None,
        metrics_port=None if cfg.metrics_port < 0 else cfg.metrics_port,
        # A Generate stream holds a thread from admission to its last token: one for every
        # sequence the engine may hold, plus room for Stats polls, Prefill and Resync, or a
        # busy replica's Stats would queue behind streams until it is declared hung.
        max_workers=cfg.max_batch_size + cfg.max_waiting + 16)
    servicer.draining = handle.draining  # Stats refused from SIGTERM on (KvPoolServicer.Stats)
    # Only the engine thread runs the model with several threads; this one loads it with one.
    # Two threads that each ran an OpenMP team leave libgomp with more threads than cores, and it
    # then stops spinning between parallel regions: each of the ~200 oneDNN layers of a SmolLM2
    # forward waited for its worker to wake, and an engine decode step took 75 ms instead of
    # 60 (2-core host, in-process; 95-106 ms against 77-126 with OMP_WAIT_POLICY=PASSIVE).
    cfg = dataclasses.replace(cfg, torch_threads=cfg.torch_threads or torch.get_num_threads())
    torch.set_num_threads(1)
    replica = _load_replica(cfg)
    if replica is None:
        handle.stop(None)
        return 2
    publisher = None
    if cfg.prefix_address:
        publisher = Publisher(
            replica.engine, address=cfg.prefix_address, replica_id=cfg.replica_id,
            incarnation=servicer.incarnation, public_address=cfg.public_address,
            model_id=replica.info.model_id, heartbeat_seconds=cfg.heartbeat_seconds,
            publish_interval_seconds=cfg.publish_interval_seconds,
            internal_token=cfg.internal_token).start()
    servicer.attach(replica.engine, replica.info, publisher)
    handle.set_serving()
    watch_engine(replica.engine, handle, stall_seconds=cfg.engine_stall_seconds)
    log.info("kvpool %s ready on port %d (model %s, %d blocks)", cfg.replica_id, handle.port,
             replica.info.model_id, replica.engine.pool.num_blocks)

    def on_stop() -> None:
        if publisher is not None:
            publisher.stop()
        replica.engine.stop()

    run_until_signal(handle, cfg.grace_seconds, on_stop=on_stop)
    return 0


def _load_replica(cfg: KvPoolConfig) -> Replica | None:
    """`build_replica(cfg)`; None, said at error as one line, where the model cannot be
    loaded (a bad configuration, or a volume the conversion cannot write) or it and its KV
    pool do not fit in memory. Another RuntimeError goes on up."""
    try:
        return build_replica(cfg)
    except (ModelStoreError, OSError, ValueError) as exc:
        # A model folder that does not exist (ModelStoreError), or one transformers cannot
        # load (OSError: no weights file, unreadable files; also a full disk or too many open
        # files while converting, which a restart with the same settings would meet again;
        # ValueError: a config.json transformers does not recognise).
        why = conversion_not_writable(exc, "TIERCACHE_KVPOOL_CACHE_DIR", cfg.cache_dir)
        if why:
            log.error("cannot start: %s", why)
        else:
            log.error("bad configuration (the model could not be loaded): %s", exc)
        return None
    except RuntimeError as exc:  # torch.OutOfMemoryError is one
        if not out_of_memory(exc):
            raise
        # A traceback and exit 1 named none of the settings that size what did not fit, and a
        # pod crash-looped on it.
        log.error("bad configuration: out of memory loading the model and its KV pool "
                  "on %s (%s); lower TIERCACHE_KVPOOL_KV_CACHE_BYTES (or NUM_BLOCKS), "
                  "MAX_BATCH_SIZE or MAX_CONTEXT, or pick a device with more memory",
                  cfg.device, str(exc).splitlines()[0][:200])
        return None


if __name__ == "__main__":
    exit_process(main())
