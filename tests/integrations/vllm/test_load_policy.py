"""Load or recompute in the connector: LoadPolicy's measurements fed synthetic durations, the
``load_policy`` setting, and SchedulerSide offering a fast host run while declining a slow
store tail (hicache.integrations.vllm.load_policy)."""

from __future__ import annotations

import pytest

from hicache.domain import ConfigError
from hicache.domain.keys import chain_keys
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage
from hicache.integrations.vllm.load_policy import EXPLORE_EVERY, LoadPolicy
from hicache.integrations.vllm.plan import Event, Op
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide
from hicache.integrations.vllm.settings import ConnectorSettings
from hicache.integrations.vllm.stats import ConnectorStats
from tests.integrations.vllm.side_helpers import BS, Exists, store_keys


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def timed_steps(policy: LoadPolicy, clock: Clock, per_token_s: float) -> None:
    """Engine steps of a few prefill sizes and decodes, each taking per_token_s a token."""
    for tokens in (64, 1, 256, 1, 1024, 1, 32):
        policy.step_built([(0, tokens)])
        clock.now += per_token_s * tokens
        policy.step_ended()


def page_events(op: Op, pages: int, seconds_each: float) -> list[Event]:
    return [Event(op, bytes([i]), True, 0, seconds_each) for i in range(pages)]


def test_policy_measures_tiers_from_reported_page_seconds() -> None:
    p = LoadPolicy()
    p.observe(page_events(Op.LOAD, 4, 0.001) + page_events(Op.READ, 2, 0.2))
    p.observe([*page_events(Op.STORE, 3, 0.05), Event(Op.SAVE, b"x", True)])
    assert p.host.per_page_s == pytest.approx(0.001)
    assert p.store.per_page_s == pytest.approx(0.2)
    assert p.store_write.per_page_s == pytest.approx(0.05)


def test_policy_times_steps_from_build_to_output() -> None:
    clock = Clock()
    p = LoadPolicy(clock=clock)
    timed_steps(p, clock, 0.001)
    assert p.prefill.fitted
    assert p.prefill.saved(0, 1000) == pytest.approx(1.0, rel=0.05)


def test_policy_without_step_timing_has_no_prefill_figure_and_offers_everything() -> None:
    clock = Clock()
    p = LoadPolicy(clock=clock, time_steps=False)  # vLLM's asynchronous scheduling
    timed_steps(p, clock, 0.001)
    p.observe(page_events(Op.LOAD, 4, 1.0) + page_events(Op.READ, 4, 1.0))
    assert not p.prefill.fitted
    assert p.choose(start=0, host_end=2, end=6, block_size=BS) == 6


def slow_store_policy(**kw: object) -> LoadPolicy:
    """Steps at 1 ms a token (16 ms a block); host loads 0.1 ms a page, store reads 100 ms."""
    clock = Clock()
    p = LoadPolicy(clock=clock, **kw)  # type: ignore[arg-type]
    timed_steps(p, clock, 0.001)
    p.observe(page_events(Op.LOAD, 8, 0.0001) + page_events(Op.READ, 8, 0.1))
    return p


def test_measured_policy_declines_the_slow_store_tail_only() -> None:
    p = slow_store_policy()
    assert p.choose(start=1, host_end=5, end=12, block_size=BS) == 5


def test_queued_host_loads_tip_a_short_host_run_to_recompute() -> None:
    p = slow_store_policy()
    assert p.choose(start=0, host_end=2, end=2, block_size=BS) == 2
    p.planned(host=2000)  # 2000 pages at 0.1 ms: 0.2 s of host copies ahead of this one
    assert p.choose(start=0, host_end=2, end=2, block_size=BS) == 0
    p.planned(host=-2000)
    assert p.choose(start=0, host_end=2, end=2, block_size=BS) == 2


def test_always_and_never_ignore_the_figures() -> None:
    assert slow_store_policy(mode="always").choose(start=1, host_end=5, end=12, block_size=BS) == 12
    assert slow_store_policy(mode="never").choose(start=1, host_end=5, end=12, block_size=BS) == 1


def test_a_declined_store_is_offered_again_after_a_run_of_declines() -> None:
    p = slow_store_policy()
    got = [p.choose(start=0, host_end=2, end=8, block_size=BS) for _ in range(EXPLORE_EVERY + 1)]
    assert got == [2] * EXPLORE_EVERY + [8]
    assert p.choose(start=0, host_end=2, end=8, block_size=BS) == 2


