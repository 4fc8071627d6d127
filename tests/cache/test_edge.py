"""The cache face's public edge: a refused call changes nothing, and its error names the argument.

- An insert refused for its page ids (never allocated, freed, repeated, out of range, not an
  int; a checkpoint slot never allocated) leaves no index entry and no allocator change.
- An insert of another prefix onto device pages the index holds for a different prefix is
  refused (two prefixes on one page: a later hit would read the other prefix's bytes); the
  index's page-id holders are an invariant ``validate`` checks.
- API items of issue #18: a state model's insert without checkpoints, string pool names at
  ``evict``, the page-count message, ``checkpoint_boundaries`` past the hit, the window taken
  from the plan, ``PrefetchResult.skipped``.
Built on the engine's fakes (no torch).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import pytest

from hicache.cache.face import HiCache
from hicache.cache.values import PrefetchSkip
from hicache.domain import (
    CacheStateError,
    ConfigError,
    ForeignIndexError,
    HiCacheError,
    HitPolicy,
    HostGroupPlan,
    PoolName,
    SlotError,
)
from hicache.domain.hybrid import GroupRules
from hicache.domain.tiers import Tier
from tests.engine.fakes import Rig, dense_plan
from tests.engine.fakes import hybrid_plan as _hybrid_plan

KV, MAMBA = PoolName.KV, PoolName.MAMBA
PS = 4


def state_plan() -> HostGroupPlan:
    """KV + indexer sidecar + Mamba state restored from a checkpoint."""
    plan = _hybrid_plan()
    pools = [
        attrs.evolve(p, hit_policy=HitPolicy.TRAILING_PAGES) if p.name is MAMBA else p
        for p in plan.pools
    ]
    return attrs.evolve(plan, pools=pools)


def _tokens(pages: int, first: int = 0) -> list[int]:
    return list(range(first, first + pages * PS + 1))


def _used(rig: Rig) -> dict[PoolName, int]:
    return {
        n: rig.device_slots.allocator(n).pages - f
        for n, f in rig.device_slots.free_counts().items()
    }


# Each: (name, the device pages and checkpoints of a 2-page insert given two allocated KV pages
# ``a``, ``b`` and one allocated state slot ``s``, the error expected, a text it must name).
Bad = Callable[[int, int, int], tuple[dict[Any, Any], Any]]
BAD_IDS: list[tuple[str, Bad, type[HiCacheError], str]] = [
    (
        "never allocated",
        lambda a, b, s: ({KV: [a, 7]}, {2: {MAMBA: s}}),
        SlotError,
        r"device_pages\['kv'\]\[1\] = 7",
    ),
    (
        "repeated",
        lambda a, b, s: ({KV: [a, a]}, {2: {MAMBA: s}}),
        ConfigError,
        r"device_pages\['kv'\]\[1\] and device_pages\['kv'\]\[0\]",
    ),
    (
        "out of range",
        lambda a, b, s: ({KV: [a, 10**6]}, {2: {MAMBA: s}}),
        ForeignIndexError,
        "ids 0..7",
    ),
    ("negative", lambda a, b, s: ({KV: [a, -1]}, {2: {MAMBA: s}}), ForeignIndexError, "-1"),
    ("a bool", lambda a, b, s: ({KV: [a, True]}, {2: {MAMBA: s}}), ForeignIndexError, "True"),
    ("a text id", lambda a, b, s: ({KV: [a, "1"]}, {2: {MAMBA: s}}), ForeignIndexError, "'1'"),
    (
        "checkpoint never allocated",
        lambda a, b, s: ({KV: [a, b]}, {2: {MAMBA: 3}}),
        SlotError,
        r"checkpoints\[2\]\['mamba'\] = 3",
    ),
    (
        "checkpoint slot out of range",
        lambda a, b, s: ({KV: [a, b]}, {2: {MAMBA: 99}}),
        ForeignIndexError,
        r"checkpoints\[2\]\['mamba'\] = 99",
    ),
    (
        "page map not a mapping",
        lambda a, b, s: ([a, b], {2: {MAMBA: s}}),
        ConfigError,
        "device_pages must be a mapping",
    ),
    (
        "checkpoints not a mapping",
        lambda a, b, s: ({KV: [a, b]}, [s]),
        ConfigError,
        "checkpoints must be a mapping",
    ),
    (
        "checkpoint slots not a mapping",
        lambda a, b, s: ({KV: [a, b]}, {2: s}),
        ConfigError,
        r"checkpoints\[2\] must be a mapping",
    ),
    (
        "page ids not a sequence",
        lambda a, b, s: ({KV: a}, {2: {MAMBA: s}}),
        ConfigError,
        r"device_pages\['kv'\] must be a sequence",
    ),
]


@pytest.mark.asyncio
@pytest.mark.parametrize(("name", "bad", "error", "names"), BAD_IDS, ids=[c[0] for c in BAD_IDS])
async def test_a_refused_insert_leaves_no_index_entry_and_no_allocator_change(
    name: str, bad: Bad, error: type[HiCacheError], names: str
) -> None:
    rig = Rig(state_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        got = rig.device_slots.allocate({KV: 2, MAMBA: 1}).pages
        freed = rig.device_slots.allocate({KV: 1}).pages[KV][0]
        rig.device_slots.free({KV: [freed]})
        pages, checkpoints = bad(got[KV][0], got[KV][1], got[MAMBA][0])
        before = _used(rig)
        with pytest.raises(error, match=names):
            await cache.insert(_tokens(2), pages, checkpoints=checkpoints)
        assert cache.index.statistics().pages == 0
        cache.index.validate()
        assert _used(rig) == before
        assert (await cache.match(_tokens(2))).host_pages == 0


@pytest.mark.asyncio
async def test_an_insert_of_a_freed_page_is_refused_before_the_index_changes() -> None:
    rig = Rig(dense_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        ids = list(rig.device_slots.allocate({KV: 2}).pages[KV])
        rig.device_slots.free({KV: [ids[1]]})
        with pytest.raises(SlotError, match=r"is free .never allocated, or already freed"):
            await cache.insert(_tokens(2), {KV: ids})
        assert cache.index.statistics().pages == 0
        assert _used(rig) == {KV: 1}


@pytest.mark.asyncio
async def test_another_prefix_onto_device_pages_the_index_holds_is_refused() -> None:
    rig = Rig(dense_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        ids = list(rig.device_slots.allocate({KV: 2}).pages[KV])
        await cache.insert(_tokens(2), {KV: ids})
        before = cache.index.statistics()
        with pytest.raises(CacheStateError, match=f"DEVICE page {ids[0]} of pool 'kv' holds"):
            await cache.insert(_tokens(2, first=500), {KV: ids})
        assert cache.index.statistics() == before
        cache.index.validate()
        assert (await cache.match(_tokens(2, first=500))).host_pages == 0
        m = await cache.match(_tokens(2))
        assert m.device_pages == 2
        assert [w[KV] for w in m.placements()] == ids
        m.release()
        # The same prefix on the same pages again is a duplicate, not a conflict.
        again = await cache.insert(_tokens(2), {KV: ids})
        assert again.released == {}
        # Pages the index gave back (evicted) can hold another prefix.
        await cache.evict(Tier.DEVICE, 2)
        fresh = list(rig.device_slots.allocate({KV: 2}).pages[KV])
        await cache.insert(_tokens(2, first=500), {KV: fresh})
        cache.index.validate()


def test_validate_catches_a_page_id_holder_that_disagrees_with_the_placements() -> None:
    from hicache.domain.prefix_index import PrefixIndex

    rules = GroupRules.from_plan(dense_plan())
    index = PrefixIndex(rules)
    index.insert([b"a" * 32, b"b" * 32], [{KV: 0}, {KV: 1}])
    index.validate()
    index._held[Tier.DEVICE]["kv"][0] = b"b" * 32  # the broken case: page 0 "holds" b
    with pytest.raises(CacheStateError, match="holders disagree"):
        index.validate()
    del index._held[Tier.DEVICE]["kv"][0]  # page 0 holds nothing: lost track
    with pytest.raises(CacheStateError, match="holders disagree"):
        index.validate()


def test_the_index_refuses_one_page_id_named_for_two_pages() -> None:
    from hicache.domain.prefix_index import PrefixIndex

    index = PrefixIndex(GroupRules.from_plan(dense_plan()))
    with pytest.raises(ConfigError, match="named for two pages"):
        index.insert([b"a" * 32, b"b" * 32], [{KV: 0}, {KV: 0}])
    assert len(index) == 0


# ---- issue #18: the API explains what the caller got wrong ---------------------------------


@pytest.mark.asyncio
async def test_a_state_models_insert_without_checkpoints_is_refused_naming_checkpoints() -> None:
    rig = Rig(state_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        ids = list(rig.device_slots.allocate({KV: 2}).pages[KV])
        with pytest.raises(ConfigError, match=r"pass checkpoints=\{boundary: \{'mamba': slot\}\}"):
            await cache.insert(_tokens(2), {KV: ids})
        assert cache.index.statistics().pages == 0
        # On purpose: an explicit empty mapping inserts the pages (never a hit on their own).
        await cache.insert(_tokens(2), {KV: ids}, checkpoints={})
        assert cache.index.statistics().pages == 2
        assert (await cache.match(_tokens(2))).host_pages == 0


@pytest.mark.asyncio
async def test_evict_takes_pool_names_as_text_like_every_other_call() -> None:
    rig = Rig(state_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        got = rig.device_slots.allocate({KV: 2, MAMBA: 1}).pages
        await cache.insert(_tokens(2), {KV: list(got[KV])}, checkpoints={2: {MAMBA: got[MAMBA][0]}})
        await cache.wait_idle()
        out = await cache.evict(Tier.DEVICE, 4, "mamba")
        assert out.evicted == 1
        assert out.freed == {MAMBA: (got[MAMBA][0],)}
        out = await cache.evict(Tier.DEVICE, 4, "kv")
        assert out.evicted == 2
        with pytest.raises(ConfigError, match="evict: pool: unknown pool 'kvv'"):
            await cache.evict(Tier.DEVICE, 4, "kvv")


@pytest.mark.asyncio
async def test_too_few_pages_says_what_was_expected_once() -> None:
    rig = Rig(dense_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        exact = list(range(2 * PS))  # no partial page: one count is right, say it once
        with pytest.raises(
            ConfigError, match=r"has 1 pages for 8 tokens of page size 4: expected 2$"
        ):
            await cache.insert(exact, {KV: [0]})
        with pytest.raises(ConfigError, match=r"expected 2 \(full pages\) or 3 \(with the partial"):
            await cache.insert(_tokens(2), {KV: [0]})


@pytest.mark.asyncio
async def test_checkpoint_boundaries_are_those_past_the_hit() -> None:
    rig = Rig(state_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        assert cache.checkpoint_boundaries(20) == [8, 16, 20]
        assert cache.checkpoint_boundaries(20, 8) == [16, 20]
        assert cache.checkpoint_boundaries(20, 20) == []
        got = rig.device_slots.allocate({KV: 2, MAMBA: 1}).pages
        await cache.insert(_tokens(2), {KV: list(got[KV])}, checkpoints={2: {MAMBA: got[MAMBA][0]}})
        async with await cache.match(_tokens(5)) as m:
            assert m.host_pages == 2
            assert cache.checkpoint_boundaries(5, m) == [5]
        for bad in (-1, 1.5, "8", None, True):
            with pytest.raises(ConfigError, match="checkpoint_boundaries"):
                cache.checkpoint_boundaries(bad)  # type: ignore[arg-type]


def test_the_sliding_window_comes_from_the_plan_and_a_conflicting_setting_names_both() -> None:
    from hicache.bootstrap import load_model_spec
    from hicache.domain import PlanSettings, plan_stack
    from hicache.domain.hybrid import Restore

    spec = load_model_spec("gpt-oss-20b")
    plan = plan_stack(spec, PlanSettings(tp_size=8, page_size=16, device_tokens=256))
    assert plan.sliding_window == spec.sliding_window == 128
    rules = GroupRules.from_plan(plan)  # no setting needed
    assert [r.window_pages for r in rules.rules if r.restore is Restore.WINDOW] == [8]
    assert GroupRules.from_plan(plan, sliding_window=128) == rules  # the same: allowed
    with pytest.raises(
        ConfigError,
        match=r"sliding_window=64 conflicts with the plan's sliding "
        r"window 128 \(ModelSpec.sliding_window of 'gpt_oss'\)",
    ):
        GroupRules.from_plan(plan, sliding_window=64)
    bare = attrs.evolve(plan, sliding_window=None)  # a plan built without a spec
    with pytest.raises(ConfigError, match=r"set CacheSettings\(sliding_window=tokens\)"):
        GroupRules.from_plan(bare)
    assert GroupRules.from_plan(bare, sliding_window=128) == rules


@pytest.mark.asyncio
async def test_a_prefetch_that_ran_has_no_skip_reason_and_one_that_did_not_says_why() -> None:
    rig = Rig(dense_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        got = await cache.prefetch(_tokens(2))
        assert got.skipped is PrefetchSkip.NO_STORAGE
        assert got.skipped.value == "no storage tier"


@pytest.mark.asyncio
async def test_packed_token_bytes_match_and_insert_like_the_token_list() -> None:
    from hicache.domain.keys import pack_tokens

    rig = Rig(dense_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        ids = list(rig.device_slots.allocate({KV: 2}).pages[KV])
        await cache.insert(pack_tokens(_tokens(2)), {KV: ids})
        async with await cache.match(pack_tokens(_tokens(2))) as m:
            assert m.tokens == 2 * PS + 1  # tokens, not bytes
            assert m.device_pages == 2
        assert cache.statistics().matched_tokens == 2 * PS + 1
