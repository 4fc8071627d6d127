"""MooncakeStore against real processes: a mooncake_master and a storage node on 127.0.0.1.

Skipped (with the reason) where the Mooncake wheel cannot be imported, unless
HICACHE_REQUIRE_MOONCAKE=1 (CI sets it): then a missing wheel fails the run.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator

import pytest
import torch

from hicache.adapters.host_memory import open_region
from hicache.adapters.host_pool import materialise_host_group
from hicache.adapters.storage.mooncake import MooncakeStore
from hicache.adapters.storage.mooncake_config import load_mooncake_config
from hicache.adapters.storage.mooncake_local import LocalMooncake, local_mooncake, mooncake_store
from hicache.domain import (
    ConfigError,
    HostMemory,
    HostMemoryError,
    Layout,
    MemoryKind,
    Pinning,
    StoreError,
)
from hicache.domain.storage import PageBuffer, Store, StoreKey, StoreStatus
from tests.adapters.pool_plans import group_plan
from tests.storage.mooncake_support import require_mooncake

require_mooncake()

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(60)]

PAGE_HASHES = [f"{i:064x}" for i in range(1, 65)]


def _keys(pool: str, n: int, namespace: str = "model-a.bf16.p16") -> list[StoreKey]:
    return [StoreKey(namespace, pool, h) for h in PAGE_HASHES[:n]]


def _fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.view(torch.uint8).reshape(-1).copy_(
        torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=g)
    )


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def _mv(t: torch.Tensor) -> memoryview:
    """A memoryview of a contiguous CPU tensor's bytes (no copy)."""
    return memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalMooncake]:
    with local_mooncake(segment_bytes=128 << 20) as c:
        yield c


@pytest.fixture
def own_cluster() -> Iterator[LocalMooncake]:
    """A cluster of its own, for tests that kill a process."""
    with local_mooncake(segment_bytes=32 << 20) as c:
        yield c


@pytest.fixture
def store(cluster: LocalMooncake) -> Iterator[MooncakeStore]:
    s = MooncakeStore.open(load_mooncake_config(cluster.extra_config()))
    try:
        yield s
    finally:
        s.close()


def _namespace(request: pytest.FixtureRequest) -> str:
    """A namespace of this test alone (the module's cluster outlives each test)."""
    return request.node.name.replace("[", ".").replace("]", "")[-100:]


# --- round trips -------------------------------------------------------------------------


def _dense_kv(pages: int) -> tuple[torch.Tensor, list[PageBuffer]]:
    """A layer-first K/V pool [kv, layer, page, tokens, heads, dim]: a page is 2 x 3 segments."""
    pool = torch.empty(2, 3, pages, 16, 2, 8, dtype=torch.bfloat16)
    bufs = [
        [_mv(pool[kv, layer, p]) for kv in range(2) for layer in range(3)] for p in range(pages)
    ]
    return pool, bufs


def _latent(pages: int) -> tuple[torch.Tensor, list[PageBuffer]]:
    """A page-first latent pool [page, layer, tokens, 576]: one segment per page."""
    pool = torch.empty(pages, 2, 16, 72, dtype=torch.float16)
    return pool, [[_mv(pool[p])] for p in range(pages)]


def _state(pages: int) -> tuple[torch.Tensor, list[PageBuffer]]:
    """A recurrent state pool [slot, layer, heads, k, v] in fp32: one segment per slot."""
    pool = torch.empty(pages, 2, 2, 8, 8, dtype=torch.float32)
    return pool, [[_mv(pool[p])] for p in range(pages)]


@pytest.mark.parametrize("shape", [_dense_kv, _latent, _state], ids=["dense_kv", "latent", "state"])
def test_pages_round_trip_byte_exact_through_the_storage_node(
    store: MooncakeStore, shape: object, request: pytest.FixtureRequest
) -> None:
    make = shape  # type: ignore[assignment]
    src, src_bufs = make(6)  # type: ignore[operator]
    dst, dst_bufs = make(6)  # type: ignore[operator]
    _fill(src, 1)
    dst.view(torch.uint8).fill_(0xEE)
    store.register([_mv(src), _mv(dst)])
    keys = _keys("pool", 6, _namespace(request))

    assert store.put(keys, src_bufs) == [StoreStatus.OK] * 6
    assert store.get(keys, dst_bufs) == [StoreStatus.OK] * 6
    assert _same_bytes(src, dst)


