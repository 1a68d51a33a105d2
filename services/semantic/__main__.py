"""`python -m services.semantic [--flags]`: run the semantic cache service until SIGTERM."""

from __future__ import annotations

import gc
import logging
import sqlite3

from services.common import files
from services.common.bootstrap import (
    exit_process,
    load_service_config,
    run_until_signal,
    service_main,
)
from services.common.config import ConfigError
from services.semantic.config import SemanticConfig
from services.semantic.server import serve
from services.semantic.store import DatabaseInUse, FolderInTheWay, NotWritable

log = logging.getLogger("services.semantic")


def thresholds_said(cfg: SemanticConfig) -> str:
    """The thresholds this start took, for its serving line: they are read at start only, and
    an operator who changed one had no way to see which values the running shard held short
    of a Lookup in each tier."""
    return (f"thresholds strict {cfg.tier_strict:g}, standard {cfg.tier_standard:g}, relaxed "
            f"{cfg.tier_relaxed:g} (verified entries {cfg.verified_bonus:g} lower, floor "
            f"{cfg.threshold_floor:g}); guard {','.join(cfg.guard_tiers) or 'none'}, verifier "
            f"{','.join(cfg.verifier_tiers) or 'none'}")


def main(argv: list[str] | None = None) -> int:
    return service_main("semantic", _main, argv)


def _main(argv: list[str] | None) -> int:
    cfg = load_service_config(SemanticConfig, "semantic", argv)
    if cfg is None:
        return 2
    try:
        svc = serve(cfg)
    except (DatabaseInUse, FolderInTheWay) as exc:
        # Both name the path, what is wrong and the way out: no setting is at fault.
        log.error("cannot start: %s", exc)
        return 2
    except ConfigError:
        # An address or metrics port that cannot be bound (BindError): one line from
        # service_main, naming the flag where one set it, as every service's does.
        raise
    except (OSError, ValueError, sqlite3.Error) as exc:
        # A model folder without its tokenizer, a database that is not one, a cache folder
        # that cannot be made, a verifier file that is not JSON: found only now, where the
        # paths exist. One line, exit 2.
        why = not_writable(exc)
        if why:
            log.error("cannot start: %s", why)
            return 2
        if type(exc) is sqlite3.DatabaseError:
            # A damaged database (store._damaged_error names the file and the way out) is no
            # setting either: "bad configuration: DatabaseError: ..." sent the operator to
            # the settings.
            log.error("cannot start: %s", exc)
            return 2
        log.error("bad configuration: %s: %s", type(exc).__name__, exc)
        return 2
    # Move what loading built (entries, maps, index arrays) out of the cyclic collector's reach:
    # a full collection walked 100k entries in ~30 ms, a pause lookups would wait through.
    # Process-wide, so here and not in serve() (tests start many services in one process).
    gc.collect()
    gc.freeze()
    log.info("semantic cache serving on port %d with %d entries; %s", svc.handle.port,
             svc.cache.stats().entries, thresholds_said(cfg))
    closed: list[bool] = []
    run_until_signal(svc.handle, grace=cfg.grace_seconds,
                     on_stop=lambda: closed.append(svc.stop(0, cfg.index_close_seconds)))
    if closed and not closed[0]:
        # Waiting longer would outlast the pod's termination grace (SIGKILL); a normal exit
        # with a merge still inside faiss aborts the interpreter (a core, exit 134). Nothing is
        # lost: every acknowledged entry is in SQLite, and the store is closed.
        log.warning("an index merge is still running after index_close_seconds=%g: exiting "
                    "without waiting for it (the next start catches the saved graphs up "
                    "from SQLite, or builds them)",
                    cfg.index_close_seconds)
        exit_process(0)
    return 0


def not_writable(exc: BaseException) -> str:
    """Why the start failed when a path the service writes is not writable ("" when that is
    not the cause)."""
    if isinstance(exc, NotWritable):
        return str(exc)
    return files.not_writable(exc, "its database with its lock, -wal and -shm files, and its "
                              "model cache", "TIERCACHE_SEMANTIC_DB_PATH / "
                              "TIERCACHE_SEMANTIC_CACHE_DIR")


if __name__ == "__main__":
    exit_process(main())
