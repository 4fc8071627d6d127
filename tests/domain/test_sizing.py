"""Sizing: ratio mode, a byte budget split over the pools, per-pool overrides, the host check."""

from __future__ import annotations

import pytest

from hicache.domain import (
    AttentionSpec,
    BudgetSizing,
    ConfigError,
    GatedDeltaNetSpec,
    LayerKind,
    ModelSpec,
    PlanSettings,
    PoolName,
    RatioSizing,
    SizingError,
    check_host_memory,
    parse_size,
    plan_stack,
    ratio_capacity,
    split_budget,
)
from hicache.domain.sizing import DEFAULT_RESERVE_BYTES, Demand

GiB = 1 << 30


@pytest.mark.parametrize(
    ("text", "nbytes"),
    [
        ("64GiB", 64 * GiB),
        ("64 gib", 64 * GiB),
        ("500MB", 500 * 10**6),
        ("1.5G", 1_500_000_000),
        ("2TiB", 2 << 40),
        ("4KiB", 4096),
        ("1048576", 1048576),
        (4096, 4096),
    ],
)
def test_parse_size(text: str | int, nbytes: int) -> None:
    assert parse_size(text) == nbytes


@pytest.mark.parametrize("text", ["garbage", "64 GiBs", "-1GiB", "0", "0.1", "", "1e9", 0, -5])
def test_parse_size_rejects_what_is_not_a_positive_size(text: str | int) -> None:
    with pytest.raises(ConfigError) as info:
        parse_size(text)
    assert repr(text) in str(info.value)


def test_ratio_capacity_is_floored_to_whole_pages() -> None:
    assert ratio_capacity(65536, 2.0, 64) == 131072
    # 100 x 1.5 = 150 units = 2 whole pages of 64
    assert ratio_capacity(100, 1.5, 64) == 128
    assert ratio_capacity(256, 2.0, 1) == 512


def test_ratio_capacity_below_one_page_is_an_error() -> None:
    with pytest.raises(SizingError, match="less than one page of 64"):
        ratio_capacity(16, 2.0, 64)
    with pytest.raises(SizingError, match="device capacity must be positive"):
        ratio_capacity(0, 2.0, 64)


@pytest.mark.parametrize("ratio", [0, -1.0, float("nan"), float("inf"), "2"])
def test_ratio_must_be_a_positive_number(ratio: object) -> None:
    with pytest.raises(ConfigError, match="host ratio must be a positive number"):
        RatioSizing(ratio)  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", [0, -1, 1.5])
def test_budget_must_be_positive_bytes(budget: object) -> None:
    with pytest.raises(ConfigError, match="host budget must be a positive number of bytes"):
        BudgetSizing(budget)  # type: ignore[arg-type]


def test_split_budget_is_proportional_in_whole_pages_within_the_budget() -> None:
    demands = [Demand("a", 3, 10), Demand("b", 1, 7)]
    pages = split_budget(1000, demands)
    # a: 1000 x 3/4 = 750 B -> 75 pages of 10 B; b: 1000 x 1/4 = 250 B -> 35 pages of 7 B
    assert pages == {"a": 75, "b": 35}
    assert 75 * 10 + 35 * 7 <= 1000


def test_split_budget_never_gives_every_pool_the_whole_budget() -> None:
    # The bug seen elsewhere: two pools of equal weight each got the full 20 GB.
    pages = split_budget(20 * 10**9, [Demand("kv", 1, 10**6), Demand("mamba", 1, 10**6)])
    assert pages == {"kv": 10_000, "mamba": 10_000}


def test_split_budget_errors() -> None:
    with pytest.raises(SizingError, match=r"leaves pool 'mamba' less than one page.*override"):
        split_budget(1000, [Demand("kv", 99, 10), Demand("mamba", 1, 100)])
    with pytest.raises(SizingError, match="no pool has device bytes"):
        split_budget(1000, [Demand("kv", 0, 10)])
    with pytest.raises(SizingError, match="budget must be positive"):
        split_budget(0, [Demand("kv", 1, 10)])


def test_check_host_memory_keeps_the_reserve() -> None:
    check_host_memory(50 * GiB, 60 * GiB)  # 60 - 10 reserve = 50 usable
    with pytest.raises(SizingError, match=r"needs 53687091201 B .* only 53687091200 B are usable"):
        check_host_memory(50 * GiB + 1, 60 * GiB)
    assert 10 * GiB == DEFAULT_RESERVE_BYTES


def test_check_host_memory_counts_every_rank_on_the_host() -> None:
    check_host_memory(10 * GiB, 100 * GiB, reserve_bytes=20 * GiB, ranks_on_host=8)
    with pytest.raises(SizingError, match=r"8 rank\(s\) x 10737418241 B"):
        check_host_memory(10 * GiB + 1, 100 * GiB, reserve_bytes=20 * GiB, ranks_on_host=8)
    with pytest.raises(ConfigError, match="ranks_on_host must be at least 1"):
        check_host_memory(1, 100 * GiB, ranks_on_host=0)