def test_the_mooncake_store_is_a_store_of_the_port(store: MooncakeStore) -> None:
    assert isinstance(store, Store)
    assert store.name == "mooncake"
    assert store.health().healthy


def test_putting_a_page_twice_is_ok_and_keeps_one_object(
    store: MooncakeStore, request: pytest.FixtureRequest
) -> None:
    src, bufs = _latent(2)
    _fill(src, 2)
    store.register([_mv(src)])
    keys = _keys("latent", 2, _namespace(request))
    assert store.put(keys, bufs) == [StoreStatus.OK] * 2
    assert store.put(keys, bufs) == [StoreStatus.OK] * 2
    assert store.exists(keys) == [True, True]


def test_a_partial_hit_is_ok_for_held_pages_and_miss_for_the_rest_without_touching_them(
    store: MooncakeStore, request: pytest.FixtureRequest
) -> None:
    src, src_bufs = _state(6)
    dst, dst_bufs = _state(6)
    _fill(src, 3)
    dst.view(torch.uint8).fill_(0xAB)
    store.register([_mv(src), _mv(dst)])
    keys = _keys("state", 6, _namespace(request))
    assert store.put(keys[:4], src_bufs[:4]) == [StoreStatus.OK] * 4

    assert store.exists(keys) == [True] * 4 + [False] * 2  # a hint
    got = store.get(keys, dst_bufs)
    assert got == [StoreStatus.OK] * 4 + [StoreStatus.MISS] * 2
    assert _same_bytes(dst[:4], src[:4])
    assert bool((dst[4:].view(torch.uint8) == 0xAB).all())


def test_a_buffer_whose_size_differs_from_the_object_is_invalid(
    store: MooncakeStore, request: pytest.FixtureRequest
) -> None:
    area = torch.zeros(1 << 20, dtype=torch.uint8)
    _fill(area[: 64 << 10], 4)
    store.register([_mv(area)])
    (key,) = _keys("kv", 1, _namespace(request))
    assert store.put([key], [[_mv(area[: 64 << 10])]]) == [StoreStatus.OK]
    smaller = [[_mv(area[128 << 10 : 160 << 10])]]
    larger = [[_mv(area[256 << 10 : 384 << 10])]]
    assert store.get([key], smaller) == [StoreStatus.INVALID]
    assert bool((area[128 << 10 : 160 << 10] == 0).all())  # nothing written
    assert store.get([key], larger) == [StoreStatus.INVALID]


def test_a_buffer_outside_registered_memory_is_invalid_and_nothing_is_sent(
    store: MooncakeStore, request: pytest.FixtureRequest
) -> None:
    stray = torch.ones(4096, dtype=torch.uint8)
    keys = _keys("kv", 1, _namespace(request))
    assert store.put(keys, [[_mv(stray)]]) == [StoreStatus.INVALID]
    assert store.exists(keys) == [False]


def test_a_deadline_already_past_answers_transient_without_calling_the_store(
    store: MooncakeStore, request: pytest.FixtureRequest
) -> None:
    src, bufs = _latent(1)
    store.register([_mv(src)])
    keys = _keys("latent", 1, _namespace(request))
    past = time.monotonic() - 1
    assert store.put(keys, bufs, deadline=past) == [StoreStatus.TRANSIENT]
    assert store.exists(keys, deadline=past) == [False]
    assert store.exists(keys) == [False]  # the put never happened


def test_remove_forgets_pages_and_answers_ok_for_pages_never_held(
    store: MooncakeStore, request: pytest.FixtureRequest
) -> None:
    src, bufs = _latent(2)
    store.register([_mv(src)])
    keys = _keys("latent", 2, _namespace(request))
    assert store.put(keys[:1], bufs[:1]) == [StoreStatus.OK]
    assert store.remove(keys) == [StoreStatus.OK, StoreStatus.OK]
    assert store.exists(keys) == [False, False]


