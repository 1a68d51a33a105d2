"""Service configuration: frozen dataclasses read from prefixed env vars, overridden by flags.

Every field `foo_bar` of a service config is read from `TIERCACHE_<SERVICE>_FOO_BAR` and may be
overridden on the command line with `--foo-bar`. Values are parsed by the field's type and the
config's `validate()` runs at boot, so a bad setting fails fast with a message that names the
variable instead of surfacing later as a stray exception.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import math
import os
import re
import typing
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

from services.common.addresses import canonical_address, target_host
from services.common.errors import blank, model_id_problem, shown

T = TypeVar("T")

_TRUE = {"1", "true", "yes", "on"}
# No "" here: an empty value must not turn a default-on feature off (it is an error, as for
# numbers).
_FALSE = {"0", "false", "no", "off"}


class ConfigError(ValueError):
    """A setting is missing or malformed; the message names the env variable or flag."""


def env_name(service: str, field: str) -> str:
    """`env_name("kvpool", "num_blocks")` -> `TIERCACHE_KVPOOL_NUM_BLOCKS`."""
    return f"TIERCACHE_{service.upper()}_{field.upper()}"


# Largest float a setting may have (seconds: about 31 years).
MAX_FLOAT_SETTING = 1e9


def _parse(raw: str, typ: Any, where: str) -> Any:
    origin = typing.get_origin(typ)
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        args = [a for a in typing.get_args(typ) if a is not type(None)]
        if raw == "":
            return None
        return _parse(raw, args[0], where)
    if origin in (tuple, list):
        return _parse_list(raw, typ, where)
    try:
        if typ is bool:
            low = raw.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
            raise ValueError(f"expected true/false, got {raw!r}")
        if typ is int:
            try:
                return int(raw)
            except ValueError:  # Python's "invalid literal for int() with base 10: 'abc'"
                raise ValueError(f"expected a whole number, got {raw!r}") from None
        if typ is float:
            try:
                v = float(raw)
            except ValueError:  # "could not convert string to float: 'abc'"
                raise ValueError(f"expected a number, got {raw!r}") from None
            if not math.isfinite(v):  # nan/inf pass float() and break timers and sleeps later
                raise ValueError(f"expected a finite number, got {raw!r}")
            if abs(v) > MAX_FLOAT_SETTING:
                # Durations this long overflow Event.wait (threading.TIMEOUT_MAX) and gRPC
                # deadlines: a lease sweeper died, every call expired at once.
                raise ValueError(f"expected at most {MAX_FLOAT_SETTING:g} in size, got {raw!r}")
            return v
        if typ is str:
            # Surrounding whitespace (a YAML quirk, a value pasted with a newline) is never
            # meant: " 127.0.0.1:50054" passed validation, which strips, then went out as is
            # and the prefix index refused the replica's Register for good.
            return raw.strip()
    except ValueError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    raise ConfigError(f"{where}: unsupported config type {typ!r}")


def _parse_list(raw: str, typ: Any, where: str) -> tuple:
    """A comma-separated setting: its entries, stripped, each parsed as the list's type."""
    (inner, *_) = typing.get_args(typ) or (str,)
    items = [s.strip() for s in raw.split(",") if s.strip()]
    if raw.strip() and not items:
        # "," read as no entries: prefix_addresses="," ran without the index, no word said.
        raise ConfigError(f"{where}: only commas, no entry")
    return tuple(_parse(s, inner, where) for s in items)


def parse_bool(raw: str, where: str) -> bool:
    """`raw` read as a boolean setting is (true/false, 1/0, yes/no, on/off); ConfigError
    naming `where` for any other word."""
    return _parse(raw, bool, where)


