"""When a similarity is a hit: tiers, explicit thresholds, the verified bonus and the draft band.

    similarity:  0 ........ draft_floor ........ threshold(-bonus if verified) ........ 1
                   miss      |  draft candidate   |              hit (if the guard agrees)
"""

from __future__ import annotations

import enum
import functools
import math
import struct
from dataclasses import dataclass
from typing import NamedTuple

from services.common.errors import InvalidArgument, as_written, shown

# How far below its threshold a similarity still counts as at it (`ThresholdPolicy.decide`):
# similarities are float32, and the boundary is inclusive.
HIT_TOLERANCE = 1e-6


class Outcome(enum.Enum):
    """What a lookup's best candidate is."""

    HIT = "hit"
    DRAFT = "draft"
    MISS = "miss"


class Resolved(NamedTuple):
    """The tier and threshold that apply to one request."""

    tier: str
    threshold: float
    explicit: bool


class Decision(NamedTuple):
    """The outcome for one candidate and the threshold it was held to."""

    outcome: Outcome
    threshold: float


@dataclass(frozen=True)
class ThresholdPolicy:
    """Tiered similarity thresholds (see the module docstring).

    Args:
        tiers: tier name -> threshold.
        default_tier: used when a request names none.
        floor: explicit thresholds below it are refused; the verified bonus never goes below it.
        verified_bonus: human-verified entries are held to `threshold - verified_bonus`.
        draft_floor: similarities in [draft_floor, threshold) are draft candidates.
    """

    tiers: dict[str, float]
    default_tier: str = "standard"
    floor: float = 0.85
    verified_bonus: float = 0.02
    draft_floor: float = 0.80

    @classmethod
    def from_config(cls, cfg) -> ThresholdPolicy:
        return cls({"strict": cfg.tier_strict, "standard": cfg.tier_standard,
                    "relaxed": cfg.tier_relaxed}, cfg.default_tier, cfg.threshold_floor,
                   cfg.verified_bonus, cfg.draft_floor)

    def resolve(self, tier: str = "", threshold: float = 0.0) -> Resolved:
        """The tier and threshold for a request.

        An explicit threshold (non-zero) wins over the tier's; the tier name is still reported
        (and still decides whether the guard runs).

        Raises:
            InvalidArgument: unknown tier, or a threshold outside [floor, 1].
        """
        name = tier or self.default_tier
        if name not in self.tiers:
            raise InvalidArgument("tier", f"unknown tier {shown(tier)}; expected one of "
                                          f"{', '.join(sorted(self.tiers))}")
        if threshold == 0.0:
            return Resolved(name, self.tiers[name], False)
        # The wire carries a float32: 0.9 arrives as 0.89999998. Within that rounding of the
        # floor (or of 1) it is the bound the caller wrote.
        if not math.isfinite(threshold) or not (self.floor - 1e-6 <= threshold <= 1.0 + 1e-6):
            # As the caller wrote it, not its float32 ("got 0.30000001192092896").
            raise InvalidArgument("threshold", f"must be 0 (tier default) or in "
                                               f"[{self.floor:g}, 1], got {as_written(threshold)}")
        return Resolved(name, min(1.0, max(self.floor, float(threshold))), True)

    def threshold_for(self, resolved: Resolved, verified: bool) -> float:
        """The threshold one entry is held to (verified entries get the bonus, not below floor)."""
        if not verified:
            return resolved.threshold
        return max(self.floor, resolved.threshold - self.verified_bonus)

    def in_draft_band(self, similarity: float) -> bool:
        """At or above the draft floor. Similarities are float32: the float32 nearest the floor
        from below (0.9 is 0.89999998) is the floor, as at a threshold; without it a floor
        float32 rounds down (0.7, 0.9, 0.95) left a candidate at exactly it a miss."""
        return similarity >= self._draft_bound

    @functools.cached_property
    def _draft_bound(self) -> float:
        """`in_draft_band`'s bound, computed once (it is asked for every lookup's candidate)."""
        f32 = struct.unpack("f", struct.pack("f", self.draft_floor))[0]
        return min(self.draft_floor, f32)

    def decide(self, similarity: float, resolved: Resolved, verified: bool) -> Decision:
        """HIT at or above the entry's threshold, DRAFT in the draft band, MISS below."""
        th = self.threshold_for(resolved, verified)
        # float32 similarities: a tiny tolerance keeps an exact repeat (cos = 0.99999994) a hit
        # at threshold 1.0 and makes the boundary inclusive as documented.
        if similarity >= th - HIT_TOLERANCE:
            return Decision(Outcome.HIT, th)
        if self.in_draft_band(similarity):
            return Decision(Outcome.DRAFT, th)
        return Decision(Outcome.MISS, th)
