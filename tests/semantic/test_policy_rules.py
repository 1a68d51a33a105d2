"""The threshold policy's rules a grpcurl walk-through found unguarded: a refused explicit
threshold is said as the caller wrote it, not as its float32."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.errors import InvalidArgument
from services.semantic.config import SemanticConfig
from services.semantic.policy import ThresholdPolicy


@pytest.mark.parametrize(("sent", "said"), [(0.3, "0.3"), (-1.0, "-1"), (1.5, "1.5"),
                                          # `:g` cut these to 6 digits: "got 1", inside [.., 1].
                                          (1.000002, "1.000002"), (1234567.0, "1234567")])
def test_a_refused_threshold_is_said_as_written_not_as_its_float32(sent, said):
    """A Lookup's threshold arrives as a float32: 0.3 read "got 0.30000001192092896", -1
    "got -1.0"."""
    policy = ThresholdPolicy.from_config(SemanticConfig())
    with pytest.raises(InvalidArgument) as ei:
        policy.resolve("", float(np.float32(sent)))
    assert str(ei.value) == f"threshold: must be 0 (tier default) or in [0.85, 1], got {said}"


def test_a_similarity_exactly_the_tolerance_below_the_threshold_is_a_hit():
    """The boundary is inclusive: `decide` counts a similarity within HIT_TOLERANCE below the
    entry's threshold as at it, the tolerance itself included (`>=`, not `>`)."""
    from services.semantic.policy import HIT_TOLERANCE, Outcome

    policy = ThresholdPolicy.from_config(SemanticConfig())
    resolved = policy.resolve("standard")
    at = resolved.threshold - HIT_TOLERANCE
    assert policy.decide(at, resolved, False).outcome is Outcome.HIT
    below = np.nextafter(at, 0.0)
    assert policy.decide(below, resolved, False).outcome is not Outcome.HIT
