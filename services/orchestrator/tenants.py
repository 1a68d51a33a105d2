"""Bearer tokens -> tenants, each with a cache salt and limits.

With no tokens configured every caller is the `default` tenant (local use). With tokens
configured a call without a valid `authorization: Bearer <token>` is UNAUTHENTICATED.

Per tenant (tokens file): `max_prompt_tokens`, `max_tokens`, `max_concurrent` requests,
`rate_per_s` requests per second with bursts of `burst` (token bucket; 0 = no rate limit), and
`admin` — only admin tenants (and the `default` tenant of an unauthenticated local stack) may
read cluster-wide Stats, which describe every tenant's traffic, or erase a tenant's cached
data (EraseTenant).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.config import MIN_SECRET_CHARS, weak_secret
from services.common.errors import (
    Overloaded,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    blank,
    name_problem,
)
from services.common.metrics import counter, gauge

log = logging.getLogger(__name__)

# Every refusal was only one more RESOURCE_EXHAUSTED in tiercache_rpc_total, mixed with
# "every replica busy" and fixed limits: an operator could not tell which tenant was throttled
# or why. Tenants come from configuration, so the label set is bounded.
# "a tenant or server limit" read as every limit: a max_tokens past the server's own limit (the
# live check's `--max-tokens 5000`) is INVALID_ARGUMENT and counted only in tiercache_rpc_total.
# Alertable: a refused version was only an ERROR line, while the tokens in force were older
# than the file (a token removed from it still accepted).
TOKENS_STALE = gauge("tiercache_orchestrator_tokens_file_stale",
                     "1 while the tenant tokens file differs from the version in force (its "
                     "latest version malformed, empty, unreadable or gone: the tokens read "
                     "before stay), else 0; absent without a tokens file or with "
                     "tokens_reload_s 0")
REJECTED = counter("tiercache_orchestrator_rejections_total",
                   "Requests refused RESOURCE_EXHAUSTED by a tenant's limit (reason "
                   "prompt_tokens, max_tokens, concurrent, rate_limit), the server's stream "
                   "cap (server_streams), every kvpool replica busy (replicas_busy) or a "
                   "request no replica's KV pool can hold (kv_pool); not "
                   "those past the server's own max_tokens or prompt limits (INVALID_ARGUMENT, "
                   "in tiercache_rpc_total)", ("tenant", "reason"))


def _drop_rejection_series(names: set[str]) -> None:
    """Drop the tiercache_orchestrator_rejections_total series of every tenant not in
    `names` (the file read now): not only those the last file had. A call authenticated
    before its tenant was removed and refused after for a server-wide reason (server_streams,
    replicas_busy) made a series of the removed name that no later reload dropped."""
    labelled = {s.labels["tenant"] for m in REJECTED.collect() for s in m.samples}
    for name in labelled - names:
        REJECTED.remove_by_labels({"tenant": name})


def parse_token_pairs(tokens: str) -> dict[str, str]:
    """`TIERCACHE_ORCHESTRATOR_TOKENS` ("token=tenant,...") as token -> tenant. A pair splits
    at its last '=': a token may end in base64 padding ("c2VjcmV0==" stood for the token
    "c2VjcmV0" of tenant "=acme"), a tenant name written here has none.

    Raises:
        ValueError: a pair lacks its '=' or a side, or a token is given twice (the last one
            silently took the token from the first tenant).
    """
    out: dict[str, str] = {}
    for i, pair in enumerate(filter(None, (p.strip() for p in tokens.split(","))), 1):
        tok, sep, name = pair.rpartition("=")
        if not sep or not tok or not name:
            raise ValueError("TIERCACHE_ORCHESTRATOR_TOKENS: expected token=tenant,...")
        if tok in out:
            raise ValueError(f"TIERCACHE_ORCHESTRATOR_TOKENS: pair {i} repeats the token of "
                             "an earlier pair (each token names one tenant)")
        out[tok] = name
    return out


def _sendable(token: str) -> bool:
    """A bearer token a gRPC client can send as it is: metadata values are printable ASCII
    (any other was accepted at start, and every call with it failed in the client), and
    surrounding spaces are stripped by the CLI and by many proxies."""
    return token == token.strip() and token.isascii() and token.isprintable()


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook: a key (a token, or a tenant's setting) given twice is an error,
    not the last one silently winning. The key itself is not shown: it may be a token."""
    out: dict[str, Any] = {}
    for i, (k, v) in enumerate(pairs, 1):
        if k in out:
            raise ValueError(f"key {i} of an object repeats an earlier key of it")
        out[k] = v
    return out


