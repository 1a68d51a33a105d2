"""A differential review of `services.common.tokens` against a model of its docstrings, the
proto comments (kvpool.proto's token_ids "must be non-empty", common.proto's stop_token_ids)
and docs/reliability.md's table (token ids outside the vocabulary: INVALID_ARGUMENT naming the
field).

Model. The vocabulary of size V is the ids 0 <= id < V (V may be math.inf: the orchestrator's
"vocabulary unknown", where only the count is checked). `validate_tokens(field, ids, V,
allow_empty=)`: the ids as a list, in order, the same values; an empty one (unless
allow_empty) an InvalidArgument "<field>: must not be empty"; otherwise the first id outside
the vocabulary an InvalidArgument whose one-line message starts with "<field>: " and names that
id. `validate_stop_ids(ids, V)`: more than MAX_STOP_TOKEN_IDS (256) ids is an InvalidArgument
for `sampling.stop_token_ids` "more than 256 ids", checked before the vocabulary; otherwise
`validate_tokens("sampling.stop_token_ids", ids, V, allow_empty=True)`. The ids come as lists,
tuples, one-shot generators and the real proto repeated fields (KvGenerateRequest.token_ids,
SamplingParams.stop_token_ids); lists are sized around the 256 limit and the vocabulary's edge
(V - 1, V, 2^32 - 1), with negative ids in the plain-Python ones (the proto fields are uint32).

Run offline: 5,000 seeds x 60 calls (TOKENS_DIFFERENTIAL_SEEDS=5000); 60 by default (~0.5 s).
Found and fixed (tokens.py, guarded in tests/test_tokens_rules.py): a negative id was taken as
inside the vocabulary (only `id >= V` was checked), though the docstring refuses ids "out of
the vocab"; not reachable over gRPC (uint32 fields), but a Python caller's -1 would index the
embedding table from its end. Left as is: non-integer ids (3.5, True) are not refused - every
caller hands over a uint32 proto field. Injected bugs caught: 11 of 11 (`<` as `<=`, the first
bad id as the last, allow_empty ignored, empty never refused, 256 counted with `>=`, the count
checked after the vocabulary, the stop field misnamed, allow_empty=False for stop ids, a
generator returned un-listed, the negative check dropped, the message naming the first id).
"""

from __future__ import annotations

import math
import os
import random
from functools import partial

import pytest
from tiercache.v1 import common_pb2, kvpool_pb2

from services.common import errors, tokens

SEEDS = int(os.environ.get("TOKENS_DIFFERENTIAL_SEEDS", "60"))
STOP_FIELD = "sampling.stop_token_ids"
LIMIT = 256  # common.proto / tokens.py's documented count; the module's constant must agree


class Refused(Exception):
    """The model's InvalidArgument: the field and a word the message must hold."""

    def __init__(self, field: str, says: str) -> None:
        super().__init__(field, says)
        self.field, self.says = field, says


def model_tokens(field, ids, vocab, allow_empty=False):
    ids = list(ids)
    if not ids and not allow_empty:
        raise Refused(field, "must not be empty")
    for t in ids:
        if not 0 <= t < vocab:
            raise Refused(field, f"token id {t} ")
    return ids


def model_stops(ids, vocab):
    ids = list(ids)
    if len(ids) > LIMIT:
        raise Refused(STOP_FIELD, f"more than {LIMIT} ids")
    return model_tokens(STOP_FIELD, ids, vocab, allow_empty=True)


def _vocab(rng: random.Random):
    return rng.choice([0, 1, 2, 128, 49152, 2**32, math.inf, 128.0, rng.randrange(1, 5000)])


def _ids(rng: random.Random, vocab, *, negatives: bool) -> list[int]:
    n = rng.choice([0, 0, 1, 2, rng.randrange(1, 40), LIMIT - 1, LIMIT, LIMIT + 1,
                    rng.randrange(LIMIT + 1, 600)])
    top = 4096 if vocab == math.inf else int(vocab)
    bad_rate = rng.choice([0.0, 0.0, 0.001, 0.02, 0.3])
    out = []
    for _ in range(n):
        if rng.random() < bad_rate:
            edge = [top, top + 1, 2**32 - 1] if vocab != math.inf else [2**32 - 1]
            edge += [-1, -(2**31)] if negatives else []
            out.append(rng.choice(edge))
        else:
            out.append(rng.choice([0, max(top - 1, 0), rng.randrange(max(top, 1))]))
    if not negatives:
        out = [t for t in out if 0 <= t < 2**32]
    return out


def _shape(rng: random.Random, ids: list[int], proto: bool):
    """The same ids in one of the shapes the callers hand over."""
    kind = rng.choice(["list", "tuple", "gen", "proto"] if proto else ["list", "tuple", "gen"])
    if kind == "tuple":
        return tuple(ids)
    if kind == "gen":
        return (t for t in ids)
    if kind == "proto":
        if rng.random() < 0.5:
            return kvpool_pb2.KvGenerateRequest(token_ids=ids).token_ids
        return common_pb2.SamplingParams(stop_token_ids=ids).stop_token_ids
    return list(ids)


def _compare(call, model):
    try:
        want = model()
    except Refused as r:
        want = r
    try:
        got = call()
    except errors.InvalidArgument as e:
        got = e
    if isinstance(want, Refused):
        assert isinstance(got, errors.InvalidArgument), (want.field, want.says, got)
        msg = str(got)
        assert got.field == want.field and got.code == "INVALID_ARGUMENT"
        assert msg.startswith(f"{want.field}: ") and "\n" not in msg, msg
        assert want.says in msg, (want.says, msg)
    else:
        assert not isinstance(got, Exception), (got, want[:10])
        assert type(got) is list and got == want


@pytest.mark.parametrize("seed", range(SEEDS))
def test_token_checks_match_the_model(seed):
    rng = random.Random(seed)
    assert tokens.MAX_STOP_TOKEN_IDS == LIMIT
    for _ in range(60):
        vocab = _vocab(rng)
        proto = rng.random() < 0.4
        ids = _ids(rng, vocab, negatives=not proto)
        shaped = _shape(rng, ids, proto)
        if rng.random() < 0.5:
            field = rng.choice(["token_ids", "draft_token_ids", "x.y"])
            allow = rng.choice([False, True, None])
            kw = {} if allow is None else {"allow_empty": allow}
            _compare(partial(tokens.validate_tokens, field, shaped, vocab, **kw),
                     partial(model_tokens, field, ids, vocab, bool(allow)))
        else:
            _compare(partial(tokens.validate_stop_ids, shaped, vocab),
                     partial(model_stops, ids, vocab))
