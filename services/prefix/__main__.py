"""`python -m services.prefix [--flags]`: run one prefix-index process (or shard) until SIGTERM."""

from __future__ import annotations

import logging

from services.common.bootstrap import (
    exit_process,
    load_service_config,
    run_until_signal,
    service_main,
)
from services.prefix.config import PrefixConfig
from services.prefix.server import serve

log = logging.getLogger("services.prefix")


def main(argv: list[str] | None = None) -> int:
    return service_main("prefix", _main, argv)


def _main(argv: list[str] | None) -> int:
    cfg = load_service_config(PrefixConfig, "prefix", argv)
    if cfg is None:
        return 2
    svc = serve(cfg)  # a port that cannot be bound: ConfigError, exit 2 (service_main)
    log.info("prefix index serving on port %d (block size %d, budget %d nodes)", svc.port,
             cfg.block_size, cfg.max_nodes)
    run_until_signal(svc.handle, grace=cfg.grace_seconds, on_stop=lambda: svc.stop(0))
    return 0


if __name__ == "__main__":
    exit_process(main())