@pytest.mark.parametrize("value", ["sometimes", 1, None, "Measured"])
def test_load_policy_setting_refuses_unknown_values(value: object) -> None:
    with pytest.raises(ConfigError, match=r"'load_policy' = .*expected one of measured, always"):
        ConnectorSettings.from_extra_config({"load_policy": value}, env={})


def test_load_policy_setting_defaults_to_measured() -> None:
    assert ConnectorSettings.from_extra_config({}, env={}).load_policy == "measured"
    got = ConnectorSettings.from_extra_config({"load_policy": "never"}, env={})
    assert got.load_policy == "never"


# ---- the scheduler side ------------------------------------------------------------------

PROMPT = list(range(1, 42))  # 10 full blocks of 4 and 1 token


def side_with(policy: LoadPolicy, store: Exists, stats: ConnectorStats) -> SchedulerSide:
    return SchedulerSide(
        block_size=BS,
        host_slots=32,
        store=BoundedStorage(store),  # type: ignore[arg-type]
        store_keys=store_keys(1),
        write_storage=False,
        save_decode=False,
        ranks=1,
        stats=stats,
        policy=policy,
    )


def host_then_store(s: SchedulerSide, store: Exists, host_blocks: int) -> None:
    """The prompt's first ``host_blocks`` blocks on the host, every block in the store."""
    blocks = list(range(len(PROMPT) // BS + 1))
    s.match("warm", PROMPT[: host_blocks * BS + 1], 0)
    plan = s.build([Scheduled("warm", PROMPT, 0, host_blocks * BS + 1)], lambda _r: blocks)
    s.on_events([Event(Op.SAVE, op.key, True) for op in plan.saves])
    s.finished("warm")
    for key in chain_keys(PROMPT, BS):
        store.held.add(str(StoreKey(namespace="t", pool="kv-r0", page_hash=key.hex())))


def test_scheduler_offers_the_fast_host_run_and_declines_the_slow_store_tail() -> None:
    store, stats = Exists(), ConnectorStats()
    s = side_with(LoadPolicy(mode="always"), store, stats)
    host_then_store(s, store, 4)
    assert s.match("a", PROMPT, 0) == (40, True)  # always: host 4 blocks + store 6

    s.policy = slow_store_policy()  # the same hit with the figures measured
    assert s.match("b", PROMPT, 0) == (16, False)  # the host run only: a synchronous load
    s.after_alloc("b", list(range(11)), 16)
    plan = s.build([], lambda _r: [])
    (op,) = plan.loads
    assert op.from_storage == (False,) * 4
    assert not plan.async_loads
    assert stats.snapshot()["declined_tokens"] == 24


def test_scheduler_offers_a_fast_store_whole() -> None:
    store, stats = Exists(), ConnectorStats()
    policy = slow_store_policy()
    policy.store.per_page_s = 0.0001  # the store reads as fast as the host copies
    s = side_with(policy, store, stats)
    host_then_store(s, store, 4)
    assert s.match("a", PROMPT, 0) == (40, True)
    s.after_alloc("a", list(range(11)), 40)
    assert stats.snapshot()["declined_tokens"] == 0
    assert policy.store_reads_queued == 6
    assert policy.host_queued == 10
    plan = s.build([], lambda _r: [])
    (op,) = plan.async_loads
    s.on_events([Event(Op.READ, k, True) for k in op.keys if k in op.keys[4:]])
    s.on_events([Event(Op.LOAD, k, True) for k in op.keys])
    assert policy.store_reads_queued == 0
    assert policy.host_queued == 0


def test_never_offers_nothing_but_still_saves() -> None:
    store, stats = Exists(), ConnectorStats()
    s = side_with(LoadPolicy(mode="never"), store, stats)
    host_then_store(s, store, 4)
    assert s.match("a", PROMPT, 0) == (0, False)
    plan = s.build([Scheduled("a", PROMPT, 0, len(PROMPT))], lambda _r: list(range(11)))
    assert len(plan.saves) == 6  # the blocks the host tier lacks are saved


def test_never_asks_the_store_nothing() -> None:
    class Counting(Exists):
        asked = 0

        def exists(self, keys, *, deadline=None):  # type: ignore[no-untyped-def]
            Counting.asked += len(keys)
            return super().exists(keys, deadline=deadline)

    store = Counting()
    s = side_with(LoadPolicy(mode="never"), store, ConnectorStats())
    host_then_store(s, store, 0)
    assert s.match("a", PROMPT, 0) == (0, False)
    assert Counting.asked == 0