_LIMITS = ("max_prompt_tokens", "max_tokens", "max_concurrent")
_KEYS = frozenset(("tenant", "rate_per_s", "burst", "admin", *_LIMITS))
MAX_TENANT_CHARS = 64  # the smallest max_tenant_chars a semantic tier accepts
MAX_WHOLE = 2**53  # limits and burst: beyond, a float (the token bucket) loses them
MIN_RATE = 1e-6  # requests/s (one per ~12 days); below, a refusal's wait was inf


def _spec(where: str, raw: object, defaults: Mapping[str, int]) -> tuple[str, dict]:
    """(tenant name, Tenant fields but name/salt) of one tokens-file entry, checked: a JSON
    string (the tenant) or an object with `tenant` and optional limits.

    Raises:
        ValueError: naming `where` and the field.
    """
    spec = {"tenant": raw} if isinstance(raw, str) else raw
    if not isinstance(spec, Mapping):
        raise ValueError(f"{where}: expected a tenant name or an object with 'tenant'")
    unknown = set(spec) - _KEYS
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; "
                         f"expected {sorted(_KEYS)}")
    name = spec.get("tenant")
    if not isinstance(name, str) or blank(name):
        # strip() kept "\u200b" and "\u3164": a tenant nobody could read in a log line, a
        # metric label or a Stats answer, and told apart from another only by its bytes.
        raise ValueError(f"{where}: 'tenant' must be a non-empty string (not only whitespace "
                         "or invisible characters)")
    if name != name.strip():
        # " acme" and "acme" would be two tenants, with two salts and two sets of limits.
        raise ValueError(f"{where}: 'tenant' {name!r} has leading or trailing whitespace")
    try:
        name.encode()
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON): salt_for failed
        raise ValueError(f"{where}: 'tenant' is not valid Unicode text") from None
    if len(name) > MAX_TENANT_CHARS:
        # The semantic tier refuses longer names (max_tenant_chars, at least 64), and the
        # tenant's cache would be off without a word.
        raise ValueError(f"{where}: 'tenant' is {len(name)} characters; at most "
                         f"{MAX_TENANT_CHARS}")
    if problem := name_problem(name):
        raise ValueError(f"{where}: 'tenant' {problem}")
    def whole(k: str, v: object) -> int:
        # JSON has one number type: 10.0 and 1e3 are whole numbers too (True is not).
        if type(v) is float and math.isfinite(v) and v.is_integer():
            v = int(v)
        if type(v) is not int or not 1 <= v <= MAX_WHOLE:
            # Past 2**53 float(burst) in the token bucket overflowed on a long enough number:
            # every call of the tenant an INTERNAL error, where the file had been taken.
            raise ValueError(f"{where}: {k!r} must be a whole number in [1, 2**53], "
                             f"got {v!r:.40}")
        return v

    out: dict = {k: whole(k, spec.get(k, defaults[k])) for k in _LIMITS}
    rate = spec.get("rate_per_s", 0.0)
    try:
        ok = type(rate) in (int, float) and math.isfinite(rate) and (
            rate == 0 or MIN_RATE <= rate <= MAX_WHOLE)
    except OverflowError:  # an integer too long for a float: was a traceback at start
        ok = False
    if not ok:
        # A rate under MIN_RATE (1e-320, say) refused with "retry in infs".
        raise ValueError(f"{where}: 'rate_per_s' must be 0 (no limit) or a number in "
                         f"[{MIN_RATE:g}, 2**53] requests/s, got {rate!r:.40}")
    burst = whole("burst", spec.get("burst", max(1, math.ceil(rate))))
    admin = spec.get("admin", False)
    if type(admin) is not bool:
        # "false" or "no" as a string would be truthy: admin by accident.
        raise ValueError(f"{where}: 'admin' must be true or false (a JSON boolean), "
                         f"got {admin!r}")
    out.update(rate_per_s=float(rate), burst=burst, admin=admin)
    return name, out


