"""Log lines a test reads: each with the request id it was written under, and the interceptor's
thinned lines started over."""

from __future__ import annotations

import contextlib
import logging

from services.common import bootstrap


@contextlib.contextmanager
def lines_with_ids(name: str = "services.common.bootstrap", level: int = logging.WARNING):
    """The messages `name`'s logger writes at `level` or above meanwhile, each with the
    request id bound when it was written (what its JSON line's request_id is)."""
    from services.common.logs import request_id_var

    seen: list[tuple[str, str]] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((record.getMessage(), request_id_var.get()))

    keep, logger = Keep(level), logging.getLogger(name)
    logger.addHandler(keep)
    old = logger.level
    logger.setLevel(min(level, old or level))
    try:
        yield seen
    finally:
        logger.removeHandler(keep)
        logger.setLevel(old)


def fresh_lines(monkeypatch, name: str = "_AUTH_LINES") -> None:
    """The thinning of the interceptor's lines `name` (the refusals', per peer host) started
    over: every caller here is 127.0.0.1, and earlier tests may have used up its lines."""
    old = getattr(bootstrap, name)
    monkeypatch.setattr(bootstrap, name, bootstrap.Thinned(
        old.log, per_window=old.per_window, window_s=old.window_s, level=old.level))
