"""The rate feature behind the port (:class:`RateFeature`, ``RATE_FEATURE``): ``lock_rate``, ``lock_rate_on``,
``lock_on_rate_limit``, ``lock_rate_cost``.

The rate is a policy of its own, beside the duplicate policies: it decides whether a delivery that may run (its lock
is ours, or it has none: ``lock_limit=None``) may *start now*. What an over-the-rate delivery does is
``lock_on_rate_limit``: ``"wait"`` (default: re-sent for the moment the window allows, never early, never dropped),
``"skip"`` (REVOKED) or ``"fail"`` (FAILURE with :class:`~celery_singleton_lock.errors.RateLimitedError`).

The feature holds its options' checks, the rate key of a call, and its hooks: ``after_lock`` (the delivery asks for
its share: :func:`~.count.take`, :func:`~.stack.take_many` or a booking, :func:`~.booking.decide_for`, then carries
the verdict out through the :class:`~celery_singleton_lock.policies.port.Delivery` it is handed), ``body_skipped``
(a share counted for a body that does not start after all is given back), ``slowed`` (a body's ``SlowDown``) and
``spent`` (``rate_spent``). It is the top room of policies/rate/: it imports the others, none imports it. It imports
nothing of Celery.
"""

from __future__ import annotations

import logging
import math
import random
import secrets
from collections.abc import Callable
from typing import Any, ClassVar

from ...errors import ConfigurationError, LockUnavailableError, RateLimitedError
from ...lock.config import did_you_mean
from ...lock.scripts import RATE_PAUSE
from ..port import Delivery, Feature, check_names, parameters
from .booking import BOOKING_HEADER, books, decide_for
from .conf import ON_RATE_LIMIT, Conf, Share, check_costs, keys_of, units_per_limit
from .count import take, undo
from .stack import adjust, take_many
from .window import Limit, Verdict, named_limits, parse_limits, units_of

__all__ = ["RATE_FEATURE", "RATE_HEADER", "RATE_MAX_COUNTDOWN", "SCRIPTS", "SLOWED_HEADER", "RateFeature"]

logger = logging.getLogger("celery_singleton_lock.task")


RATE_HEADER = "singleton_lock_rate_waits"  # how many times this call waited for the window
#: A copy of a call whose body raised SlowDown (kept by its later copies): the pause is the call's own, so over the
#: rate it waits for the window, never skipped or failed for it (``lock_on_rate_limit`` is for calls not yet started).
SLOWED_HEADER = "singleton_lock_slowed"
#: The longest countdown a delivery waiting for its rate's window is re-sent with (a longer wait takes several).
RATE_MAX_COUNTDOWN = 900.0


#: The rate windows' scripts (lock/lua): one limit, several stacked, a charge, a pause, a booking and its claim.
SCRIPTS = (
    "rate",
    "rate_undo",
    "rate_restamp",
    "rate_stack",
    "rate_stack_restamp",
    "rate_adjust",
    "rate_pause",
    "rate_book",
    "rate_claim",
)


