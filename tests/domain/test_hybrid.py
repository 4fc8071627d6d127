"""Hybrid-consistent boundaries: every pool restores at the boundary, or the hit shrinks."""

from __future__ import annotations

import pytest
from attrs import evolve
from hypothesis import given
from hypothesis import strategies as st

from hicache.domain import ConfigError, HitPolicy, HostGroupPlan, PoolName, PoolRole
from hicache.domain.hybrid import (
    CheckpointPolicy,
    GroupRules,
    PoolRule,
    Restore,
    has_from_sets,
    needed_pages,
    usable_boundary,
)
from tests.domain.builders import ANON, anchor, pool, sidecar, state_pool

KV, SWA, MAMBA, IDX = PoolName.KV, PoolName.SWA, PoolName.MAMBA, PoolName.INDEXER


def hybrid(window_pages: int = 2) -> GroupRules:
    return GroupRules(
        page_size=16,
        rules=[
            PoolRule(pool=KV, restore=Restore.ALL_PAGES),
            PoolRule(pool=IDX, restore=Restore.ALL_PAGES, follows_anchor=True),
            PoolRule(pool=SWA, restore=Restore.WINDOW, window_pages=window_pages),
            PoolRule(pool=MAMBA, restore=Restore.CHECKPOINT),
        ],
    )


def full(n: int) -> set[int]:
    return set(range(n))


def test_every_pool_present_everywhere_gives_the_whole_prefix() -> None:
    has = has_from_sets({KV: full(6), IDX: full(6), SWA: full(6), MAMBA: full(6)})
    assert usable_boundary(hybrid(), 6, has) == 6


def test_a_missing_state_checkpoint_shrinks_the_hit_to_the_last_checkpoint() -> None:
    has = has_from_sets({KV: full(6), IDX: full(6), SWA: full(6), MAMBA: {1, 3}})
    assert usable_boundary(hybrid(), 6, has) == 4  # checkpoint on page 3 = boundary 4


def test_no_checkpoint_at_all_is_a_zero_hit_never_a_partial_restore() -> None:
    has = has_from_sets({KV: full(6), IDX: full(6), SWA: full(6), MAMBA: set()})
    assert usable_boundary(hybrid(), 6, has) == 0


def test_sliding_window_needs_only_the_pages_that_end_at_the_boundary() -> None:
    # SWA pages 0..2 were dropped (outside every window we restore); 3..5 remain.
    has = has_from_sets({KV: full(6), IDX: full(6), SWA: {3, 4, 5}, MAMBA: full(6)})
    assert usable_boundary(hybrid(window_pages=2), 6, has) == 6
    assert usable_boundary(hybrid(window_pages=4), 6, has) == 0
    # A hole inside the window at 6 moves the boundary back to where a full window ends.
    has = has_from_sets({KV: full(6), IDX: full(6), SWA: {0, 1, 2, 3, 5}, MAMBA: full(6)})
    assert usable_boundary(hybrid(window_pages=2), 6, has) == 4
    assert needed_pages(hybrid(window_pages=2), SWA, 4) == range(2, 4)


def test_a_short_prefix_needs_only_the_pages_it_has_in_its_window() -> None:
    has = has_from_sets({KV: full(1), IDX: full(1), SWA: {0}, MAMBA: {0}})
    assert usable_boundary(hybrid(window_pages=3), 1, has) == 1


def test_an_all_pages_pool_caps_the_hit_at_its_first_hole() -> None:
    has = has_from_sets({KV: full(6), IDX: {0, 1, 3, 4, 5}, SWA: full(6), MAMBA: full(6)})
    assert usable_boundary(hybrid(), 6, has) == 2


@given(
    st.integers(min_value=0, max_value=12),
    st.sets(st.integers(0, 11)),
    st.sets(st.integers(0, 11)),
    st.integers(min_value=1, max_value=4),
)
def test_boundary_is_the_largest_that_every_pool_restores(
    n: int, swa: set[int], ckpt: set[int], window: int
) -> None:
    rules = hybrid(window_pages=window)
    sets = {KV: full(n), IDX: full(n), SWA: swa, MAMBA: ckpt}
    b = usable_boundary(rules, n, has_from_sets(sets))

    def restores(k: int) -> bool:
        return k == 0 or all(
            set(needed_pages(rules, p, k)) <= sets[p] for p in (KV, IDX, SWA, MAMBA)
        )

    assert restores(b)
    assert not any(restores(k) for k in range(b + 1, n + 1))


def test_rules_from_a_plan_follow_hit_policy_and_unit() -> None:
    swa = pool(SWA, PoolRole.INDEPENDENT, transfer=[2])
    plan = HostGroupPlan(
        host_memory=ANON,
        pools=[
            anchor(),
            sidecar(),
            evolve(swa, hit_policy=HitPolicy.TRAILING_PAGES),
            evolve(state_pool(transfer=[3]), hit_policy=HitPolicy.TRAILING_PAGES),
        ],
    )
    rules = GroupRules.from_plan(plan, sliding_window=40)
    assert rules.anchor is KV
    assert rules.rule(IDX) == PoolRule(pool=IDX, restore=Restore.ALL_PAGES, follows_anchor=True)
    assert rules.rule(SWA).window_pages == 3  # ceil(40 / 16)
    assert rules.rule(MAMBA).restore is Restore.CHECKPOINT
    assert rules.owners == (KV, SWA, MAMBA)
    with pytest.raises(ConfigError, match="sliding_window"):
        GroupRules.from_plan(plan)


def test_bad_rules_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="anchor"):
        GroupRules(page_size=1, rules=[PoolRule(pool=MAMBA, restore=Restore.CHECKPOINT)])
    with pytest.raises(ConfigError, match="window_pages"):
        PoolRule(pool=SWA, restore=Restore.WINDOW)
    with pytest.raises(ConfigError, match="one rule per pool"):
        GroupRules(
            page_size=1,
            rules=[PoolRule(pool=KV, restore=Restore.ALL_PAGES)] * 2,
        )


def test_checkpoint_policy_keeps_every_n_pages_and_the_request_end() -> None:
    policy = CheckpointPolicy(every_pages=4)
    assert policy.boundaries(10) == [4, 8, 10]
    assert policy.boundaries(8) == [4, 8]
    assert policy.boundaries(0) == []
    assert policy.keeps(4, 10)
    assert policy.keeps(10, 10)
    assert not policy.keeps(5, 10)
    assert CheckpointPolicy(every_pages=4, at_end=False).boundaries(10) == [4, 8]
