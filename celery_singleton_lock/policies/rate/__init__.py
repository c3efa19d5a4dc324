"""``lock_rate``: at most N starts of a rate key in any window, across every worker (docs/rate.md). One way down:
feature (the port's hooks) > booking (a waiting call's slot) > stack, count (the Lua calls) > conf, window (pure).
"""

from .booking import BOOKING_HEADER
from .conf import ON_RATE_LIMIT, Conf, RateLimitPolicy, Share
from .count import take, undo
from .feature import RATE_FEATURE, RATE_HEADER, RATE_MAX_COUNTDOWN, SLOWED_HEADER, RateFeature
from .stack import adjust, take_many
from .window import LATE, Limit, Rate, Verdict, Window, named_limits, parse_limits, parse_rate, units_of

__all__ = [
    "BOOKING_HEADER",
    "LATE",
    "ON_RATE_LIMIT",
    "RATE_FEATURE",
    "RATE_HEADER",
    "RATE_MAX_COUNTDOWN",
    "SLOWED_HEADER",
    "Conf",
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
    "units_of",
]