class RateFeature(Feature):
    """``lock_rate``, ``lock_rate_on``, ``lock_on_rate_limit``, ``lock_rate_cost``: asked after the lock is taken,
    before the body."""

    name: ClassVar[str] = "rate"
    options: ClassVar[tuple[str, ...]] = ("lock_rate", "lock_rate_on", "lock_on_rate_limit", "lock_rate_cost")
    headers: ClassVar[tuple[str, ...]] = (RATE_HEADER, SLOWED_HEADER, BOOKING_HEADER)
    scripts: ClassVar[tuple[str, ...]] = SCRIPTS

    def check(self, cls: Any) -> None:
        """Each option alone (ConfigurationError); what they need of each other is the matrix's."""
        name = cls.name
        policy = cls.lock_on_rate_limit
        if policy not in ON_RATE_LIMIT:
            raise ConfigurationError(
                f"{self.options[2]} of {name} must be one of {', '.join(map(repr, ON_RATE_LIMIT))}, "
                f"got {policy!r}{did_you_mean(policy, ON_RATE_LIMIT)}"
            )
        on = cls.lock_rate_on
        if on is not None and (isinstance(on, str) or not all(isinstance(n, str) for n in on)):
            raise ConfigurationError(f"{self.options[1]} of {name} must be a list of argument names")
        cost = getattr(cls, "lock_rate_cost", None)
        if cls.lock_rate is None:
            if on is not None:
                raise ConfigurationError(f"{self.options[1]} of {name} needs a {self.options[0]}")
            if cost is not None:
                raise ConfigurationError(f"{self.options[3]} of {name} needs a {self.options[0]}")
            return
        limits = parse_limits(cls.lock_rate, on or (), f"{self.options[0]} of {name}")
        params = parameters(cls)
        if on:
            check_names(cls, self.options[1], on, params)
        for limit in limits:
            if limit.on and limit.on != tuple(on or ()):
                check_names(cls, f"{self.options[0]} of {name}: Rate(on=...)", limit.on, params)
        check_costs(name, cost, limits, params)

    def active(self, cls: Any) -> bool:
        return cls.lock_rate is not None

    def resolve(self, task: Any) -> Conf:
        on = tuple(task.lock_rate_on) if task.lock_rate_on is not None else ()
        limits = parse_limits(task.lock_rate, on, f"{self.options[0]} of {task.name}")
        # Read on the class: a function set as an attribute is bound as a method when read on the task.
        cost = getattr(task if isinstance(task, type) else type(task), "lock_rate_cost", None)
        if cost is None:
            units: int | Callable[..., Any] = 1
        elif callable(cost):
            units = cost
        else:
            units = units_of(cost, f"{self.options[3]} of {task.name}")
        return Conf(limits, task.lock_on_rate_limit, on, units)

    def limits_of(self, task: Any) -> tuple[Limit, ...]:
        """A task's limits, parsed (its ``lock_rate`` must be set)."""
        on = tuple(task.lock_rate_on) if task.lock_rate_on is not None else ()
        return parse_limits(task.lock_rate, on, f"{self.options[0]} of {task.name}")

    def key_for(self, ctx: Any, args: Any, kwargs: Any) -> str | None:
        """The rate key of a call with these arguments (its first limit's; None: the task has no rate)."""
        keys = self.keys_for(ctx, args, kwargs)
        return keys[0] if keys else None

    def keys_for(self, ctx: Any, args: Any, kwargs: Any) -> list[str]:
        """The rate key of each limit of a call with these arguments (empty: the task has no rate; :func:`keys_of`)."""
        options = ctx.options
        conf: Conf | None = options.conf.get(self.name)
        return [] if conf is None else keys_of(options, conf, args, kwargs)

    def units(self, ctx: Any, args: Any, kwargs: Any) -> tuple[int, ...]:
        """The units a start of a call with these arguments takes of each limit (:func:`units_per_limit`)."""
        return units_per_limit(ctx.options.conf[self.name], ctx.name, args, kwargs)

    @staticmethod
    def share(run: Any) -> Share | None:
        """The start ``run`` counted (None: none, or no rate)."""
        found: Share | None = (run.state or {}).get("rate")
        return found

    def started_at(self, run: Any) -> float | None:
        """When ``run``'s start was counted (Unix s, a counting node's clock); None without a rate."""
        share = self.share(run)
        return share.at if share is not None else None

    def after_lock(self, delivery: Delivery) -> bool:
        """Count this start if the window allows it (one more round trip), True then: the body runs.

        Over the rate, ``lock_on_rate_limit`` acts: ``wait`` re-sends this delivery for the moment the window lets a
        start in (never early: that copy asks again; :meth:`Delivery.wait_out` keeps what its call holds meanwhile),
        ``skip`` stores REVOKED, ``fail`` raises RateLimitedError; the lock (if any) is given back at once, as if never
        taken. Without a quorum, ``lock_on_unavailable`` acts (``run``: the body starts uncounted, under its lock).
        """
        ctx, run = delivery.ctx, delivery.run
        options = ctx.options
        conf: Conf = options.conf[self.name]
        keys = self.keys_for(ctx, delivery.args, delivery.kwargs)
        key = keys[0]
        try:
            units = conf.ones if conf.plain else self.units(ctx, delivery.args, delivery.kwargs)
        except Exception:
            delivery.give_back()
            delivery.failed()
            raise
        share = Share(key, units=units[0], estimate=units[0], per=units)
        if run.state is None:
            run.state = {}
        run.state[self.name] = share
        nodes = options.settings.nodes
        request = ctx.request
        if len(keys) == 1 and units[0] == 1 and books(conf.on_limit, options.policy, request):
            # A call that waits books its slot (booking.py): served in arrival order, one re-send.
            verdict = decide_for(nodes, key, conf.limits[0].window, request)
        elif len(keys) == 1 and units[0] == 1:
            verdict = take(nodes, key, conf.limits[0].window)  # the hot path: lua/rate.lua, as before stacking
        else:
            windows = tuple(limit.window for limit in conf.limits)
            verdict = take_many(nodes, keys, windows, units)
            share.keys, share.windows = tuple(keys), windows
        if verdict.outcome == "granted":
            share.at, share.slot, share.token = verdict.at, (verdict.slot, verdict.times), verdict.token
            share.slots = verdict.slots or ((verdict.slot,),)
            return True
        if verdict.outcome == "unavailable":
            return self._unavailable(delivery, key, verdict)
        return self._over(delivery, conf, key, verdict)

    @staticmethod
    def _unavailable(delivery: Delivery, key: str, verdict: Verdict) -> bool:
        """No quorum counted or refused the start: ``lock_on_unavailable`` acts (``run``: True, the body starts)."""
        ctx, request, task_id = delivery.ctx, delivery.ctx.request, delivery.run.task_id
        options = ctx.options
        policy = options.on_unavailable
        attempt = delivery.attempt
        if not attempt:  # once per call, not per retry
            ctx.count("unavailable")
        ctx.signal("lock_unavailable", key=key, task_id=task_id, policy=policy, errors=verdict.errors)
        if policy == "run":
            logger.warning("Task %s[%s] starts UNCOUNTED: rate %s unavailable", ctx.name, task_id, key)
            return True
        settings = options.settings
        if (
            policy == "fail"
            or request.is_eager
            or (settings.max_retries is not None and attempt + 1 > settings.max_retries)
        ):
            delivery.give_back()
            delivery.failed()  # every feature's end of a delivery that fails before its body
            raise LockUnavailableError(key, node_errors=verdict.errors)
        delay = min(settings.retry_max_delay, settings.retry_delay * 2**attempt)
        countdown = delay * (0.5 + 0.5 * random.random())  # noqa: S311 - jitter
        delivery.wait_out(countdown, "unavailable", {delivery.attempt_header: attempt + 1})
        return False

    @staticmethod
    def _over(delivery: Delivery, conf: Conf, key: str, verdict: Verdict) -> bool:
        """Over the rate (or contended, or booked): ``lock_on_rate_limit`` acts; False, the body does not start."""
        ctx, request, task_id = delivery.ctx, delivery.ctx.request, delivery.run.task_id
        options, rate = ctx.options, conf  # said in messages: every limit
        waits = int(getattr(request, RATE_HEADER, 0) or 0)
        if not waits:  # once per call: its re-sent copies asking again are the same call
            ctx.count("rate-limited")
        said = f"rate {rate} of {key} reached"
        ctx.signal("rate_limited", key=key, task_id=task_id, rate=str(rate), policy=conf.on_limit)
        # Contenders split the free slots on every attempt: the rate is not known to be reached, so the call is not
        # skipped or failed for it; it asks again shortly (an eager call cannot wait: it is told). A copy of a call
        # whose body raised SlowDown waits for the window too: the pause is its own (SLOWED_HEADER).
        contended = (verdict.contended or bool(getattr(request, SLOWED_HEADER, None))) and not request.is_eager
        if not contended and conf.on_limit != "wait" and not delivery.may_refuse():
            return False  # another feature took it elsewhere (a burst's job not due yet: re-sent for its due time)
        if not contended and (conf.on_limit == "fail" or request.is_eager):
            delivery.give_back()
            raise RateLimitedError(key, task_name=ctx.name, rate=str(rate), wait=verdict.wait)
        if not contended and conf.on_limit == "skip":
            delivery.give_back()
            reason = f"{ctx.name} skipped: {said}"
            if not (ctx.task.ignore_result or request.ignore_result):
                ctx.task.backend.mark_as_revoked(task_id, reason, request=None)
            delivery.skip(reason, None)
            return False
        # wait: for the moment the window lets a start in on a quorum (a few ms after it: never early; that copy asks
        # again, and one that loses the moment to another waiter is re-sent for the next one).
        countdown = verdict.wait + 0.002 + 0.01 * random.random()  # noqa: S311 - jitter
        headers: dict[str, Any] = {RATE_HEADER: waits + 1}
        if verdict.outcome == "booked":  # re-sent for the moment it owns: a few ms after it, no jitter needed
            countdown = verdict.wait + 0.002
            headers[BOOKING_HEADER] = f"{verdict.slot}:{verdict.token}"
        # A long wait ("5/h") goes in steps: a countdown message waits unacked in a worker, which RabbitMQ's
        # consumer_timeout (30 min by default) and a Redis broker's visibility timeout do not allow for long.
        countdown = min(countdown, RATE_MAX_COUNTDOWN, options.max_countdown or RATE_MAX_COUNTDOWN)
        delivery.wait_out(countdown, "rate", headers, said)
        return False

    def body_skipped(self, delivery: Delivery) -> None:
        """Give back the share :meth:`after_lock` counted for this delivery: its body does not start after all."""
        run = delivery.run
        share = self.share(run)
        if share is not None and share.token:
            undo(delivery.ctx.options.settings.nodes, share.keys or share.key, share.token)
            share.token, share.at, share.slot = "", None, None

    def slowed(self, ctx: Any, run: Any, pause: float, limit: Any) -> tuple[float, dict[str, Any]] | None:
        """A body raised ``SlowDown(pause, limit)``: every start of this call's rate (its limits, or the one named:
        an index in ``lock_rate``, or a notation such as ``"60/m"``) waits ``pause`` s, cluster-wide. The pause is
        written into the rate logs themselves (lua/rate_pause.lua: each log filled until the pause ends), so the
        decision's script and its cost do not change, and a node that holds the pause refuses every start: with a
        majority holding it, no quorum can grant one. Returns the countdown the call is re-sent with (the pause and
        a few ms: its copy asks the rate again, never early) and its copy's header (:data:`SLOWED_HEADER`: the copy
        waits for the window whatever ``lock_on_rate_limit`` says). A start the rate did not count (no quorum,
        ``lock_on_unavailable="run"``: the nodes did not answer) pauses nothing but is re-sent all the same: the API
        said "slow down", and failing the call with it would lose it."""
        countdown = pause + 0.002 + 0.01 * random.random()  # noqa: S311 - jitter
        # Its copy holds no booking: the one this run started on is this start's count (claimed again, it would be
        # two starts on one entry); it asks the window anew ('' is no booking, see booking.parse_booking).
        headers = {SLOWED_HEADER: 1, BOOKING_HEADER: ""}
        answer = min(countdown, RATE_MAX_COUNTDOWN, ctx.options.max_countdown or RATE_MAX_COUNTDOWN), headers
        share = self.share(run)
        if share is None:
            logger.warning("Task %s raised SlowDown in a start its rate did not count: nothing paused", ctx.name)
            return answer
        conf: Conf = ctx.options.conf[self.name]
        keys = list(share.keys or (share.key,))
        limits = list(conf.limits) if conf.stacked else [conf.limits[0]]
        chosen = list(range(len(limits)))
        if limit is not None:
            named = named_limits(limits, limit)
            if named:
                chosen = named
            else:
                logger.warning(
                    "Task %s raised SlowDown(limit=%r), which names no limit of its lock_rate (an index or a "
                    "notation such as '60/m'): every limit pauses",
                    ctx.name,
                    limit,
                )
        micros = round(pause * 1_000_000)
        args: list[str | int] = [secrets.token_hex(16), micros]
        for i in chosen:
            args += [limits[i].window.limit, limits[i].window.window_us]
        nodes = ctx.options.settings.nodes
        try:
            answers = nodes.run(RATE_PAUSE, [keys[i] for i in chosen], args)
        except Exception:  # best effort: the call is re-sent for after the pause all the same
            logger.warning("Task %s: its rate's pause could not be written", ctx.name, exc_info=True)
        else:
            held = sum(1 for a in answers if a is not None and not isinstance(a, BaseException))
            if held < nodes.quorum:  # other calls may start during it; this call's copy still waits its countdown
                logger.warning("Task %s: its rate's pause reached %d lock nodes, fewer than a quorum", ctx.name, held)
        return answer

    def spent(self, ctx: Any, run: Any, units: Any, limit: Any = None) -> int:
        """The body of ``run`` reports what its start really cost (``LockedTask.rate_spent``): each limit corrected
        is corrected by the difference from what it holds of it now, on the nodes that counted it (:func:`adjust`,
        one call per node). The limits corrected: the one ``limit`` names (an index in ``lock_rate``, or a notation
        such as ``"90000/m"``, as ``SlowDown(limit=)``; one naming none: ConfigurationError); without it, those whose
        cost is a function (an estimate), or every limit when none is. Returns the difference applied to the first
        limit corrected (0: nothing to correct, or the start was not counted: no rate, uncounted, undone)."""
        share = self.share(run)
        where = f"rate_spent of {ctx.name}"
        if isinstance(units, bool) or not isinstance(units, int | float) or not math.isfinite(units) or units < 0:
            raise ConfigurationError(f"{where} takes a number of units >= 0, got {units!r}")
        conf: Conf | None = ctx.options.conf.get(self.name)
        if conf is None:
            return 0
        limits = list(conf.limits)
        if limit is None:
            chosen = conf.estimated() or list(range(len(limits)))
        else:
            chosen = named_limits(limits, limit)
            if not chosen:
                raise ConfigurationError(
                    f"{where}: limit={limit!r} names no limit of its lock_rate (an index or a notation such as '60/m')"
                )
        if share is None or not share.token or share.slot is None:
            return 0
        per = list(share.per or (share.units,) * len(limits))
        deltas = {i: math.ceil(units) - per[i] for i in chosen if math.ceil(units) != per[i]}
        if not deltas:
            return 0
        keys = share.keys or (share.key,)
        windows = share.windows or tuple(lim.window for lim in limits)
        at = sorted(deltas)
        changes = [deltas[i] for i in at]
        adjust(
            ctx.options.settings.nodes,
            [keys[i] for i in at],
            [windows[i] for i in at],
            share.token,
            changes,
            share.slot[1],
        )
        for i in at:
            per[i] += deltas[i]
        share.per, share.units = tuple(per), per[0]
        return changes[0]


RATE_FEATURE = RateFeature()