def test_check_host_memory_with_a_reserve_larger_than_the_host() -> None:
    with pytest.raises(SizingError, match="only 0 B are usable"):
        check_host_memory(1, 5 * GiB)


# A small KV + Gated DeltaNet model whose numbers are easy to follow:
#   1 full-attention layer: K and V, 2 heads x 64 x bf16 = 512 B per token
#   3 linear layers: conv (2x1x16 + 1x16 = 48, 3) bf16 = 288 B + temporal (1, 16, 16) fp32 = 1024 B
SPEC = ModelSpec(
    model_type="tiny_hybrid",
    layer_kinds=[LayerKind.LINEAR_ATTENTION] * 3 + [LayerKind.FULL_ATTENTION],
    attention=AttentionSpec(kv_heads=2, head_dim=64),
    state=GatedDeltaNetSpec(key_heads=1, value_heads=1, key_dim=16, value_dim=16, conv_kernel=4),
)
KV_TOKEN = 512 * 1  # bytes of one token over the kv pool's 1 layer
STATE_SLOT = (288 + 1024) * 3  # bytes of one slot over the state pool's 3 layers


def settings(**kw: object) -> PlanSettings:
    base: dict[str, object] = {"page_size": 16, "device_tokens": 1024, "device_slots": 16}
    base.update(kw)
    return PlanSettings(**base)  # type: ignore[arg-type]


def test_ratio_mode_through_the_planner() -> None:
    plan = plan_stack(SPEC, settings(sizing=RatioSizing(1.5)))
    assert plan.pool("kv").capacity == 1536
    assert plan.pool("mamba").capacity == 24


def test_budget_mode_splits_by_device_bytes() -> None:
    budget = 1_000_000
    plan = plan_stack(SPEC, settings(sizing=BudgetSizing(budget)))
    kv_device = 1024 * KV_TOKEN  # 524288
    state_device = 16 * STATE_SLOT  # 62976
    total = kv_device + state_device
    kv_pages = budget * kv_device // (total * 16 * KV_TOKEN)
    state_slots = budget * state_device // (total * STATE_SLOT)
    assert (kv_pages, state_slots) == (108, 27)
    assert plan.pool("kv").capacity == kv_pages * 16
    assert plan.pool("mamba").capacity == state_slots
    assert plan.nbytes == 1728 * KV_TOKEN + 27 * STATE_SLOT <= budget


def test_a_starved_state_pool_is_an_error_until_it_gets_an_override() -> None:
    # 16 slots of 3936 B weigh little against 65536 tokens of 512 B: the split leaves 0 slots.
    starved = settings(device_tokens=65536, sizing=BudgetSizing(2_000_000))
    with pytest.raises(SizingError, match="leaves pool 'mamba' less than one page"):
        plan_stack(SPEC, starved)
    fixed = settings(
        device_tokens=65536, sizing=BudgetSizing(2_000_000), capacity_overrides={"mamba": 100}
    )
    plan = plan_stack(SPEC, fixed)
    assert plan.pool("mamba").capacity == 100
    # The rest of the budget goes to the kv pool, in whole pages.
    rest = 2_000_000 - 100 * STATE_SLOT
    assert plan.pool("kv").capacity == rest // (16 * KV_TOKEN) * 16
    assert plan.nbytes <= 2_000_000


def test_override_in_ratio_mode_fixes_only_that_pool() -> None:
    plan = plan_stack(SPEC, settings(capacity_overrides={PoolName.KV: 64}))
    assert plan.pool("kv").capacity == 64
    assert plan.pool("mamba").capacity == 32  # 16 device slots x 2.0


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv": 100}, "positive whole number of pages of 16, got 100"),
        ({"mamba": 0}, "positive whole number of pages of 1, got 0"),
        ({"swa": 64}, r"names pools \['swa'\], which model .* does not have"),
    ],
)
def test_bad_overrides(overrides: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        plan_stack(SPEC, settings(capacity_overrides=overrides))


def test_overrides_that_take_the_whole_budget() -> None:
    with pytest.raises(ConfigError, match="take 393600 B, the whole budget of 1000 B"):
        plan_stack(SPEC, settings(sizing=BudgetSizing(1000), capacity_overrides={"mamba": 100}))
    over = settings(sizing=BudgetSizing(1000), capacity_overrides={"mamba": 1, "kv": 16})
    with pytest.raises(ConfigError, match="more than the budget of 1000 B"):
        plan_stack(SPEC, over)


def test_capacities_are_whole_pages() -> None:
    plan = plan_stack(
        SPEC, settings(page_size=48, device_tokens=1008, sizing=BudgetSizing(7_777_777))
    )
    for p in plan.pools:
        assert p.capacity % p.page_size == 0
        assert p.capacity > 0