def test_latent_pages_written_by_one_rank_are_read_by_another_client(
    cluster: LocalMooncake, store: MooncakeStore, request: pytest.FixtureRequest
) -> None:
    src, src_bufs = _latent(3)
    _fill(src, 5)
    store.register([_mv(src)])
    keys = _keys("latent", 3, _namespace(request))
    assert store.put(keys, src_bufs) == [StoreStatus.OK] * 3

    other = MooncakeStore.open(
        load_mooncake_config(cluster.extra_config()), provide_host_memory=False
    )
    try:
        dst, dst_bufs = _latent(3)
        other.register([_mv(dst)])
        assert other.get(keys, dst_bufs) == [StoreStatus.OK] * 3
        assert _same_bytes(dst, src)
    finally:
        other.close()


def test_a_closed_store_answers_fatal_and_forgets_its_host_memory_provider(
    cluster: LocalMooncake,
) -> None:
    s = MooncakeStore.open(load_mooncake_config(cluster.extra_config()))
    src, bufs = _latent(1)
    s.register([_mv(src)])
    s.close()
    s.close()  # idempotent
    keys = _keys("latent", 1)
    assert s.put(keys, bufs) == [StoreStatus.FATAL]
    assert s.get(keys, bufs) == [StoreStatus.FATAL]
    assert s.exists(keys) == [False]
    assert not s.health().healthy
    with pytest.raises(HostMemoryError, match="no provider"):
        open_region(HostMemory(MemoryKind("store:mooncake"), Pinning.OFF), 4096)


# --- store-owned host memory ---------------------------------------------------------------


def test_store_owned_host_memory_is_registered_and_moves_pages_without_register_calls(
    store: MooncakeStore, request: pytest.FixtureRequest
) -> None:
    host = HostMemory(MemoryKind("store:mooncake"), Pinning.OFF)
    keys = _keys("kv", 4, _namespace(request))
    with open_region(host, 1 << 20) as a, open_region(host, 1 << 20) as b:
        ta, tb = a.tensor(), b.tensor()
        _fill(ta, 6)
        page = 64 << 10
        src = [[_mv(ta[i * page : (i + 1) * page])] for i in range(4)]
        dst = [[_mv(tb[i * page : (i + 1) * page])] for i in range(4)]
        assert store.put(keys, src) == [StoreStatus.OK] * 4
        assert store.get(keys, dst) == [StoreStatus.OK] * 4
        assert torch.equal(ta[: 4 * page], tb[: 4 * page])
    # Handed back: unregistered, so the same addresses are no longer transfer targets.
    stray = torch.zeros(page, dtype=torch.uint8)
    assert store.get(keys[:1], [[_mv(stray)]]) == [StoreStatus.INVALID]


def test_a_second_store_cannot_take_over_the_host_memory_of_the_first(
    cluster: LocalMooncake, store: MooncakeStore
) -> None:
    with pytest.raises(ConfigError, match="already has a host memory provider"):
        MooncakeStore.open(load_mooncake_config(cluster.extra_config()))


@pytest.mark.parametrize("kind", ["mha", "mla", "indexer", "state"])
def test_every_pool_of_a_store_owned_host_group_round_trips_its_pages(
    store: MooncakeStore, kind: str, request: pytest.FixtureRequest
) -> None:
    host = HostMemory(MemoryKind("store:mooncake"), Pinning.OFF)
    plan, _ = group_plan(kind, Layout.PAGE_FIRST, memory=host)
    namespace = _namespace(request)
    with materialise_host_group(plan) as group:
        assert {r.kind.name for _, _, r in group.regions()} == {"store:mooncake"}
        for seed, (name, pool) in enumerate(group.pools.items()):
            for buf in pool.regions.values():
                _fill(buf.tensor(), 100 + seed)
            pages = min(pool.pages, 4)
            half = pages // 2
            keys = _keys(name.value, half, namespace)
            src = [[_mv(v) for v in pool.page_views(p)] for p in range(half)]
            dst = [[_mv(v) for v in pool.page_views(p)] for p in range(half, 2 * half)]
            for views in dst:
                for v in views:
                    v[:] = b"\x00" * v.nbytes
            # One object per page per pool, straight from and into registered pool pages.
            assert store.put(keys, src) == [StoreStatus.OK] * half
            assert store.get(keys, dst) == [StoreStatus.OK] * half
            for p in range(half):
                for a, b in zip(pool.page_views(p), pool.page_views(half + p), strict=True):
                    assert _same_bytes(a, b)


