"""A differential review of `services.common.errors` and the bootstrap's cap on a status
message (`bootstrap._capped`), against a model of their docstrings: seeded random values,
messages and trailers.

The model: every TierCacheError subclass (found by walking the class tree, so a new one is
checked too) has a `code` that is a grpc.StatusCode name and no trailers of its own but
PinRefused's; InvalidArgument's message starts with its field; `shown` is the repr of a value,
a string past SHOWN_CHARS cut to that many characters with its length said; a status message
is sent whole when it has at most MAX_DETAILS_CHARS characters and at most
MAX_DETAILS_WIRE_BYTES bytes as gRPC percent-encodes it, else a prefix of it, within both,
saying how many characters were cut; `overloaded` is true exactly when the trailers carry
OVERLOADED_KEY or the details are gRPC's own "Concurrent RPC limit exceeded!", and never
raises; `prefill_work` gives back a PinRefused's (prompt, cached, computed) for figures in
[0, 2^32), and zeros for trailers that are not a PinRefused's figures (docs silent on which
spellings of a number count: asserted only that the answer is zeros or the figures as ints).

Run: 20,000 seeds (1,500 here). Found: `_capped` cut by characters only (fixed in bootstrap,
guarded in tests/test_errors_rules.py). Injected bugs caught (seeds of 1,500): shown cut one
character late (47), gRPC's own cap refusal not read as overloaded (296), a figure of 2^32
taken (23), the cap by characters only (492), '%' counted as one byte (666); Overloaded made a
plain TierCacheError (the class walk). More seeds: TIERCACHE_ERRORS_DIFF_SEEDS=20000.
"""

from __future__ import annotations

import os
import random
import re

import grpc

from services.common import errors
from services.common.bootstrap import MAX_DETAILS_CHARS, MAX_DETAILS_WIRE_BYTES, _capped

SEEDS = int(os.environ.get("TIERCACHE_ERRORS_DIFF_SEEDS", "1500"))
DOCUMENTED = {"TierCacheError": "INTERNAL", "Overloaded": "RESOURCE_EXHAUSTED",
              "PinRefused": "RESOURCE_EXHAUSTED", "Starting": "UNAVAILABLE"}
ALPHABET = ["a", " ", "%", "~", "\x01", "\u00e9", "\u2713", "\U0001f642", "\ud800", "'", "\\"]


class Err(grpc.RpcError):
    def __init__(self, details, trailers) -> None:
        self._d, self._t = details, trailers

    def details(self):
        if isinstance(self._d, Exception):
            raise self._d
        return self._d

    def trailing_metadata(self):
        if isinstance(self._t, Exception):
            raise self._t
        return self._t


def _text(rng: random.Random, n: int) -> str:
    if rng.random() < 0.5:
        return rng.choice(ALPHABET) * n
    return "".join(rng.choice(ALPHABET) for _ in range(n))


def _wire(s: str) -> int:
    """Bytes of `s` as gRPC sends a status message: PROTOCOL-HTTP2.md percent-encodes every
    UTF-8 byte outside %x20-24 / %x26-7E."""
    return sum(len(c.encode("utf-8", "replace")) * (1 if c.isascii() and 0x20 <= ord(c) <= 0x7E
                                                     and c != "%" else 3) for c in s)


