"""Typed domain errors and their mapping to gRPC status codes.

Domain code (pool, index, embedder...) raises these and never imports grpc; the server adapter
turns them into a status with a message that names the offending field.
"""

from __future__ import annotations

import contextlib
import struct
import unicodedata

# Longest client value a status message repeats (gRPC refuses a status over 16 KiB of
# metadata, and the client then sees a transport error that names no field).
SHOWN_CHARS = 64


def shown(value: object) -> str:
    """`repr(value)` for a status message, cut to SHOWN_CHARS characters of the value."""
    if isinstance(value, str) and len(value) > SHOWN_CHARS:
        return f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"
    return repr(value)


# Format characters (Cf) that are drawn: Unicode's Prepended_Concatenation_Mark (the Arabic
# number signs, end of ayah "۝", the Syriac abbreviation mark, the Kaithi number signs).
_DRAWN_FORMAT = frozenset("\u0600\u0601\u0602\u0603\u0604\u0605\u06dd\u070f\u0890\u0891"
                          "\u08e2\U000110bd\U000110cd")


# Unicode's Default_Ignorable_Code_Point characters that are neither Cf nor Cc: letters and
# marks that draw nothing (the Hangul fillers are Lo, the variation selectors and the
# combining grapheme joiner Mn), so a text of only them passed as text: "\u3164" was
# answered and stored, and every other such question hit it, as zero-width ones had. And
# U+2800 BRAILLE PATTERN BLANK (So, not in that list): a cell with no dot, drawn as a space
# (Braille's space between words), so a tenant "\u2800" printed as nothing.
_INVISIBLE = frozenset("\u034f\u115f\u1160\u17b4\u17b5\u180b\u180c\u180d\u180f\u2800\u3164"
                       "\uffa0"
                       + "".join(map(chr, range(0xFE00, 0xFE10)))
                       + "".join(map(chr, range(0xE0100, 0xE01F0))))


def as_written(x: float) -> str:
    """A float32 from the wire as its caller wrote it: the fewest digits that give the same
    float32 (0.1, not 0.10000000149011612; 1.000002, which `:g` cut to "1")."""
    try:
        want = struct.pack("<f", x)
    except (OverflowError, struct.error):  # no float32 (a double's, past its range)
        return f"{x:g}"
    for digits in range(1, 10):
        said = f"{x:.{digits}g}"
        if struct.pack("<f", float(said)) == want:
            return said
    return f"{x:g}"


def blank(text: str) -> bool:
    """True when `text` holds nothing a reader sees: only whitespace, control (Cc) and format
    (Cf: zero-width spaces and joiners, a BOM, direction marks) characters, but for the few
    format characters that are drawn (a question of only "۝" is text), and the other
    characters Unicode says draw nothing (the Hangul fillers, variation selectors, the
    combining grapheme joiner, Mongolian free variation selectors, Khmer inherent vowels)
    and the Braille blank U+2800.
    `str.strip()` keeps "\u200b": a message of zero-width characters was answered, and its
    answer stored in the semantic tier, where every other invisible question then matched it.
    Stops at the first visible character (a long text costs nothing more)."""
    return all(c.isspace() or c in _INVISIBLE
               or unicodedata.category(c) in ("Cc", "Cf") and c not in _DRAWN_FORMAT
               for c in text)


def name_problem(name: str) -> str:
    """Why `name` (a tenant's) cannot tell one tenant from another as printed, or "" when it
    can: a character that prints as nothing or as a space (control, format, other whitespace
    than a plain space, blank()'s invisible ones), a plain space first or last, or a form
    other than NFC. "acme\u200b" and NFD "café" were tenants of their own, with their own
    salts, printed as "acme" and "café" in logs, metric labels and Stats, and an EraseTenant
    of what the log showed missed them; so was "acme " at a semantic shard, whose check took
    it where the tokens file refuses it."""
    if hidden := _hidden_char(name):
        return hidden
    if name != name.strip(" "):
        return (f"{'begins' if name.startswith(' ') else 'ends'} with {_char(' ')}, which "
                "prints as nothing there")
    if not unicodedata.is_normalized("NFC", name):
        c = next(c for i, c in enumerate(name, 1)
                 if not unicodedata.is_normalized("NFC", name[:i]))
        return (f"is not in Unicode NFC form (at {_char(c)}): write it as "
                f"{unicodedata.normalize('NFC', name)!r}")
    return ""


def model_id_problem(model_id: str) -> str:
    """Why `model_id` cannot name a model as printed, or "" when it can: a character that
    prints as nothing or as a space (name_problem's, a plain space allowed). "m\x1b[2J\n"
    was registered with the prefix index, and its escape cleared the terminal of whoever read
    the log line or Stats; "llama\u200b" was a model of its own that printed as "llama".
    Every id a model folder or a hub gives ("org/model", "Qwen2.5-0.5B", "my model") passes;
    NFD is not refused (a folder's name on macOS)."""
    return _hidden_char(model_id)


def _hidden_char(text: str) -> str:
    """"holds U+...": `text`'s first character that prints as nothing or as a space (control,
    format, whitespace other than a plain space, blank()'s invisible ones), or ""."""
    for c in text:
        if c != " " and (blank(c) or unicodedata.category(c) in ("Cc", "Cf")):
            return f"holds {_char(c)}, a character that prints as nothing or as a space"
    return ""


