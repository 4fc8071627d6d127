"""A circuit breaker for the storage tier: pure state, time passed in (no clocks).

- BreakerState: CLOSED (calls go through), OPEN (refused until the cool-down passed), HALF_OPEN
  (one probe call is let through).
- BreakerSnapshot: a frozen view (state, consecutive failures, when it opened, trips so far).
- Breaker: ``allow(now)`` asks before a store call, ``record(ok, now)`` reports its outcome,
  ``abandon()`` reports a call that never ran (so a half-open breaker does not wait forever).

CLOSED -> OPEN after ``threshold`` consecutive failed calls; OPEN refuses until ``cooldown_s``
seconds after it opened, then HALF_OPEN lets exactly one probe through (further calls are
refused while the probe runs); the probe's success closes the breaker, its failure opens it
again for another cool-down. What counts as a failed call is the caller's choice (the storage
tier: any key TRANSIENT or FATAL, or the call raised or overran its deadline; MISS, FULL and
INVALID are answers, not store failures). Not thread-safe: one owner (the event loop) drives it.
"""

from __future__ import annotations

import enum

import attrs

from hicache.domain.validators import nonneg_seconds, positive_int


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@attrs.frozen
class BreakerSnapshot:
    """The breaker at one moment: its state, the current failure run, when it last opened."""

    state: BreakerState
    consecutive_failures: int
    opened_at: float | None
    trips: int


@attrs.define
class Breaker:
    """Closed -> open after ``threshold`` consecutive failures; half-open after ``cooldown_s``."""

    threshold: int = attrs.field(default=5, validator=positive_int)
    cooldown_s: float = attrs.field(default=10.0, validator=nonneg_seconds)
    _state: BreakerState = attrs.field(default=BreakerState.CLOSED, init=False)
    _failures: int = attrs.field(default=0, init=False)
    _opened_at: float | None = attrs.field(default=None, init=False)
    _probing: bool = attrs.field(default=False, init=False)
    _trips: int = attrs.field(default=0, init=False)

    @property
    def state(self) -> BreakerState:
        return self._state

    def allow(self, now: float) -> bool:
        """Whether a call may go to the store now (an OPEN breaker past its cool-down half-opens)."""
        if self._state is BreakerState.CLOSED:
            return True
        if self._state is BreakerState.OPEN:
            if self._opened_at is not None and now - self._opened_at < self.cooldown_s:
                return False
            self._state = BreakerState.HALF_OPEN
            self._probing = False
        if self._probing:
            return False  # one probe at a time
        self._probing = True
        return True

    def record(self, ok: bool, now: float) -> None:
        """Report the outcome of a call that ``allow`` let through (do not record refusals).

        A failure reported while OPEN (a call that started before the breaker opened) changes
        nothing: the cool-down keeps its start.
        """
        if ok:
            self._failures = 0
            if self._state is BreakerState.HALF_OPEN:
                self._state = BreakerState.CLOSED
                self._probing = False
                self._opened_at = None
            return
        if self._state is BreakerState.OPEN:
            return
        self._failures += 1
        if self._state is BreakerState.HALF_OPEN or self._failures >= self.threshold:
            self._state = BreakerState.OPEN
            self._opened_at = now
            self._probing = False
            self._trips += 1

    def abandon(self) -> None:
        """A call that ``allow`` let through ended without an outcome (cancelled before it ran):
        a half-open breaker lets the next call probe instead."""
        if self._state is BreakerState.HALF_OPEN:
            self._probing = False

    def snapshot(self) -> BreakerSnapshot:
        return BreakerSnapshot(self._state, self._failures, self._opened_at, self._trips)