def check_seed(seed: int) -> None:
    rng = random.Random(seed)
    # shown
    n = rng.choice([0, 1, errors.SHOWN_CHARS - 1, errors.SHOWN_CHARS, errors.SHOWN_CHARS + 1,
                    rng.randint(0, 500)])
    value = rng.choice([_text(rng, n), n, None, b"x" * n, 1.5])
    got = errors.shown(value)
    if isinstance(value, str) and len(value) > errors.SHOWN_CHARS:
        assert got == f"{value[:errors.SHOWN_CHARS]!r}... ({len(value)} characters)"
    else:
        assert got == repr(value)

    # the status message cap
    n = rng.choice([MAX_DETAILS_CHARS - 1, MAX_DETAILS_CHARS, MAX_DETAILS_CHARS + 1,
                    rng.randint(0, 3 * MAX_DETAILS_CHARS), rng.randint(0, 3000)])
    details = _text(rng, n)
    capped = _capped(details)
    if len(details) <= MAX_DETAILS_CHARS and _wire(details) <= MAX_DETAILS_WIRE_BYTES:
        assert capped == details
    else:
        kept, sep, rest = capped.rpartition("... (")
        assert sep and details.startswith(kept) and len(kept) < len(details)
        assert rest == f"{len(details) - len(kept)} characters cut)"
        assert len(kept) <= MAX_DETAILS_CHARS and _wire(capped) <= MAX_DETAILS_WIRE_BYTES
        if details.isascii() and details.isprintable() and "%" not in details:
            assert len(kept) == MAX_DETAILS_CHARS  # plain text keeps all it may

    # overloaded and prefill_work
    work = tuple(rng.choice([0, 1, 7, 2**32 - 1, rng.randint(0, 2**40)]) for _ in range(3))
    pin = errors.PinRefused("pin refused", *work)
    trailers = list(pin.trailers)
    if rng.random() < 0.3:
        trailers.append((errors.OVERLOADED_KEY, "1"))
    if rng.random() < 0.3:
        trailers.append(("other", rng.choice(["1", "x", ""])))
    rng.shuffle(trailers)
    if rng.random() < 0.3:  # a figure not of a PinRefused
        i = rng.randrange(len(trailers))
        trailers[i] = (trailers[i][0], rng.choice(["-1", "x", "", "1e3", str(2**32)]))
    details = rng.choice(["", "busy", errors.RPC_CAP_DETAILS, RuntimeError("no details")])
    t = rng.choice([trailers, trailers, None, RuntimeError("no trailers")])
    e = Err(details, t)
    pairs = t if isinstance(t, list) else []
    assert errors.overloaded(e) == (details == errors.RPC_CAP_DETAILS
                                    or any(k == errors.OVERLOADED_KEY for k, _ in pairs))
    md = dict(pairs)
    figures = [md.get(k, "0") for k in errors.PREFILL_WORK_KEYS]
    want = (tuple(int(x) for x in figures)
            if all(x.isascii() and x.isdigit() and int(x) < 2**32 for x in figures)
            else (0, 0, 0))
    assert errors.prefill_work(e) == want, (pairs, errors.prefill_work(e))


def test_each_domain_error_has_a_status_and_only_pin_refused_carries_trailers():
    seen, todo = set(), [errors.TierCacheError]
    while todo:
        cls = todo.pop()
        seen.add(cls)
        todo.extend(c for c in cls.__subclasses__() if c not in seen)
        assert isinstance(cls.code, str) and hasattr(grpc.StatusCode, cls.code), cls
        # the status each is named after; the docstrings say the rest
        named = re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).upper()
        want = DOCUMENTED.get(cls.__name__, named)
        assert cls.code == want, (cls, cls.code, want)
        if cls is errors.InvalidArgument:
            e = cls("sampling.top_p", "must be in (0, 1]")
            assert str(e) == "sampling.top_p: must be in (0, 1]" and e.field == "sampling.top_p"
        elif cls is errors.PinRefused:
            e = cls("m", 1, 2, 3)
            assert e.trailers == tuple(zip(errors.PREFILL_WORK_KEYS, ("1", "2", "3"),
                                           strict=True))
        else:
            e = cls("m")
            assert e.trailers == () and str(e) == "m"
        assert issubclass(cls, errors.ResourceExhausted) == (cls.code == "RESOURCE_EXHAUSTED")
    assert len(seen) >= 12


def test_random_values_messages_and_trailers_against_the_model():
    for seed in range(SEEDS):
        try:
            check_seed(seed)
        except AssertionError as e:
            raise AssertionError(f"seed {seed}: {e}") from None


if __name__ == "__main__":
    import sys

    start, count = int(sys.argv[1]), int(sys.argv[2])
    fails = 0
    for s in range(start, start + count):
        try:
            check_seed(s)
        except Exception as ex:  # noqa: BLE001 - counted and shown
            fails += 1
            if fails <= 5:
                print(f"seed {s}: {type(ex).__name__} {ex}"[:300])
    print(f"{fails} of {count} seeds failed")
