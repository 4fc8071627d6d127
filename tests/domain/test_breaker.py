"""The circuit breaker: closed -> open after N consecutive failures, half-open probe, cool-down."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hicache.domain import ConfigError
from hicache.domain.breaker import Breaker, BreakerState


def test_it_opens_after_threshold_consecutive_failures_and_refuses_calls() -> None:
    b = Breaker(threshold=3, cooldown_s=10.0)
    for t in range(2):
        assert b.allow(t)
        b.record(False, t)
    assert b.state is BreakerState.CLOSED
    assert b.allow(2)
    b.record(False, 2)
    assert b.state is BreakerState.OPEN
    assert not b.allow(2)
    assert not b.allow(11.9)
    snap = b.snapshot()
    assert (snap.state, snap.consecutive_failures, snap.opened_at, snap.trips) == (
        BreakerState.OPEN,
        3,
        2,
        1,
    )


def test_a_success_resets_the_failure_run() -> None:
    b = Breaker(threshold=2, cooldown_s=1.0)
    b.record(False, 0)
    b.record(True, 0)
    b.record(False, 0)
    assert b.state is BreakerState.CLOSED
    b.record(False, 0)
    assert b.state is BreakerState.OPEN


def test_after_the_cooldown_one_probe_goes_through_and_its_success_closes() -> None:
    b = Breaker(threshold=1, cooldown_s=5.0)
    b.record(False, 100)
    assert not b.allow(104.9)
    assert b.allow(105)
    assert b.state is BreakerState.HALF_OPEN
    assert not b.allow(105)  # one probe at a time
    b.record(True, 106)
    assert b.state is BreakerState.CLOSED
    assert b.allow(106)
    assert b.allow(106)


def test_a_failed_probe_opens_again_for_a_fresh_cooldown() -> None:
    b = Breaker(threshold=2, cooldown_s=5.0)
    b.record(False, 0)
    b.record(False, 0)
    assert b.allow(5)
    b.record(False, 6)
    assert b.state is BreakerState.OPEN
    assert not b.allow(10.9)
    assert b.allow(11)
    assert b.snapshot().trips == 2


def test_an_abandoned_probe_lets_the_next_call_probe() -> None:
    b = Breaker(threshold=1, cooldown_s=1.0)
    b.record(False, 0)
    assert b.allow(1)
    assert not b.allow(1)
    b.abandon()  # the probe was cancelled before it reached the store
    assert b.allow(1)
    assert b.state is BreakerState.HALF_OPEN
    closed = Breaker()
    closed.abandon()
    assert closed.allow(0)


def test_a_straggling_failure_while_open_keeps_the_cooldown_start() -> None:
    b = Breaker(threshold=1, cooldown_s=5.0)
    b.record(False, 0)
    b.record(False, 4)  # a call that started before the breaker opened
    assert b.allow(5)


@pytest.mark.parametrize(
    ("threshold", "cooldown"), [(0, 1.0), (-1, 1.0), (True, 1.0), (1, -1.0), (1, float("nan"))]
)
def test_bad_settings_are_config_errors(threshold: int, cooldown: float) -> None:
    with pytest.raises(ConfigError, match=r"threshold|cooldown_s"):
        Breaker(threshold=threshold, cooldown_s=cooldown)


class _Model:
    """A plain reference model of the specified behaviour."""

    def __init__(self, threshold: int, cooldown: float) -> None:
        self.threshold, self.cooldown = threshold, cooldown
        self.state, self.run, self.opened, self.probe = "closed", 0, 0.0, False

    def allow(self, now: float) -> bool:
        if self.state == "open" and now - self.opened >= self.cooldown:
            self.state, self.probe = "half_open", False
        if self.state == "closed":
            return True
        if self.state == "half_open" and not self.probe:
            self.probe = True
            return True
        return False

    def record(self, ok: bool, now: float) -> None:
        if ok:
            self.run = 0
            if self.state == "half_open":
                self.state = "closed"
        elif self.state != "open":
            self.run += 1
            if self.state == "half_open" or self.run >= self.threshold:
                self.state, self.opened = "open", now


@given(
    threshold=st.integers(1, 4),
    cooldown=st.floats(0, 5),
    steps=st.lists(st.tuples(st.floats(0, 3), st.booleans()), max_size=60),
)
def test_the_breaker_matches_a_reference_model_and_never_lets_two_probes_through(
    threshold: int, cooldown: float, steps: list[tuple[float, bool]]
) -> None:
    b, m = Breaker(threshold=threshold, cooldown_s=cooldown), _Model(threshold, cooldown)
    now = 0.0
    for dt, ok in steps:
        now += dt
        allowed = b.allow(now)
        assert allowed == m.allow(now)
        if b.state is BreakerState.HALF_OPEN:
            assert not b.allow(now)  # a second call while the probe runs is refused
        if allowed:
            b.record(ok, now)
            m.record(ok, now)
        assert b.state.value == m.state
        if b.state is BreakerState.OPEN:
            assert b.snapshot().opened_at is not None