def load_config(
    cls: type[T],
    service: str,
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build `cls` from defaults, then env vars, then `--flags`, and validate it.

    Raises:
        ConfigError: a value does not parse or `cls.validate()` rejects it.
    """
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    # No abbreviations: "--max-tokens" silently set max_tokens_limit, not the default.
    parser = argparse.ArgumentParser(
        prog=f"python -m services.{service}", allow_abbrev=False, formatter_class=_HelpLines,
        epilog="Each setting in full: docs/settings.md (the same descriptions).")
    notes = field_notes(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        # What the setting means under where it is read from: --help listed names and defaults
        # only. argparse %-formats help ("3.4%" broke it): a note's % is doubled.
        note = notes.get(f.name, "")
        meaning, shown = summary(note), _shown_default(f)
        # What the default stands for where it is a sentinel ("default 0" said nothing when
        # the note's "0 = the model's context" fell outside the first sentence).
        stands = default_stands_for(note, shown)
        if stands and stands not in meaning:
            shown += f" ({stands})"
        parser.add_argument("--" + f.name.replace("_", "-"), dest=f.name, default=None,
                            metavar=_metavar(hints[f.name]),
                            help=(f"env {env_name(service, f.name)}; default {shown}"
                                  + (f"\n{meaning}" if meaning else "")).replace("%", "%%"))
    args = parser.parse_args(list(argv) if argv is not None else [])
    flags: dict[str, str] = {}  # env name -> the flag that set the field instead
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        raw = getattr(args, f.name)
        var = env_name(service, f.name)
        if raw is not None:  # a flag wins: the env value it overrides is not read at all
            flags[var] = "--" + f.name.replace("_", "-")
            values[f.name] = _parse(raw, hints[f.name], flags[var])
        elif var in environ:
            values[f.name] = _parse(environ[var], hints[f.name], var)
    _refuse_unknown_names(cls, service, environ)
    for name, what in _EMPTY_TURNS_OFF.items():
        if isinstance(values.get(name), str) and not values[name].strip():
            # A Secret made from an unset variable or an empty file: taken as "not set", it
            # turned a security feature off without a word.
            where = flags.get(env_name(service, name)) or env_name(service, name)
            raise ConfigError(f"{where}: set but empty; unset it to run without {what}")
    token = values.get("internal_token")
    if isinstance(token, str):
        # A Secret made with --from-file ends in a newline; gRPC refuses such metadata (and
        # anything non-ASCII) on every call, long after the service said it was serving.
        token = values["internal_token"] = token.strip()
        if not all(0x21 <= ord(c) <= 0x7E for c in token):
            # Named as given: `--internal-token "a b"` was blamed on the variable, unset.
            where = (flags.get(env_name(service, "internal_token"))
                     or env_name(service, "internal_token"))
            raise ConfigError(f"{where}: printable ASCII without spaces only (it travels as "
                              "gRPC metadata)")
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as exc:
            raise ConfigError(_as_given(str(exc), flags)) from None
    return cfg


def _as_given(msg: str, flags: Mapping[str, str]) -> str:
    """`msg` ("VAR: why") naming the flag that set VAR, if one did: name what the user typed."""
    var = msg.split(":", 1)[0]
    return f"{flags[var]} (env {var}){msg[len(var):]}" if var in flags else msg


def named_as_given(msg: str, service: str, argv: Sequence[str]) -> str:
    """`msg` of a check made after `load_config` (a path this host must have), naming the
    flag in `argv` that set its variable, as `load_config`'s own refusals do."""
    var = msg.split(":", 1)[0]
    prefix = env_name(service, "")
    if not var.startswith(prefix):
        return msg
    flag = "--" + var[len(prefix):].lower().replace("_", "-")
    given = any(a == flag or a.startswith(flag + "=") for a in argv)
    return _as_given(msg, {var: flag} if given else {})


# Settings whose empty value would turn a security feature off (as if unset): refused. Empty,
# the internal credential opened semantic, prefix and kvpool to anyone who can connect, and
# the tenant tokens made every caller the admin tenant.
_EMPTY_TURNS_OFF = {"internal_token": "an internal credential",
                    "tokens": "authentication (every caller the default tenant)",
                    "tokens_file": "authentication (every caller the default tenant)"}
# The services' prefixes (TIERCACHE_<SERVICE>_), and the shared TIERCACHE_ names anything in
# this project reads: another TIERCACHE_ name is a typo (TIERCACHE_TLS_CA_FILE left mutual
# TLS off, TIERCACHE_HASHKEY the public development key in force, without a word).
SERVICES = ("SEMANTIC", "PREFIX", "KVPOOL", "ORCHESTRATOR")
SHARED_NAMES = frozenset("""TLS_CERT TLS_KEY TLS_CA TLS_CLIENT_CERT TLS_CLIENT_KEY HASH_KEY
LOG_LEVEL DRAIN_DELAY_S CACHE_DIR PURE_PYTHON_HASH PARENT_PID DATA_DIR REPLICAS ADDRESS TOKEN
CLI_HOME TEST_DEVICE TEST_LOGS""".split())
# Names under a service's prefix that are read outside its config class.
_READ_ELSEWHERE = ("TLS_CERT", "TLS_KEY", "TLS_CLIENT_AUTH")
# Shared settings a per-service name is often mistaken for.
_SHARED = {"TLS_CA": "TIERCACHE_TLS_CA", "TLS_CLIENT_CERT": "TIERCACHE_TLS_CLIENT_CERT",
           "TLS_CLIENT_KEY": "TIERCACHE_TLS_CLIENT_KEY", "HASH_KEY": "TIERCACHE_HASH_KEY",
           "LOG_LEVEL": "TIERCACHE_LOG_LEVEL"}
# What Kubernetes puts in every pod for each Service of its namespace (service links): a
# Service named tiercache-orchestrator gives TIERCACHE_ORCHESTRATOR_SERVICE_HOST=10.0.0.9,
# _SERVICE_PORT=50051, _PORT=tcp://10.0.0.9:50051, _PORT_50051_TCP_ADDR=10.0.0.9... Matched
# on the whole rest of the name and on the value's form: a name merely ending in _PORT (a
# typo of METRICS_PORT) is still a typo.
_URL = r"(tcp|udp|sctp)://\S+"
_HOST = r"[0-9A-Fa-f.:]+"
# A Service named tiercache-orchestrator-public gives TIERCACHE_ORCHESTRATOR_PUBLIC_...: the
# rest of its name may come first.
_NAME = r"(?:[A-Z0-9_]+_)?"
_SERVICE_LINK = [
    (re.compile(_NAME + r"SERVICE_HOST"), re.compile(_HOST)),
    (re.compile(_NAME + r"SERVICE_PORT(_[A-Z0-9_]+)?"), re.compile(r"\d+")),
    (re.compile(_NAME + r"PORT(_\d+_(TCP|UDP|SCTP))?"), re.compile(_URL)),
    (re.compile(_NAME + r"PORT_\d+_(TCP|UDP|SCTP)_PROTO"), re.compile(r"tcp|udp|sctp")),
    (re.compile(_NAME + r"PORT_\d+_(TCP|UDP|SCTP)_PORT"), re.compile(r"\d+")),
    (re.compile(_NAME + r"PORT_\d+_(TCP|UDP|SCTP)_ADDR"), re.compile(_HOST)),
]


def _service_link(rest: str, value: str) -> bool:
    """Whether `rest` (a variable name after the service's prefix) = `value` is one of the
    variables Kubernetes sets for a Service."""
    return any(name.fullmatch(rest) and form.fullmatch(value)
               for name, form in _SERVICE_LINK)


def _refuse_unknown_names(cls: type, service: str, environ: Mapping[str, str]) -> None:
    """A TIERCACHE_<SERVICE>_ variable no setting reads is a typo: ignored, it left the
    default in force without a word (TIERCACHE_ORCHESTRATOR_KVPOOL_ADDRESS, singular, kept the
    default replica address)."""
    _refuse_unknown_shared(service, environ)
    prefix = env_name(service, "")
    fields = [f.name.upper() for f in dataclasses.fields(cls)]
    known = set(fields) | set(_READ_ELSEWHERE)
    unknown = sorted(v for v in environ if v.startswith(prefix) and v[len(prefix):] not in known
                     and not _service_link(v[len(prefix):], environ[v]))
    if unknown:
        hints = []
        for v in unknown:
            rest = v[len(prefix):]
            # Compared after the prefix: whole names all look alike (DEBUG "meant" MODEL); and
            # in capitals, as the names are (..._num_blocks got no hint, for all its likeness).
            close = ([_SHARED[rest]] if rest in _SHARED
                     else [prefix + c for c in difflib.get_close_matches(
                         rest.upper(), fields, n=1, cutoff=0.75)])
            hints.append(f"{v} (did you mean {close[0]}?)" if close else v)
        raise ConfigError(f"{'; '.join(hints)}: not a setting of this service (python -m "
                          f"services.{service} --help lists them; TLS files are "
                          f"{prefix}TLS_CERT/_KEY or the shared TIERCACHE_TLS_*)")


def _refuse_unknown_shared(service: str, environ: Mapping[str, str]) -> None:
    """A TIERCACHE_ variable under no service's prefix that nothing reads is a typo of a
    shared setting (or of a service's prefix)."""
    prefixes = tuple(f"TIERCACHE_{s}_" for s in (*SERVICES, service.upper()))
    unknown = sorted(v for v in environ if v.startswith("TIERCACHE_")
                     and not v.startswith(prefixes) and v[10:] not in SHARED_NAMES
                     and not _service_link(v[10:], environ[v]))
    if unknown:
        hints = []
        for v in unknown:
            close = difflib.get_close_matches(v[10:], sorted(SHARED_NAMES), n=1, cutoff=0.6)
            hints.append(f"{v} (did you mean TIERCACHE_{close[0]}?)" if close else v)
        raise ConfigError(f"{'; '.join(hints)}: no such setting (the shared ones are "
                          f"{', '.join('TIERCACHE_' + n for n in sorted(SHARED_NAMES))}; a "
                          f"service's own start TIERCACHE_<SERVICE>_)")


def _shown_default(f: dataclasses.Field) -> str:
    """A field's default for --help ("" shown as none; secrets are never set by default)."""
    if f.default is not dataclasses.MISSING:
        d = f.default
    elif f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        d = f.default_factory()  # type: ignore[misc]
    else:
        return "none (required)"
    if d == "" or d == ():
        return "none"
    if isinstance(d, bool):
        return "true" if d else "false"
    if isinstance(d, tuple):
        return ",".join(map(str, d))
    return str(d)


class _HelpLines(argparse.HelpFormatter):
    """Help keeps its own line breaks (variable and default, then the meaning), each part
    wrapped as argparse wraps."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        wrap = super()._split_lines  # not in the comprehension: super() needs this frame
        return [w for part in text.splitlines() for w in wrap(part, width)]


@functools.cache
def field_notes(cls: type) -> Mapping[str, str]:
    """Field -> the comment written with it in the class's source (the lines just above the
    field, then the comment after it): docs/settings.md's "meaning" and --help's. Empty when
    the source cannot be read. Read once per class (read-only): inspect and ast take ~100x
    the rest of a load_config, which every start and many tests run."""
    try:
        lines, _ = inspect.getsourcelines(cls)
    except (OSError, TypeError):
        return MappingProxyType({})
    source = "".join(lines)
    out: dict[str, str] = {}
    tree = ast.parse(inspect.cleandoc("\n" + source) if source.startswith(" ") else source)
    body = tree.body[0].body  # the class
    text = source.splitlines()
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        row = node.lineno - 1
        above: list[str] = []
        k = row - 1
        while k >= 0 and text[k].strip().startswith("#"):
            above.insert(0, text[k].strip().lstrip("#").strip())
            k -= 1
        line = text[row]
        after = line.split("#", 1)[1].strip() if "#" in line and '"#' not in line else ""
        out[node.target.id] = " ".join(p for p in (" ".join(above), after) if p)
    return MappingProxyType(out)


# A sentence ends at a full stop before a capital, quote or bracket ("e.g. the" and "0.5 s"
# do not end one).
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)\.\s+(?=[A-Z0-9\"'(`])")
SUMMARY_CHARS = 160


def summary(note: str) -> str:
    """A setting's meaning in one line for --help: the note's first sentence; of a longer one
    its head up to the first ": " or "; " (what the setting is, before the detail), else up
    to its last ", " or " (" that fits, never inside brackets ("... ranked by use count (LFU
    ..." read as broken)."""
    m = _SENTENCE_END.search(note)
    first = note[:m.start() + 1] if m else note
    if len(first) <= SUMMARY_CHARS:
        return first
    cuts = [i for i in range(8, SUMMARY_CHARS)
            if first[i:i + 2] in (": ", "; ", ", ", " (")
            and first[:i].count("(") == first[:i].count(")")]
    heads = [i for i in cuts if first[i:i + 2] in (": ", "; ")]
    cut = heads[0] if heads else cuts[-1] if cuts else first[:SUMMARY_CHARS].rfind(" ")
    return first[:cut] + " ..."


def default_stands_for(note: str, shown: str) -> str:
    """What the note says a default of `shown` stands for ("0 = any free port" -> "any free
    port"), up to the clause's end (the next clause, a bracket, a colon or semicolon, a full
    stop: not a dot inside it, as in "<db_path>.hnsw"); "" when it says nothing of that value.
    A default shown as none is written '""' in notes."""
    said = '""' if shown == "none" else shown
    m = re.search(rf"(?<![\w.-]){re.escape(said)} (?:=|means) ([^;:()]+?)"
                  r"(?=, \S+ =|[;:()]|\.(?:\s|$)|$)", note)
    return m.group(1).strip() if m else ""


def _metavar(typ: Any) -> str:
    """What a flag takes, for --help: true/false for booleans (a value is required)."""
    if typ is bool:
        return "{true,false}"
    if typing.get_origin(typ) in (tuple, list):
        return "A,B,..."
    return {int: "N", float: "X"}.get(typ, "VALUE")


# Shortest secret (hash key, internal credential, tenant token) taken without a warning: 16
# characters of a random alphabet are ~96 bits and more.
MIN_SECRET_CHARS = 16


def weak_secret(value: str | bytes) -> str:
    """Why `value` is no secret to run a cluster on ("" when it looks like one): a template's
    placeholder, or too short to resist guessing. Said at start, not refused: a laptop's
    cluster may run the dev overlay's placeholders."""
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    low = text.lower()
    if "placeholder" in low or "change-me" in low or "changeme" in low:
        return "a placeholder"
    if len(text) < MIN_SECRET_CHARS:
        return f"shorter than {MIN_SECRET_CHARS} characters"
    return ""


def moved(cfg: Any, field: str, other: str) -> str:
    """`field` if `cfg` has it changed from its default, else `other`: of two settings in
    conflict, the one to name is the one the user set (threshold_floor lowered to 0.75 was
    blamed on draft_floor, which the user never set)."""
    default = type(cfg).__dataclass_fields__[field].default
    return field if getattr(cfg, field) != default else other


def require(cond: bool, service: str, field: str, why: str) -> None:
    """Raise ConfigError naming the env variable of `field` unless `cond` holds."""
    if not cond:
        raise ConfigError(f"{env_name(service, field)}: {why}")


# gRPC target schemes an address to dial may start with (name resolution, not host:port).
_GRPC_SCHEMES = ("dns:", "ipv4:", "ipv6:", "xds:")


def require_model_id(model_id: str, service: str) -> None:
    """The prefix index's rules for a model id (Register and Match), checked at start: longer
    than 256 characters or with a NUL, every call was refused; of only whitespace or
    invisible characters, it named a model nobody can see ("" = derived from the model); with
    another character that prints as nothing or as a space, every Register was refused."""
    require(len(model_id) <= 256 and "\0" not in model_id, service, "model_id",
            "at most 256 characters, no NUL")
    require(not model_id or not blank(model_id), service, "model_id",
            "empty (derived from the model) or visible text, not only whitespace or "
            "invisible characters")
    problem = model_id_problem(model_id)
    require(not problem, service, "model_id", problem)


def is_host_port(a: str, *, listen: bool = False, dialed: bool = False) -> bool:
    """host:port, the host anything without spaces, commas, semicolons or slashes (a name, an
    IPv4 address, a [bracketed] IPv6 address), or a gRPC target such as dns:///name:port to
    dial; the port 1..65535, or 0..65535 for an address to listen on (0 = any free port).
    A bare IPv6 address (fd00::5:50054) stands only for an address nobody dials (a replica's
    advertised one, as a pod IP gives it): gRPC fails to dial it ("Misformatted domain name")
    and to listen on it."""
    host, sep, port = a.rpartition(":")
    if not (sep and host and port.isascii() and port.isdigit()
            and (1 - listen) <= int(port) <= 65535):
        return False
    if any(c.isspace() or c in ",;" for c in host):
        return False
    named = target_host(host) or host
    if blank(named[1:-1] if named.startswith("[") and named.endswith("]") else named):
        # "\u3164:50054" and "\u200b:1" passed: a host nobody can read, and no name gRPC
        # resolves (a replica announcing it was handed out by every Match, undialable); so
        # did "[]:50054", which gRPC cannot parse to listen on or dial.
        return False
    if host.startswith(_GRPC_SCHEMES):
        # dns://x:1 reads x:1 as the DNS server and leaves no host ("no server name supplied")
        return not listen and not (host.startswith("dns://") and "/" not in host[6:]) \
            and target_host(host) != ""
    if "/" in host:  # http://host:1, a path: no target gRPC reaches
        return False
    if ":" in host and (listen or dialed):
        return host.startswith("[") and host.endswith("]")
    return True


def announce_problem(a: str) -> str:
    """Why the prefix index refuses `a` as the address a replica announces at Register, or ""
    when it takes it. The one rule for both sides: the index applies it at Register, and a
    kvpool replica with a prefix index set applies it at start, where a refused address left
    it serving but never indexed (INVALID_ARGUMENT, retried for good). The address is what
    Match and TopPrefixes hand out as where a prefix lives: host:port with a port 1..65535 (a
    bare IPv6 pod IP too, as the manifests build it; nobody dials it), at most 256 printable
    characters without spaces, as it goes into Stats, logs and routing as it is."""
    if not a:
        return "required"
    if len(a) > 256:
        return "longer than 256 characters"
    if not is_host_port(a):
        return f"{shown(a)} is not host:port"
    if not a.isprintable() or any(c.isspace() for c in a):
        return "printable characters without spaces only"
    return ""


def _why_not(a: str) -> str:
    scheme = re.match(r"([A-Za-z][A-Za-z0-9+.-]*)://", a)
    if scheme and not a.startswith(_GRPC_SCHEMES):
        # "http://x:1" read as an IPv6 host ("[http://x]:port" was the hint).
        return (f"{a!r} is not host:port (no {scheme.group(1)}:// URL: host:port, or a gRPC "
                "target such as dns:///host:port)")
    host = a.rpartition(":")[0]
    if host.startswith("dns://") and "/" not in host[6:]:
        return (f"{a!r} is not host:port (dns:///host:port, three slashes: dns://X/ names "
                "X as the DNS server to ask)")
    if host.startswith(_GRPC_SCHEMES) and target_host(host) == "":
        return f"{a!r} is not host:port (the target names no host before its port)"
    if any(c in ",;" for c in host):
        # "a:1;b:2" got the IPv6 hint ("[a:1;b]:port"): a list in the wrong separator.
        return f"{a!r} is not host:port (one address per entry, entries separated by commas)"
    if ":" in host and not host.startswith(("[", *_GRPC_SCHEMES)):
        return f"{a!r} is not host:port (an IPv6 address goes in brackets: [{host}]:port)"
    return f"{a!r} is not host:port"


def require_listen_address(address: str, service: str) -> None:
    """The address a service binds: host:port with a port in 0..65535. gRPC took a port
    over 65535 modulo 65536 and served on another port without a word."""
    require(is_host_port(address.strip(), listen=True), service, "address",
            f"{_why_not(address.strip())} (port 0..65535, 0 = any free one)")


def require_shard_list(text: str, service: str, field: str) -> None:
    """A comma-separated shard list where "" turns the tier off: anything else must name at
    least one shard (`require_addresses`). "," turned the tier off without a word."""
    if text.strip():
        require_addresses(text.split(","), service, field, allow_none=False)


def require_addresses(addresses, service: str, field: str, *, allow_none: bool,
                      dialed: bool = True) -> None:
    """Each address is host:port (see `is_host_port`), none twice; at least one unless
    `allow_none`. Blank entries (a trailing comma) are ignored, as the clients ignore them.

    Checked at start so that a bad list is a one-line ConfigError (exit 2), not a traceback
    from the client that dials it once the model has loaded.
    """
    items = [a.strip() for a in addresses if a.strip()]
    if not items:
        require(allow_none, service, field, "must name at least one host:port")
        return
    for a in items:
        require(is_host_port(a, dialed=dialed), service, field, _why_not(a))
    # Compared as shards are placed (`canonical_address`): `host:1` and `HOST:1` are one.
    seen: dict[str, str] = {}
    for i, a in enumerate(items):
        first = seen.setdefault(canonical_address(a), a)
        require(len(seen) == i + 1, service, field,
                f"{a} given twice" if first == a else f"{first} and {a} name the same address")
