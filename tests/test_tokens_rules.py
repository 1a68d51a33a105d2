"""Rules of `services.common.tokens` that the mutation audit found unguarded: the number of
stop token ids a request may give: at most MAX_STOP_TOKEN_IDS, 256 (the kvpool server's
test of 257 ids was refused for ids outside its 128-token vocabulary first, so it never
reached the count)."""

from __future__ import annotations

import math

import pytest

from services.common.errors import InvalidArgument
from services.common.tokens import MAX_STOP_TOKEN_IDS, validate_stop_ids, validate_tokens


def test_at_most_256_stop_token_ids_are_taken():
    """256 stop ids inside the vocabulary are taken; a 257th is refused naming the field."""
    assert MAX_STOP_TOKEN_IDS == 256
    assert validate_stop_ids(range(256), 1000) == list(range(256))
    with pytest.raises(InvalidArgument, match="more than 256 ids") as e:
        validate_stop_ids(range(257), 1000)
    assert "sampling.stop_token_ids" in str(e.value)
    assert validate_stop_ids([], 1000) == []  # none is fine


def test_a_negative_token_id_is_outside_the_vocabulary():
    """The vocabulary is 0 <= id < vocab: a negative id (a Python caller's; the proto fields
    are uint32) was taken, and would index the embedding table from its end. The first bad id
    is named, with the field."""
    with pytest.raises(InvalidArgument, match=r"^token_ids: token id -1 is outside the "
                                              r"vocabulary \[0, 128\)$"):
        validate_tokens("token_ids", [5, -1, 200], 128)
    with pytest.raises(InvalidArgument, match="token id -3 "):
        validate_stop_ids([-3], math.inf)  # vocabulary unknown: still no negative id
    assert validate_tokens("token_ids", [0, 127], 128) == [0, 127]
