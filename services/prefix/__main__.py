"""`python -m services.prefix [--flags]`: run one prefix-index process (or shard) until SIGTERM."""

from __future__ import annotations

import logging
import sys

from services.common.bootstrap import (
    exit_on_signal_while_starting,
    load_service_config,
    run_until_signal,
)
from services.common.config import ConfigError
from services.prefix.config import PrefixConfig
from services.prefix.server import serve

log = logging.getLogger("services.prefix")


def main(argv: list[str] | None = None) -> int:
    # SIGTERM while loading exits at once (see exit_on_signal_while_starting).
    with exit_on_signal_while_starting():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    cfg = load_service_config(PrefixConfig, "prefix", argv)
    if cfg is None:
        return 2
    try:
        svc = serve(cfg)
    except ConfigError as exc:  # the address or metrics port cannot be bound
        log.error("bad configuration: %s", exc)
        return 2
    log.info("prefix index serving on port %d (block size %d, budget %d nodes)", svc.port,
             cfg.block_size, cfg.max_nodes)
    run_until_signal(svc.handle, grace=cfg.grace_seconds, on_stop=lambda: svc.stop(0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
