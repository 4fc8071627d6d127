"""Load or recompute: the pure choice (hicache.domain.load_choice)."""

from __future__ import annotations

import itertools

import pytest

from hicache.domain.load_choice import (
    HitCosts,
    PageCost,
    PrefillModel,
    attention_work,
    choose_end,
    load_seconds,
)

BS = 16


def linear_prefill(per_token_s: float, *, overhead_s: float = 0.0) -> PrefillModel:
    """A model fitted to steps costing ``overhead_s + per_token_s * tokens``."""
    m = PrefillModel()
    for tokens in (1, 64, 256, 1024, 1, 1, 512):
        m.observe(tokens, attention_work(tokens, 0), overhead_s + per_token_s * tokens)
    return m


def costs(host: float | None, store: float | None, **kw: float) -> HitCosts:
    return HitCosts(host_page_s=host, store_page_s=store, **kw)


# a 16-token block computes in 16 ms at 1 ms per token
FAST_HOST = 0.0001  # per page: 160x faster than computing it
SLOW_STORE = 0.1  # per page: 6x slower than computing it


def test_slow_store_tail_is_declined_and_host_run_offered() -> None:
    m = linear_prefill(0.001)
    end = choose_end(
        start=0, host_end=4, end=10, block_size=BS, costs=costs(FAST_HOST, SLOW_STORE), saved=m
    )
    assert end == 4


def test_fast_store_is_loaded_whole() -> None:
    m = linear_prefill(0.001)
    end = choose_end(
        start=0, host_end=4, end=10, block_size=BS, costs=costs(FAST_HOST, 0.001), saved=m
    )
    assert end == 10


def test_queued_work_on_the_store_tips_the_choice_to_recompute() -> None:
    m = linear_prefill(0.001)
    idle = costs(FAST_HOST, 0.002)
    busy = costs(FAST_HOST, 0.002, store_queued_s=1.0)
    assert choose_end(start=0, host_end=0, end=8, block_size=BS, costs=idle, saved=m) == 8
    assert choose_end(start=0, host_end=0, end=8, block_size=BS, costs=busy, saved=m) == 0


def test_queued_work_on_the_host_tips_the_host_run_to_recompute() -> None:
    m = linear_prefill(0.001)
    busy = costs(FAST_HOST, None, host_queued_s=1.0)
    assert choose_end(start=2, host_end=6, end=6, block_size=BS, costs=busy, saved=m) == 2


def test_unmeasured_tiers_and_prefill_are_tried() -> None:
    fitted = linear_prefill(0.001)
    assert (
        choose_end(start=0, host_end=3, end=7, block_size=BS, costs=costs(None, None), saved=fitted)
        == 7
    )
    # the store was never measured: it is tried even after a slow host
    slow_host = costs(1.0, None)
    assert choose_end(start=0, host_end=3, end=7, block_size=BS, costs=slow_host, saved=fitted) == 7
    # no prefill figure yet: every hit is offered
    slow = costs(SLOW_STORE, SLOW_STORE)
    assert (
        choose_end(start=0, host_end=3, end=7, block_size=BS, costs=slow, saved=PrefillModel()) == 7
    )


def test_store_latency_counts_only_when_the_store_is_read() -> None:
    m = linear_prefill(0.001)
    c = costs(FAST_HOST, 0.0001, store_latency_s=10.0)
    assert choose_end(start=0, host_end=4, end=10, block_size=BS, costs=c, saved=m) == 4