_JSON_SPACE = re.compile(r"[ \t\n\r]*")


def _entries(text: str) -> list[tuple[str, int]]:
    """(token, line it starts on) of each entry of the JSON object `text` (keys repeated or
    not), for refusals: a position alone ("entry 20002") is a count no editor
    shows."""
    decode, skip = json.JSONDecoder().raw_decode, _JSON_SPACE.match
    out: list[tuple[str, int]] = []
    start = skip(text, 0).end()
    if text[start:start + 1] != "{":
        return out
    i, line, counted = skip(text, start + 1).end(), 1, 0
    while text[i] != "}":
        line, counted = line + text.count("\n", counted, i), i
        tok, i = decode(text, i)
        _, i = decode(text, skip(text, skip(text, i).end() + 1).end())  # past ':' to the value
        out.append((tok, line))
        i = skip(text, i).end()
        if text[i] == ",":
            i = skip(text, i + 1).end()
    return out


def _repeated_token(text: str) -> str:
    """Which entry of the tokens file repeats an earlier one's token ("" when none does: the
    repeated key was a tenant's setting, or the text is not JSON past the repeated key)."""
    try:
        entries = _entries(text)
    except (ValueError, IndexError):
        return ""
    first: dict[str, tuple[int, int]] = {}
    for i, (tok, line) in enumerate(entries, 1):
        if tok in first:
            j, at = first[tok]
            return f"entry {i} (line {line}) repeats the token of entry {j} (line {at})"
        first[tok] = (i, line)
    return ""