def _char(c: str) -> str:
    """"U+200B (ZERO WIDTH SPACE)": a character a message cannot show as itself."""
    label = unicodedata.name(c, "")
    return f"U+{ord(c):04X}" + (f" ({label})" if label else "")


def lone_surrogate(text: str) -> int | None:
    """The character index of `text`'s first lone surrogate (a str that is not UTF-8, which
    protobuf and the tokenizers refuse with errors naming no field), or None."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


class TierCacheError(Exception):
    """Base class; `code` is the grpc.StatusCode name the adapter uses, and `trailers` the
    trailing metadata it sends with the status (key, value pairs)."""

    code = "INTERNAL"
    trailers: tuple[tuple[str, str], ...] = ()


class InvalidArgument(TierCacheError):
    """A request field is malformed. The message starts with the field name."""

    code = "INVALID_ARGUMENT"

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


class NotFound(TierCacheError):
    code = "NOT_FOUND"


class ResourceExhausted(TierCacheError):
    code = "RESOURCE_EXHAUSTED"


# Trailing metadata key set on an Overloaded status (value "1"), so a caller with other servers
# to try can tell "busy now" from a request that can never fit.
OVERLOADED_KEY = "tiercache-overloaded"


class Overloaded(ResourceExhausted):
    """This server cannot take the request now (its queue is full, its memory held); another
    replica may. RESOURCE_EXHAUSTED with the OVERLOADED_KEY trailer."""


# What gRPC itself answers (RESOURCE_EXHAUSTED, no trailer) to a call past a server's
# `maximum_concurrent_rpcs` (`bootstrap.create_server`): busy now, like Overloaded.
RPC_CAP_DETAILS = "Concurrent RPC limit exceeded!"


def overloaded(rpc_error: object) -> bool:
    """True when a gRPC error carries the Overloaded trailer, or is gRPC's own refusal of a
    call past the server's cap on concurrent calls."""
    details = getattr(rpc_error, "details", None)
    with contextlib.suppress(Exception):  # a call object without details
        if callable(details) and details() == RPC_CAP_DETAILS:
            return True
    return any(k == OVERLOADED_KEY for k, _ in _trailers(rpc_error))


def _trailers(rpc_error: object) -> tuple:
    """The trailing metadata of a gRPC error as (key, value) pairs; () when it has none."""
    trailers = getattr(rpc_error, "trailing_metadata", None)
    try:
        return tuple(trailers() or ()) if callable(trailers) else ()
    except Exception:  # noqa: BLE001 - a call object without trailers
        return ()


# Trailing metadata of a Prefill that did its work but could not pin it (PinRefused): how many
# prompt tokens it had, found cached and computed, so a Warm result says what was done.
PREFILL_WORK_KEYS = ("tiercache-prompt-tokens", "tiercache-cached-tokens",
                     "tiercache-computed-tokens")


def pool_room(num_blocks: int, block_size: int, prompt_tokens: int) -> str:
    """The end of a "too big for the pool" refusal: what max_tokens fits beside the prompt in
    a pool of `num_blocks` blocks. kvpool says it, and the orchestrator says it again for the
    largest pool known when a smaller one refused (the words clients and the CLI read)."""
    room = num_blocks * block_size - prompt_tokens + 1
    return (f"; sampling.max_tokens of at most {room} fits" if room > 0
            else "; the prompt alone is too long for it")


class PinRefused(ResourceExhausted):
    """A prefill computed and cached its prompt, but the pool refused to pin it."""

    def __init__(self, message: str, prompt_tokens: int, cached_tokens: int,
                 computed_tokens: int) -> None:
        super().__init__(message)
        self.work = (prompt_tokens, cached_tokens, computed_tokens)
        self.trailers = tuple(zip(PREFILL_WORK_KEYS, map(str, self.work), strict=True))


def prefill_work(rpc_error: object) -> tuple[int, int, int]:
    """(prompt, cached, computed) tokens a failed Prefill says it did (PinRefused's trailers),
    else zeros."""
    md = dict(_trailers(rpc_error))
    try:
        work = tuple(int(md.get(k, 0)) for k in PREFILL_WORK_KEYS)
    except (TypeError, ValueError):  # not ours: no figures rather than a wrong one
        return (0, 0, 0)
    return work if all(0 <= n < 2**32 for n in work) else (0, 0, 0)


class FailedPrecondition(TierCacheError):
    code = "FAILED_PRECONDITION"


class Unavailable(TierCacheError):
    code = "UNAVAILABLE"


class Starting(Unavailable):
    """UNAVAILABLE: the service is still loading (its model, its entries). Pollers ask every
    second meanwhile, so the server logs it once a minute per method, not once a call: a
    replica loading its model for a minute wrote 60 "Stats ended UNAVAILABLE" INFO lines."""


class DeadlineExceeded(TierCacheError):
    code = "DEADLINE_EXCEEDED"


class Unauthenticated(TierCacheError):
    code = "UNAUTHENTICATED"


class PermissionDenied(TierCacheError):
    code = "PERMISSION_DENIED"


class Cancelled(TierCacheError):
    code = "CANCELLED"