def test_choice_is_the_best_candidate_of_every_small_hit() -> None:
    """Exhaustive small cases: the choice lies in [start, end]; where every figure is known it
    gains at least as much as every other end block (the gain is convex within a run, so the
    run ends are the only candidates); where one is not, it is the longest unmeasured one."""
    m = linear_prefill(0.001, overhead_s=0.002)
    figures = [None, 0.0, 0.001, 0.05]
    for host_s, store_s in itertools.product(figures, [None, 0.0, 0.01, 0.2]):
        c = costs(host_s, store_s, store_latency_s=0.005)
        for start, host_end, end in itertools.product(range(4), range(6), range(6)):
            if start > end:
                continue
            got = choose_end(
                start=start, host_end=host_end, end=end, block_size=BS, costs=c, saved=m
            )
            assert start <= got <= end
            h = min(max(host_end, start), end)
            gains: dict[int, float | None] = {}
            for e in range(start, end + 1):
                load = load_seconds(c, start, h, e)
                saved = m.saved(start * BS, (e - start) * BS)
                gains[e] = None if load is None or saved is None else saved - load
            unmeasured = [e for e in {h, end} if e > start and gains[e] is None]
            if unmeasured:
                assert got == max(unmeasured), (host_s, store_s, start, host_end, end)
                continue
            best = max(g for g in gains.values() if g is not None)
            assert gains[got] == pytest.approx(best, abs=1e-9), (host_s, store_s, start, end)


def test_prefill_fit_recovers_overhead_tokens_and_attention() -> None:
    m = PrefillModel(decay=1.0)
    a, b, c = 0.003, 0.0002, 0.00005
    for tokens, ctx in [(1, 100), (1, 4000), (512, 0), (2048, 0), (4096, 0), (1024, 3072)]:
        att = attention_work(tokens, ctx)
        m.observe(tokens, att, a + b * tokens + c * att)
    got = m.coefficients()
    assert got == pytest.approx((a, b, c), rel=1e-6)
    assert m.saved(1000, 100) == pytest.approx(b * 100 + c * attention_work(100, 1000))


def test_prefill_fit_never_goes_negative() -> None:
    """Noisy steps whose unconstrained fit has a negative term fall back to the best
    non-negative subset (a negative per-token cost would make a long prompt free)."""
    m = PrefillModel(decay=1.0)
    for tokens, seconds in [(1, 0.05), (1, 0.06), (1000, 0.04), (2000, 0.055)]:
        m.observe(tokens, attention_work(tokens, 0), seconds)
    assert all(x >= 0 for x in m.coefficients())


def test_decode_steps_alone_give_no_prefill_figure() -> None:
    m = PrefillModel()
    for _ in range(10):
        m.observe(1, attention_work(1, 500), 0.01)
    assert not m.fitted
    assert m.saved(0, 100) is None
    m.observe(300, attention_work(300, 0), 0.3)
    assert m.fitted
    assert (m.saved(0, 100) or 0) > 0


def test_page_cost_is_an_ewma_of_seconds_per_page() -> None:
    c = PageCost()
    assert c.per_page_s is None
    assert c.seconds(10) == 0.0
    c.observe(10, 1.0)
    assert c.per_page_s == pytest.approx(0.1)
    c.observe(1, 1.0, alpha=0.5)
    assert c.per_page_s == pytest.approx(0.55)
    c.observe(0, 5.0)  # nothing transferred: no sample
    assert c.samples == 2


def test_steps_of_one_size_put_their_cost_on_the_tokens() -> None:
    """Repeats of one prompt cannot tell fixed from per-token cost: the fit must still say a
    prompt of that size costs what its steps took (not that its tokens are free)."""
    m = PrefillModel()
    for _ in range(3):
        m.observe(4096, attention_work(4096, 0), 1.5)
    assert m.step_s(4096, attention_work(4096, 0)) == pytest.approx(1.5)
    assert m.saved(0, 4096) == pytest.approx(1.5)


def test_decode_steps_between_prefills_do_not_wash_out_the_prefill_figure() -> None:
    """Forgetting follows tokens computed: a thousand one-token steps after a prefill leave
    its figure nearly whole (per-step forgetting would leave almost nothing of it)."""
    m = PrefillModel()
    m.observe(4096, attention_work(4096, 0), 2.0)
    for i in range(1000):
        m.observe(1, attention_work(1, 4096 + i), 0.02)
    assert m.saved(0, 4096) == pytest.approx(2.0 - 0.02, rel=0.1)
