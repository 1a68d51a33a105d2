"""JSON logs with the request id of the RPC being served.

The request id travels in gRPC metadata as `x-request-id`; the server interceptor puts it in a
context variable so every log line written while serving that RPC carries it.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.metadata
import json
import logging
import os
import re
import sys
import threading
import time
import uuid
import weakref
from collections.abc import Iterator

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


@contextlib.contextmanager
def bound_request_id(rid: str) -> Iterator[None]:
    """Log lines written inside carry `rid` (restored on leaving)."""
    tok = request_id_var.set(rid)
    try:
        yield
    finally:
        request_id_var.reset(tok)


class Thinned:
    """At most `per_window` log lines per key (e.g. service, method, status) every `window_s`
    (the caller asks `allow(key)` before each line, written to `logger`);
    how many were left out, and when, is said once the window is over: by the key's next
    line, by any key's line a second or more later, by a background sweep of every instance
    (a flood that stopped was otherwise never counted: an outage's WARNINGs end with it), or
    by `flush_all` as the server stops. That line carries no request id (it was written under
    whichever request's id was bound, unrelated to the lines it counts), and is written at
    `level`, that of the lines it counts (a count of WARNINGs at INFO went unseen where
    TIERCACHE_LOG_LEVEL=WARNING showed the WARNINGs)."""

    SWEEP_S = 1.0
    _all: weakref.WeakSet[Thinned] = weakref.WeakSet()
    _sweeper: threading.Thread | None = None
    _class_lock = threading.Lock()

    def __init__(self, logger: logging.Logger, per_window: int = 10,
                 window_s: float = 10.0, level: int = logging.INFO) -> None:
        self.log, self.per_window, self.window_s = logger, per_window, window_s
        self.level = level
        # key -> [window start, lines, left out, first and last left out (Unix time)]
        self._seen: dict[tuple, list] = {}
        self._lock = threading.Lock()
        self._swept = time.monotonic()
        with Thinned._class_lock:
            Thinned._all.add(self)
            if Thinned._sweeper is None:
                Thinned._sweeper = threading.Thread(target=Thinned._sweep_forever,
                                                    name="thinned-log-sweep", daemon=True)
                Thinned._sweeper.start()

    @classmethod
    def _sweep_forever(cls) -> None:
        while True:
            time.sleep(cls.SWEEP_S)
            for t in list(cls._all):
                t.sweep()

    @classmethod
    def flush_all(cls) -> None:
        """Say what every instance left out so far (the server is stopping)."""
        for t in list(cls._all):
            t.flush()

    def sweep(self, every: bool = False) -> None:
        """Say (and forget) what keys whose window is over left out; `every`: every key's,
        over or not (the server is stopping)."""
        now = time.monotonic()
        with self._lock:
            self._swept = now
            for k, v in list(self._seen.items()):
                if every or now - v[0] >= self.window_s:
                    self._say(k, v)
                    del self._seen[k]

    def _say(self, key: tuple, w: list) -> None:
        if not w[2]:
            return

        def at(t: float) -> str:
            return time.strftime("%H:%M:%S", time.gmtime(t))

        with bound_request_id(""):
            self.log.log(self.level, "%s: %d more lines left out between %s and %sZ",
                         "/".join(map(str, key)), w[2], at(w[3]), at(w[4]))

    def allow(self, key: tuple) -> bool:
        now = time.monotonic()
        if now - self._swept >= self.SWEEP_S:
            self.sweep()
        with self._lock:
            w = self._seen.get(key)
            if w is None or now - w[0] >= self.window_s:
                if w is not None:
                    self._say(key, w)
                    del self._seen[key]
                if len(self._seen) > 4096:  # keys are few; a bound all the same
                    for k, v in self._seen.items():  # said first, not lost with the table
                        self._say(k, v)
                    self._seen.clear()
                self._seen[key] = w = [now, 0, 0, 0.0, 0.0]
            if w[1] < self.per_window:
                w[1] += 1
                return True
            wall = time.time()
            if not w[2]:
                w[3] = wall
            w[2], w[4] = w[2] + 1, wall
            return False

    def flush(self) -> None:
        """Say what every key left out so far (the server is stopping)."""
        self.sweep(every=True)


def package_version() -> str:
    """The installed distribution's version (pyproject.toml's, as built into the wheel): the
    CLI's `--version` and every service's start line."""
    try:
        return importlib.metadata.version("tiercache")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed: a checkout on PYTHONPATH without `make setup`)"


_PLAIN_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def plain_request_id(rid: str) -> str:
    """`rid` if short and plain, else a new id: a caller's id goes into every log line and
    every downstream call's metadata (a 12 KB id failed calls two hops down)."""
    return rid if _PLAIN_ID.fullmatch(rid) else uuid.uuid4().hex[:16]

_SECRET_KEYS = ("authorization", "token", "secret", "password")


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, service, logger, message, request_id, extras."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None) or request_id_var.get()
        if rid:
            out["request_id"] = rid
        for k, v in getattr(record, "fields", {}).items():
            # Never log credentials, even if a caller passes them by mistake.
            out[k] = "***" if any(s in k.lower() for s in _SECRET_KEYS) else v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


def setup_logging(service: str, level: str | None = None) -> None:
    """Configure the root logger once, in a service's main()."""
    # Stripped, as every setting's value is (" info" from a manifest's quoting was refused).
    level = (level or os.environ.get("TIERCACHE_LOG_LEVEL", "INFO")).strip()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    if not isinstance(logging.getLevelName(level.upper()), int):
        root.setLevel(logging.INFO)
        # The config check that follows fails the boot (exit 2) with the same message.
        raise ValueError(f"TIERCACHE_LOG_LEVEL: unknown level {level!r}; expected one of "
                         "DEBUG, INFO, WARNING, ERROR, CRITICAL")
    root.setLevel(level.upper())
    if not isatty(sys.stderr):
        quiet_library_progress_bars()


def isatty(stream) -> bool:
    """Whether `stream` is a terminal (False for one replaced or closed)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def step_progress(total: int, desc: str, logger: logging.Logger):
    """A bar for our own long work of `total` steps (a conversion, an export): tqdm's on a
    terminal; elsewhere (a log file, a pod's stderr) an INFO line on `logger` per step done,
    "<desc>: 2/4 steps done (<the step's note>)". tqdm's bar there was a line of carriage
    returns amid the JSON lines, which broke their parsing as the libraries' bars did."""
    if isatty(sys.stderr):
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit="step", file=sys.stderr, dynamic_ncols=True)
    return _StepLines(total, desc, logger)


class _StepLines:
    """`step_progress` off a terminal: tqdm's update / set_postfix_str / close, as log lines."""

    def __init__(self, total: int, desc: str, logger: logging.Logger) -> None:
        self.total, self.desc, self.log = total, desc, logger
        self.n, self.note = 0, ""

    def set_postfix_str(self, note: str) -> None:
        self.note = note  # the step under way: said when it is done

    def update(self, n: int = 1) -> None:
        self.n += n
        self.log.info("%s: %d/%d steps done%s", self.desc, self.n, self.total,
                      f" ({self.note})" if self.note else "")
        self.note = ""

    def close(self) -> None:
        pass

    def __enter__(self) -> _StepLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def quiet_library_progress_bars() -> None:
    """Turns off transformers' and the hub's own progress bars ("Loading weights: 0%|...\\r"):
    written to a log file or a pod's stderr, each was a line of carriage returns amid the
    JSON lines, which broke their parsing. Our own long work (a conversion, an export) still
    says how far it is, a log line per step (`step_progress`)."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # read where imported later
    if "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
