"""``lock_rate``: never more than N starts of a rate key in any window of a given length, across every worker.

The rate's rooms (docs/rate.md says what is promised): :mod:`.feature`, the feature behind the port, and
:mod:`.booking`, a waiting call's booked slot. This face hands on what ``policies/rate.py`` held.
"""

from .feature import (
    LATE,
    ON_RATE_LIMIT,
    RATE_FEATURE,
    RATE_HEADER,
    RATE_MAX_COUNTDOWN,
    SLOWED_HEADER,
    Limit,
    Rate,
    RateFeature,
    RateLimitPolicy,
    Share,
    Verdict,
    Window,
    adjust,
    named_limits,
    parse_limits,
    parse_rate,
    take,
    take_many,
    undo,
)

__all__ = [
    "LATE",
    "ON_RATE_LIMIT",
    "RATE_FEATURE",
    "RATE_HEADER",
    "RATE_MAX_COUNTDOWN",
    "SLOWED_HEADER",
    "Limit",
    "Rate",
    "RateFeature",
    "RateLimitPolicy",
    "Share",
    "Verdict",
    "Window",
    "adjust",
    "named_limits",
    "parse_limits",
    "parse_rate",
    "take",
    "take_many",
    "undo",
]
