"""`python -m services.prefix [--flags]`: run one prefix-index process (or shard) until SIGTERM."""

from __future__ import annotations

import logging
import sys

from services.common.bootstrap import run_until_signal
from services.common.config import ConfigError, load_config
from services.common.logs import setup_logging
from services.prefix.config import PrefixConfig
from services.prefix.server import serve

log = logging.getLogger("services.prefix")


def main(argv: list[str] | None = None) -> int:
    setup_logging("prefix")
    try:
        cfg = load_config(PrefixConfig, "prefix", sys.argv[1:] if argv is None else argv)
    except ConfigError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    svc = serve(cfg)
    log.info("prefix index serving on port %d (block size %d, budget %d nodes)", svc.port,
             cfg.block_size, cfg.max_nodes)
    run_until_signal(svc.handle, grace=cfg.grace_seconds, on_stop=lambda: svc.stop(0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
