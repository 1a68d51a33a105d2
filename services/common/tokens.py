"""Token-id checks shared by the services that take token ids from a request."""

from __future__ import annotations

from collections.abc import Iterable

from services.common import errors

# Stop token ids one request may give.
MAX_STOP_TOKEN_IDS = 256


def validate_tokens(field: str, ids: Iterable[int], vocab: float, *,
                    allow_empty: bool = False) -> list[int]:
    """Token ids as a list; raise InvalidArgument naming `field` if empty or out of the vocab
    (the ids 0 <= id < `vocab`; math.inf: any id >= 0)."""
    out = list(ids)
    if not out and not allow_empty:
        raise errors.InvalidArgument(field, "must not be empty")
    # Negative too: the proto fields are uint32, but a Python caller's -1 would index the
    # embedding table from its end.
    bad = next((t for t in out if not 0 <= t < vocab), None)
    if bad is not None:
        raise errors.InvalidArgument(field,
                                     f"token id {bad} is outside the vocabulary [0, {vocab})")
    return out


def validate_stop_ids(ids: Iterable[int], vocab: float) -> list[int]:
    """`sampling.stop_token_ids`: at most MAX_STOP_TOKEN_IDS, each inside the vocabulary."""
    out = list(ids)
    if len(out) > MAX_STOP_TOKEN_IDS:
        raise errors.InvalidArgument("sampling.stop_token_ids",
                                     f"more than {MAX_STOP_TOKEN_IDS} ids")
    return validate_tokens("sampling.stop_token_ids", out, vocab, allow_empty=True)
