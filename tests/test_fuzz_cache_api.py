"""Hostile input to the cache face (async and sync), the stores and the runtime: a result or one
HiCacheError, and the cache's bookkeeping consistent after every refused call.

Every argument of every public call of HiCache (match, insert, load, prefetch, evict,
checkpoint_boundaries, load_pools, device_placements), of SyncCache, of a DirectoryStore (get,
put, exists, remove) and of open_runtime / LayerBinding is replaced in turn by each value of
HOSTILE (wrong types, invalid numbers (inf, NaN, 1e308, an integer past float's range), one-shot
iterators, empty and huge values, nesting past the recursion limit, non-string keys); SyncCache's
release and placements take each as the match. After each
cache call: the index validates, no pin is held, nothing is in flight, and the device allocator
holds exactly the pages the index holds plus the ones the test allocated itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest

from hicache.adapters.storage import DirectorySettings, DirectoryStore
from hicache.bootstrap.runtime import open_runtime
from hicache.cache.face import HiCache
from hicache.cache.match import CacheMatch
from hicache.cache.sync import open_sync_cache
from hicache.cache.values import InsertResult
from hicache.domain import HiCacheError, HitPolicy, HostGroupPlan, LayerBinding, PoolName
from hicache.domain.tiers import Tier
from hicache.engine import open_sync
from tests.engine.fakes import Rig, dense_plan
from tests.engine.fakes import hybrid_plan as _hybrid_plan
from tests.fuzz_values import HOSTILE as SHARED
from tests.storage.conftest import key, page

pytestmark = pytest.mark.timeout(120)

KV, MAMBA = PoolName.KV, PoolName.MAMBA
PS = 4


# The shared hostile values (tests/fuzz_values.py), and a tier the calls take no value of.
HOSTILE: dict[str, Callable[[], object]] = {**SHARED, "Tier.STORAGE": lambda: Tier.STORAGE}


def state_plan() -> HostGroupPlan:
    plan = _hybrid_plan()
    pools = [
        attrs.evolve(p, hit_policy=HitPolicy.TRAILING_PAGES) if p.name is MAMBA else p
        for p in plan.pools
    ]
    return attrs.evolve(plan, pools=pools)


TOKENS = list(range(2 * PS + 1))

# Per call: its good arguments (a function of the rig, the cache and a match), positional.
Args = Callable[[Rig, HiCache, CacheMatch], list[Any]]


def _pages(rig: Rig) -> tuple[dict[PoolName, list[int]], dict[int, dict[PoolName, int]]]:
    got = rig.device_slots.allocate({KV: 2, MAMBA: 1}).pages
    return {KV: list(got[KV])}, {2: {MAMBA: got[MAMBA][0]}}


CALLS: dict[str, tuple[str, Args]] = {
    "match": ("match", lambda r, c, m: [TOKENS]),
    "insert": ("insert", lambda r, c, m: [TOKENS, *_pages(r)]),
    "load": ("load", lambda r, c, m: [m, None]),
    "prefetch": ("prefetch", lambda r, c, m: [TOKENS, None]),
    "evict": ("evict", lambda r, c, m: [Tier.DEVICE, 1, None]),
    "checkpoint_boundaries": ("checkpoint_boundaries", lambda r, c, m: [8, 0]),
    "load_pools": ("load_pools", lambda r, c, m: [m]),
    "device_placements": ("device_placements", lambda r, c, m: [m]),
}
KEYWORDS = {"insert": {2: "checkpoints"}, "prefetch": {1: "deadline"}}
CASES = [
    (call, i, value)
    for call, (_, args) in CALLS.items()
    for i in range(len(args(None, None, None) if call not in ("insert",) else [0, 0, 0]))  # type: ignore[arg-type]
    for value in HOSTILE
]


def _split(call: str, args: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    kw = KEYWORDS.get(call, {})
    pos = [a for i, a in enumerate(args) if i not in kw]
    return pos, {name: args[i] for i, name in kw.items()}


def _check_consistent(rig: Rig, cache: HiCache, mine: int) -> None:
    cache.index.validate()
    stats = cache.index.statistics()
    assert stats.in_flight == 0, stats
    used = rig.device_slots.allocator(KV).used_count()
    assert used == stats.on_tier.device + mine, (used, stats)


@pytest.mark.asyncio
@pytest.mark.parametrize(("call", "position", "value"), CASES)
async def test_a_hostile_argument_to_the_cache_face_is_a_result_or_a_typed_error(
    call: str, position: int, value: str
) -> None:
    rig = Rig(state_plan())
    async with rig.engine, HiCache(rig.engine) as cache:
        pages, checkpoints = _pages(rig)
        await cache.insert(TOKENS, pages, checkpoints=checkpoints)
        await cache.wait_idle()
        match = await cache.match(TOKENS)
        name, good = CALLS[call]
        args = good(rig, cache, match)
        mine = rig.device_slots.allocator(KV).used_count() - cache.index.statistics().on_tier.device
        args[position] = HOSTILE[value]()
        pos, kw = _split(call, args)
        try:
            result = getattr(cache, name)(*pos, **kw)
            if hasattr(result, "__await__"):
                result = await result
        except HiCacheError:
            result = None
        if isinstance(result, CacheMatch):
            result.release()
        if isinstance(result, InsertResult):  # the duplicates it released went back
            mine -= len(result.released.get(KV, ()))
        match.release()
        await cache.wait_idle()
        (await cache.match([])).release()
        assert cache.index.statistics().pinned.total == 0
        _check_consistent(rig, cache, mine)


SYNC_CASES = [(c, i, v) for c, i, v in CASES if c in ("match", "insert", "evict", "prefetch")]


@pytest.mark.parametrize(("call", "position", "value"), SYNC_CASES)
def test_a_hostile_argument_through_the_sync_face_is_a_result_or_a_typed_error(
    call: str, position: int, value: str
) -> None:
    rig = Rig(state_plan())
    with open_sync(rig.engine) as sync, open_sync_cache(sync, HiCache(rig.engine)) as face:
        args = CALLS[call][1](rig, face.cache, None)  # type: ignore[arg-type]
        args[position] = HOSTILE[value]()
        pos, kw = _split(call, args)
        try:
            result = getattr(face, call)(*pos, **kw)
        except HiCacheError:
            result = None
        if isinstance(result, CacheMatch):
            face.release(result)
        face.call(lambda: None)
        assert face.statistics().index.pinned.total == 0


@pytest.mark.parametrize(
    ("call", "value"), [(c, v) for c in ("release", "placements") for v in HOSTILE]
)
def test_a_hostile_match_to_sync_release_or_placements_is_a_typed_error(
    call: str, value: str
) -> None:
    rig = Rig(state_plan())
    with open_sync(rig.engine) as sync, open_sync_cache(sync, HiCache(rig.engine)) as face:
        match = face.match(TOKENS)
        with pytest.raises(HiCacheError, match=f"{call}: expected a CacheMatch"):
            getattr(face, call)(HOSTILE[value]())
        face.release(match)
        assert face.statistics().index.pinned.total == 0


def test_a_match_of_another_cache_to_sync_release_is_a_typed_error() -> None:
    rig, other = Rig(state_plan()), Rig(state_plan())
    with (
        open_sync(rig.engine) as sync,
        open_sync_cache(sync, HiCache(rig.engine)) as face,
        open_sync(other.engine) as sync2,
        open_sync_cache(sync2, HiCache(other.engine)) as face2,
    ):
        foreign = face2.match(TOKENS)
        for call in ("release", "placements"):
            with pytest.raises(HiCacheError, match="comes from another cache"):
                getattr(face, call)(foreign)
        face2.release(foreign)


OPENER_CASES = [("sync", v) for v in HOSTILE] + [("cache", v) for v in HOSTILE]


@pytest.mark.parametrize(("which", "value"), OPENER_CASES)
def test_a_hostile_argument_to_the_sync_opener_is_a_typed_error(which: str, value: str) -> None:
    rig = Rig(dense_plan())
    with open_sync(rig.engine) as sync:
        args = [sync, HiCache(rig.engine)]
        args[0 if which == "sync" else 1] = HOSTILE[value]()
        with pytest.raises(HiCacheError), open_sync_cache(*args):  # type: ignore[arg-type]
            pass


STORE_CALLS: dict[str, Callable[[DirectoryStore, object, int], object]] = {
    "get": lambda s, v, i: (
        s.get(*[[key(1)], [page(8)], None][:i], v, *[[page(8)]][: 1 - i])
        if i < 2
        else s.get([key(1)], [page(8)], deadline=v)
    ),
    "put": lambda s, v, i: (
        s.put(*[[key(1)], [page(8)]][:i], v, *[[page(8)]][: 1 - i])
        if i < 2
        else s.put([key(1)], [page(8)], deadline=v)
    ),
    "exists": lambda s, v, i: s.exists(v) if i == 0 else s.exists([key(1)], deadline=v),
    "remove": lambda s, v, i: s.remove(v),
    "get one key": lambda s, v, i: s.get([v], [page(8)]),  # type: ignore[list-item]
    "put one buffer": lambda s, v, i: s.put([key(1)], [v]),  # type: ignore[list-item]
}
STORE_CASES = [
    (call, i, v)
    for call in STORE_CALLS
    for i in range({"get": 3, "put": 3, "exists": 2}.get(call, 1))
    for v in HOSTILE
]


@pytest.mark.parametrize(("call", "position", "value"), STORE_CASES)
def test_a_hostile_argument_to_a_store_is_a_status_or_a_typed_error(
    tmp_path: Path, call: str, position: int, value: str
) -> None:
    store = DirectoryStore(DirectorySettings(root=tmp_path))
    with contextlib.suppress(HiCacheError):
        STORE_CALLS[call](store, HOSTILE[value](), position)
    assert list(tmp_path.rglob("*.tmp")) == []
    assert all(p.is_relative_to(tmp_path) for p in tmp_path.rglob("*"))
    store.close()


RUNTIME_ARGS = [
    "host_pins",
    "device_pins",
    "device_capacities",
    "huge_pages",
    "event_sets",
    "backend",
    "name",
    "device_ownership",
]


@pytest.mark.parametrize(("arg", "value"), [(a, v) for a in RUNTIME_ARGS for v in HOSTILE])
def test_a_hostile_argument_to_open_runtime_is_refused_at_open(arg: str, value: str) -> None:
    try:
        kwargs: dict[str, Any] = {"backend": "torch", arg: HOSTILE[value]()}
        rt = open_runtime(dense_plan(), **kwargs)
    except HiCacheError:
        return
    rt._close_resources()  # accepted: it must be a value the runtime can use
    # None (the default), an empty per-pool mapping, True, a positive int or a name: usable.
    assert HOSTILE[value]() is None or arg in (
        "device_capacities",
        "backend",
        "huge_pages",
        "event_sets",
        "name",
    )


@pytest.mark.parametrize(("where", "value"), [(w, v) for w in ("pairs", "count") for v in HOSTILE])
def test_a_hostile_layer_binding_is_a_binding_error(where: str, value: str) -> None:
    bad = HOSTILE[value]()
    try:
        binding = LayerBinding({0: 0}, bad) if where == "count" else LayerBinding(bad, 2)  # type: ignore[arg-type]
    except HiCacheError:
        return
    assert all(isinstance(t, int) and isinstance(p, int) for t, p in binding.pairs)
    assert isinstance(binding.pool_layers, int)