# --- faults --------------------------------------------------------------------------------


def test_a_killed_storage_node_gives_non_ok_within_the_deadline_and_no_corrupt_bytes(
    own_cluster: LocalMooncake,
) -> None:
    s = MooncakeStore.open(load_mooncake_config(own_cluster.extra_config(timeout_s=2.0)))
    try:
        src, src_bufs = _dense_kv(4)
        dst, dst_bufs = _dense_kv(4)
        _fill(src, 7)
        dst.view(torch.uint8).fill_(0x5A)
        s.register([_mv(src), _mv(dst)])
        keys = _keys("kv", 4)
        assert s.put(keys, src_bufs) == [StoreStatus.OK] * 4

        own_cluster.kill_node()
        start = time.monotonic()
        got = s.get(keys, dst_bufs, deadline=start + 2.0)
        elapsed = time.monotonic() - start

        assert all(st in (StoreStatus.MISS, StoreStatus.TRANSIENT) for st in got), got
        assert elapsed < 2.5
        assert bool((dst.view(torch.uint8) == 0x5A).all())
        assert not any(s.get(keys, dst_bufs)[i].ok for i in range(4))
    finally:
        s.close()


def test_a_dead_master_fails_setup_within_the_deadline_naming_its_address(
    own_cluster: LocalMooncake,
) -> None:
    own_cluster.kill_master()
    config = load_mooncake_config(own_cluster.extra_config(setup_timeout_s=2.0))
    start = time.monotonic()
    with pytest.raises(StoreError, match=re.escape(own_cluster.master_address)):
        MooncakeStore.open(config)
    assert time.monotonic() - start < 2.5


def test_a_master_lost_after_setup_gives_non_ok_within_the_deadline(
    own_cluster: LocalMooncake,
) -> None:
    s = MooncakeStore.open(load_mooncake_config(own_cluster.extra_config(timeout_s=2.0)))
    try:
        src, bufs = _latent(2)
        _fill(src, 8)
        s.register([_mv(src)])
        keys = _keys("latent", 2)
        assert s.put(keys, bufs) == [StoreStatus.OK] * 2
        own_cluster.kill_master()
        start = time.monotonic()
        got = s.get(keys, bufs, deadline=start + 2.0)
        put = s.put(_keys("other", 1), bufs[:1], deadline=start + 4.0)
        assert time.monotonic() - start < 4.5
        assert not any(st.ok for st in got + put)
    finally:
        s.close()


def test_the_local_cluster_stops_every_process_by_pid() -> None:
    with local_mooncake(segment_bytes=16 << 20) as c:
        pids = c.pids
        assert len(pids) == 2
        assert all(os.path.exists(f"/proc/{p}") for p in pids)
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_a_store_without_a_named_master_starts_a_local_cluster_and_stops_it_afterwards() -> None:
    with mooncake_store({"timeout_s": 3}, environ={}, segment_bytes=16 << 20) as (s, cluster):
        assert cluster is not None
        pids = cluster.pids
        assert s.config.timeout_s == 3.0
        assert s.config.master_server_address == cluster.master_address
        src, bufs = _latent(2)
        _fill(src, 9)
        s.register([_mv(src)])
        assert s.put(_keys("latent", 2), bufs) == [StoreStatus.OK] * 2
    assert s.health().detail == "closed"
    assert not any(os.path.exists(f"/proc/{p}") for p in pids)


def test_a_store_with_a_named_master_starts_nothing(cluster: LocalMooncake) -> None:
    env = {
        "MOONCAKE_MASTER": cluster.master_address,
        "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
    }
    with mooncake_store(None, env, provide_host_memory=False) as (s, started):
        assert started is None
        assert s.config.master_server_address == cluster.master_address
        assert s.health().healthy