def _read_tokens_file(tokens_file: str) -> tuple[Mapping, str]:
    """The tokens file's JSON object of token -> tenant, and its text."""
    with open(os.path.expanduser(tokens_file), encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        # Said as such: an emptied or half-written file read "not JSON: Expecting
        # value: line 1 column 1 (char 0)".
        raise ValueError(f"{tokens_file}: the file is empty")
    try:
        data = json.loads(text, object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{tokens_file}: not JSON: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{tokens_file}: {_repeated_token(text) or exc}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{tokens_file}: expected a JSON object of token -> tenant")
    return data, text


def _add_file_tokens(tokens_file: str, defaults: Mapping[str, int], specs: dict[str, dict],
                     names: dict[str, str]) -> None:
    """Add the tokens file's tenants to `specs` (tenant -> limits), its tokens to `names`."""
    data, text = _read_tokens_file(tokens_file)
    for i, (tok, raw) in enumerate(data.items(), 1):
        try:
            _add_file_entry(f"{tokens_file}: entry {i}", tok, raw, defaults, specs, names)
        except ValueError as exc:
            raise ValueError(f"{exc} (line {_entries(text)[i - 1][1]})") from None


def _add_file_entry(where: str, tok: object, raw: object, defaults: Mapping[str, int],
                    specs: dict[str, dict], names: dict[str, str]) -> None:
    """Add one entry of the tokens file (`where` names it)."""
    if not isinstance(tok, str) or not tok.strip():
        raise ValueError(f"{where}: the token must be a non-empty string")
    if not _sendable(tok):
        raise ValueError(f"{where}: the token must be printable ASCII without "
                         "surrounding spaces (a gRPC client cannot send another, "
                         "and the CLI strips spaces)")
    name, spec = _spec(where, raw, defaults)
    if specs.setdefault(name, spec) != spec:
        raise ValueError(f"{where}: tenant {name!r} has another token with "
                         "different limits (limits are per tenant)")
    names[tok] = name


def _add_string_tokens(tokens: str, defaults: Mapping[str, int], specs: dict[str, dict],
                       names: dict[str, str]) -> None:
    """Add the "token=tenant,..." string's tokens to `names`, their tenants to `specs`."""
    if tokens.strip() and not parse_token_pairs(tokens):
        raise ValueError("TIERCACHE_ORCHESTRATOR_TOKENS: set but names no token=tenant")
    for tok, name in parse_token_pairs(tokens).items():
        if not _sendable(tok):
            raise ValueError("TIERCACHE_ORCHESTRATOR_TOKENS: a token must be printable "
                             "ASCII without surrounding spaces")
        if names.get(tok, name) != name:
            raise ValueError(f"TIERCACHE_ORCHESTRATOR_TOKENS: a token of tenant {name!r} "
                             f"is the file's token of tenant {names[tok]!r}")
        names[tok] = name
        specs.setdefault(name, _spec("TIERCACHE_ORCHESTRATOR_TOKENS", name, defaults)[1])


def _warn_weak(names: dict[str, str]) -> None:
    """Say which tenants have a guessable token."""
    weak = sorted({names[tok] for tok in names if weak_secret(tok)})
    if weak:
        # Named by tenant, never by token. Said, not refused: a laptop's cluster runs the
        # dev overlay's placeholders.
        log.warning("tenant tokens that are placeholders or shorter than %d characters "
                    "(anyone may guess them): tenants %s", MIN_SECRET_CHARS,
                    ", ".join(weak[:8]) + (f" and {len(weak) - 8} more" if len(weak) > 8
                                           else ""))


@dataclass(frozen=True)
class Tenant:
    name: str
    cache_salt: str
    max_prompt_tokens: int
    max_tokens: int
    max_concurrent: int
    rate_per_s: float = 0.0  # requests per second; 0 = unlimited
    burst: int = 1  # bucket size for rate_per_s
    admin: bool = False  # may read cluster-wide Stats


@dataclass
class _Bucket:
    tokens: float
    at: float

    def give_back(self, requests: float, burst: int) -> None:
        """Return `requests` taken for work not done, never past a full bucket."""
        self.tokens = min(float(burst), self.tokens + requests)


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


def check_prompt_tokens(tenant: Tenant, prompt_tokens: int, field: str) -> None:
    """A prompt (`field`, as the request named it) over the tenant's max_prompt_tokens refused,
    RESOURCE_EXHAUSTED, and counted: Generate's and each of a Warm's prompts alike."""
    if prompt_tokens > tenant.max_prompt_tokens:
        REJECTED.labels(tenant.name, "prompt_tokens").inc()
        raise ResourceExhausted(
            f"{field}: {prompt_tokens} tokens exceed tenant limit {tenant.max_prompt_tokens}")


@dataclass
class TenantRegistry:
    """Looks tenants up by token, counts their concurrent requests and meters their rate."""

    by_token: dict[str, Tenant]
    default: Tenant | None
    clock: Callable[[], float] = time.monotonic
    key: bytes = b""  # signs the semantic entry references handed to tenants
    _active: dict[str, int] = field(default_factory=dict)
    _buckets: dict[str, _Bucket] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # SHA-256 of each token -> tenant: one dict lookup a call, where comparing the presented
    # token with every known one (in constant time each) grew with the tenant count. A
    # lookup by digest tells a caller nothing about how close a guess came.
    _by_digest: dict[bytes, Tenant] = field(default_factory=dict)
    # Each tenant's limits now, by name: a call authenticated before a reload holds the
    # Tenant read then, and its acquire, rate and charges go by these (see `_now`).
    _current: dict[str, Tenant] = field(default_factory=dict)
    # A tenant's old name -> its name now, for tokens a reload moved to another name.
    _renamed: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        """"N tokens of M tenants", as the tokens file's log lines say what was read."""
        return (f"{len(self.by_token)} tokens of "
                f"{len({t.name for t in self.by_token.values()})} tenants")

    def __post_init__(self) -> None:
        self._by_digest = {_digest(tok): t for tok, t in self.by_token.items()}
        self._current = {t.name: t for t in self.by_token.values()}

    @staticmethod
    def salt_for(tenant: str, key: bytes) -> str:
        # Keyed, so a tenant's salt cannot be derived from its (possibly public) name.
        return hmac.new(key, b"tenant:" + tenant.encode(), hashlib.sha256).hexdigest()[:32]

    @classmethod
    def build(cls, *, tokens_file: str, tokens: str, key: bytes, max_prompt_tokens: int,
              max_tokens: int, max_concurrent: int) -> TenantRegistry:
        """From a JSON file `{"<token>": {"tenant": "a", "max_concurrent": 4, ...}}` and/or a
        "token=tenant,..." string. No tokens at all = a single `default` tenant, no auth.

        Limits belong to the tenant, not the token: every token of a tenant gets the same ones
        (a string token of a tenant the file describes takes the file's limits).

        Raises:
            ValueError: a malformed entry (naming its position, line and field, never the token),
                tokens configured but none given (that would open the API to everyone), or two
                tokens of one tenant with different limits.
        """
        defaults = {"max_prompt_tokens": max_prompt_tokens, "max_tokens": max_tokens,
                    "max_concurrent": max_concurrent}
        specs: dict[str, dict] = {}  # tenant -> its limits (one spec per tenant)
        names: dict[str, str] = {}  # token -> tenant
        if tokens_file:
            _add_file_tokens(tokens_file, defaults, specs, names)
        _add_string_tokens(tokens, defaults, specs, names)
        if tokens_file and not names:
            # An emptied secret must not turn authentication off.
            raise ValueError(f"{tokens_file}: no tokens (remove the setting to run without "
                             "authentication)")

        def make(name: str, spec: Mapping) -> Tenant:
            return Tenant(name=name, cache_salt=cls.salt_for(name, key), **spec)

        tenants = {name: make(name, spec) for name, spec in specs.items()}
        by_token = {tok: tenants[name] for tok, name in names.items()}
        _warn_weak(names)
        # No tokens = a local, unauthenticated stack: its one caller is also its operator.
        default = None if by_token else make("default", _spec("default", {
            "tenant": "default", "admin": True}, defaults)[1])
        return cls(by_token, default, key=key)

    def authenticate(self, metadata: Mapping[str, str] | Iterable[tuple[str, str]]) -> Tenant:
        """The tenant of the call's bearer token; `metadata` as gRPC gives it (key, value
        pairs) or as a mapping.

        Raises:
            Unauthenticated: no token, an unknown one, or `authorization` given more than once
                (which one counted would depend on who reads it: a proxy checking the first,
                this server the last).
        """
        if self.default is not None:
            return self.default
        pairs = metadata.items() if isinstance(metadata, Mapping) else metadata
        given = [v for k, v in pairs if k == "authorization"]
        if len(given) > 1:
            raise Unauthenticated("authorization: given more than once")
        auth = given[0] if given else ""
        if not auth:
            raise Unauthenticated("authorization: missing bearer token")
        # RFC 7235 parts the scheme from the token by 1*SP: "Bearer  tok" read as the token
        # " tok", "unknown token". No token begins with a space (`_sendable`).
        scheme, _, token = auth.partition(" ")
        token = token.lstrip(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("authorization: expected 'Bearer <token>'")
        tenant = self._by_digest.get(_digest(token))
        if tenant is None:
            raise Unauthenticated("authorization: unknown token")
        return tenant

    def adopt(self, other: TenantRegistry) -> None:
        """Take `other`'s tokens and tenants (the tokens file read again): a token removed is
        refused from the next call on, a new one accepted. Requests under way and the rate
        buckets stay, by tenant name (a concurrency or rate limit changed applies to the next
        acquire, rate check and charge, a call's authenticated before the reload included:
        see `_now`; a call's size limits stay those it was authenticated under). A tenant the
        file no longer has (removed, or renamed) leaves its bucket, its count once its last
        request ends, and its series of tiercache_orchestrator_rejections_total (any made
        since its removal too, by a call authenticated before it)."""
        if other.default is not None or self.default is not None:
            raise ValueError("a registry without tokens cannot be swapped")
        with self._lock:
            moved = {t.name: new.name for tok, t in self.by_token.items()
                     if (new := other.by_token.get(tok)) is not None and new.name != t.name}
            renamed = {old: moved.get(mid, mid) for old, mid in self._renamed.items()}
            renamed.update(moved)
            self.by_token, self._by_digest = other.by_token, other._by_digest
            self._current = other._current
            self._renamed = self._renames_in_use(renamed)
            self._drop_removed_locked()
        _drop_rejection_series(set(self._current))

    def _renames_in_use(self, renamed: dict[str, str]) -> dict[str, str]:
        """The renames `_now` can still follow, with `_current` the file read now: one whose
        new name the file no longer has leads nowhere (its calls go by the limits they were
        authenticated with, as a removed tenant's), and one whose old name the file has again
        is never asked (`_now` finds the name first) and would lead that tenant's calls to
        another's limits once it is removed. Kept, they stayed for as long as the process
        ran."""
        return {old: new for old, new in renamed.items()
                if old != new and new in self._current and old not in self._current}

    def _drop_removed_locked(self) -> None:
        """Forget the limiter state of tenants not in `_current` (the lock held): they kept
        their buckets and counts for as long as the process ran. A count of requests still
        under way stays until `release`. Every name holding state is a key of `_buckets` or
        `_active` (the file read last's, and any a call authenticated before a removal has
        used since)."""
        for name in (set(self._buckets) | set(self._active)) - set(self._current):
            self._buckets.pop(name, None)
            if not self._active.get(name):
                self._active.pop(name, None)

    def cache_salts(self) -> set[str]:
        """The cache salts of the tenants the tokens file has now (the default tenant's,
        without tokens): the warm-up loop copies no prefix of a tenant removed since, whose
        data an EraseTenant may have just erased."""
        tenants = [self.default] if self.default is not None else self._current.values()
        return {t.cache_salt for t in tenants}

    def _now(self, tenant: Tenant) -> Tenant:
        """`tenant` with its limits as the tenants file has them now: a call authenticated
        just before a reload was admitted under the old concurrency limit (and metered at the
        old rate). A tenant renamed since (its token moved to another name) is the renamed
        one; one removed keeps the limits it was authenticated with."""
        now = self._current.get(tenant.name)
        if now is None and tenant.name in self._renamed:
            now = self._current.get(self._renamed[tenant.name])
        return now or tenant

    def check_limits(self, tenant: Tenant, prompt_tokens: int, max_tokens: int,
                     field: str = "prompt") -> None:
        """`field` names the prompt as the request gave it ("messages" or "prompt"). The
        limits the call was authenticated under: the server has already fitted an unset
        max_tokens to them (a reload since must not refuse what the client never set)."""
        check_prompt_tokens(tenant, prompt_tokens, field)
        if max_tokens > tenant.max_tokens:
            REJECTED.labels(tenant.name, "max_tokens").inc()
            raise ResourceExhausted(
                f"sampling.max_tokens: {max_tokens} exceeds tenant limit {tenant.max_tokens}")

    def acquire(self, tenant: Tenant) -> Tenant:
        """One of the tenant's concurrent slots; returns the tenant it is counted under (as
        the tokens file has it now), which `release` must be given."""
        with self._lock:
            tenant = self._now(tenant)
            n = self._active.get(tenant.name, 0)
            if n >= tenant.max_concurrent:
                REJECTED.labels(tenant.name, "concurrent").inc()
                raise Overloaded(  # retry later: a slot frees when a stream ends
                    f"tenant {tenant.name}: {n} concurrent requests "
                    f"(limit {tenant.max_concurrent}); retry when one of them ends")
            self._active[tenant.name] = n + 1
            return tenant

    def release(self, tenant: Tenant) -> None:
        with self._lock:
            n = max(0, self._active.get(tenant.name, 0) - 1)
            if n or tenant.name in self._current or self.default is not None:
                self._active[tenant.name] = n
            else:  # the last request of a tenant removed from the file
                self._active.pop(tenant.name, None)

    def check_rate(self, tenant: Tenant) -> None:
        """Take one request from the tenant's token bucket; RESOURCE_EXHAUSTED when empty."""
        with self._lock:
            tenant = self._now(tenant)
            if tenant.rate_per_s <= 0:
                return
            b = self._refilled(tenant)
            if b.tokens < 1.0:
                wait = (1.0 - b.tokens) / tenant.rate_per_s
                REJECTED.labels(tenant.name, "rate_limit").inc()
                raise Overloaded(  # retry later: the bucket refills
                    f"tenant {tenant.name}: rate limit of {tenant.rate_per_s:g} requests/s "
                    f"(burst {tenant.burst}) exceeded; retry in {wait:.2f}s")
            b.tokens -= 1.0

    def refund(self, tenant: Tenant) -> None:
        """Give back the request `check_rate` took, for a call a later limit refused (the
        tenant's or the server's concurrency): it did no work, and a client retrying it as told
        ("retry later") must not find its bucket emptied by the refusals."""
        self.charge(tenant, -1)

    def charge(self, tenant: Tenant, requests: float) -> None:
        """Take `requests` more from the tenant's bucket after `check_rate` let a call in: a
        call that does the work of many requests (Warm: a prefill per prompt and replica)
        pays for them. The bucket may go below zero, down to -burst: the tenant's next calls
        then wait until it has refilled (at most (burst + 1) / rate_per_s seconds; a debt
        without a floor locked a tenant out of every RPC for minutes after one large Warm).
        Negative `requests` give back what `afford` reserved and the call did not use."""
        with self._lock:
            tenant = self._now(tenant)
            if tenant.rate_per_s <= 0 or requests == 0:
                return
            b = self._refilled(tenant)
            if requests < 0:
                b.give_back(-requests, tenant.burst)
            else:
                b.tokens = max(-float(tenant.burst), b.tokens - requests)

    def afford(self, tenant: Tenant, requests: int) -> int:
        """Reserve `requests` more than the one `check_rate` took, for a call that may do that
        many requests' work (a Warm's prefills), down to -burst (`charge`'s floor); returns
        what it took, for `charge(-unused)` to give back once the call knows what it used.
        Taken up front, so calls admitted together cannot each pass on the same tokens. With
        only the floor, after the fact, one Warm of 32 prefills cost a tenant limited to 1
        request/s a ~4 s wait: ~8 prefills a second. Refused, the call's own request is given
        back (it did no work). RESOURCE_EXHAUSTED: retry later when the bucket will refill
        enough, else never (more than 2 x burst: raise the tenant's burst, or target owners)."""
        with self._lock:
            tenant = self._now(tenant)
            if tenant.rate_per_s <= 0 or requests <= 0:
                return 0
            b = self._refilled(tenant)
            if b.tokens - requests >= -float(tenant.burst):
                b.tokens -= requests
                return requests
            b.give_back(1.0, tenant.burst)
            need = requests + 1.0  # this call's prefills, its own request included
            # A retry takes its own request first (`check_rate`: a whole one), then its
            # prefills down to -burst: it passes once the bucket holds max(1, need - burst).
            # With need - burst alone, a bucket another call had left in debt meanwhile was
            # "retry in 1.00s", and the retry then refused by its rate check.
            now = math.floor(b.tokens + tenant.burst) if b.tokens >= 1.0 else 0
            REJECTED.labels(tenant.name, "rate_limit").inc()
            limit = (f"tenant {tenant.name}: this call needs {need:.0f} prefills, past the rate "
                     f"limit of {tenant.rate_per_s:g} requests/s (burst {tenant.burst})")
            if need > 2 * tenant.burst:
                raise ResourceExhausted(f"{limit}: at most {2 * tenant.burst} per call; warm "
                                        "fewer prompts, target the owners, or raise the "
                                        "tenant's burst")
            wait = (max(1.0, need - tenant.burst) - b.tokens) / tenant.rate_per_s
            raise Overloaded(f"{limit}: {now} now; retry in {wait:.2f}s")

    def _refilled(self, tenant: Tenant) -> _Bucket:
        """The tenant's bucket, refilled for the time since its last use (lock held), within
        [-burst, burst] of the limits now: a debt run up under a larger burst (the tokens file
        read again since) kept its depth, and a tenant whose rate and burst were lowered from
        100/s and 100 to 0.01/s and 1 after a large Warm waited 10,000 s, not `charge`'s
        (burst + 1) / rate_per_s."""
        now = self.clock()
        b = self._buckets.get(tenant.name)
        if b is None:
            b = self._buckets[tenant.name] = _Bucket(float(tenant.burst), now)
        b.tokens = max(-float(tenant.burst), min(
            float(tenant.burst), b.tokens + (now - b.at) * tenant.rate_per_s))
        b.at = now
        return b

    @staticmethod
    def require_admin(tenant: Tenant, what: str, verb: str = "read") -> None:
        """PERMISSION_DENIED unless the tenant is an admin (cluster-wide figures, erasure)."""
        if not tenant.admin:
            raise PermissionDenied(
                f"authorization: tenant {tenant.name} may not {verb} {what} (needs an admin "
                "token)")

    def _entry_tag(self, tenant: Tenant, entry_id: str) -> str:
        msg = f"entry:{tenant.name}:{entry_id}".encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()[:16]

    def entry_ref(self, tenant: Tenant, entry_id: str) -> str:
        """The reference to a semantic entry a tenant may pass back to Feedback: the id signed
        for that tenant, so that nobody can rate or invalidate another tenant's entry."""
        return f"{entry_id}.{self._entry_tag(tenant, entry_id)}" if entry_id else ""

    @staticmethod
    def signed_like(ref: str) -> bool:
        """Whether `ref` has the shape of a reference `entry_ref` makes (`<id>.<16 hex
        digits>`): one that then fails `entry_id` was signed for another tenant or with
        another hash key (one rotated since), not mistyped into another shape."""
        entry_id, _, tag = ref.rpartition(".")
        return bool(entry_id) and len(tag) == 16 and all(c in "0123456789abcdef" for c in tag)

    def entry_id(self, tenant: Tenant, ref: str) -> str | None:
        """The entry id behind `ref` if `ref` was issued to `tenant`, else None."""
        entry_id, _, tag = ref.rpartition(".")
        # Bytes: compare_digest refuses str with non-ASCII characters (a TypeError, INTERNAL).
        if not entry_id or not hmac.compare_digest(tag.encode(),
                                                   self._entry_tag(tenant, entry_id).encode()):
            return None
        return entry_id


def file_version(path: str) -> bytes | None:
    """The file's content digest (None: unreadable). The content, not its mtime: a rewrite
    within one timestamp tick, of the same size, went unseen."""
    try:
        with open(path, "rb") as f:  # follows a mounted Secret's ..data link to the current file
            return hashlib.sha256(f.read()).digest()
    except OSError:
        return None


def version_tag(version: bytes | None) -> str:
    """A tokens file version as logs name it: the first 12 hex digits of its sha256, what
    `sha256sum` prints for the file (a secret's digest, never its tokens)."""
    return version.hex()[:12] if version is not None else "unreadable"


def watch_tokens_file(registry: TenantRegistry, build: Callable[[], TenantRegistry],
                      path: str, every: float, stop: threading.Event,
                      seen: bytes | None = None) -> threading.Thread:
    """Read the tokens file again whenever it changes (checked every `every` seconds), and
    have `registry` adopt it. `seen`: the version `registry` was built from (`file_version`
    taken before that build; None: read now), so a change in between is not missed. A
    malformed file is said once per version, an unreadable one retried, and the tokens in
    force stay (never none: an emptied file is refused as at start)."""
    path = os.path.expanduser(path)
    first = file_version(path) if seen is None else seen
    TOKENS_STALE.set(0)

    def loop() -> None:
        seen = taken = first
        while not stop.wait(every):
            now = file_version(path)
            if now == seen:
                continue
            before, seen = seen, now
            if now is None:
                TOKENS_STALE.set(1)
                log.error("tokens file %s is gone: keeping the tokens read before (version %s)",
                          path, version_tag(taken))
                continue
            try:
                fresh = build()
                registry.adopt(fresh)
            except Exception as exc:  # noqa: BLE001 - a dead watcher kept revoked tokens
                if isinstance(exc, OSError):
                    # Tried again at the next check (too many open files, an I/O error): a
                    # version marked seen after a passing failure was never taken, a removed
                    # token accepted until the file changed again.
                    seen = before
                TOKENS_STALE.set(1)
                # Versions named: "read again: 2 tokens of 2 tenants" was the same line for
                # a token removed and one changed, and an operator could not tell which
                # version of the file was in force (`sha256sum` of the file says it).
                log.error("tokens file %s changed (version %s) but was not taken (%s): keeping "
                          "the tokens read before (version %s)", path, version_tag(now), exc,
                          version_tag(taken))
                continue
            taken = now
            TOKENS_STALE.set(0)
            log.info("tokens file %s read again: %s (version %s)", path, fresh.summary(),
                     version_tag(now))

    t = threading.Thread(target=loop, name="tokens-reload", daemon=True)
    t.start()
    return t

