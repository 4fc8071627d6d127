"""Creation through SGLang's own factory, the extra config's keys, and the namespace rules.

A changed model, dtype, layout, page size or rank is another namespace, so a miss, never wrong
bytes; rank-replicated pools (SGLang's ``is_mla_model``) are shared by every tp rank and written
by the writer rank only; Mamba state stays per rank; SGLang's namespace seed starts another
key chain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integrations.sglang.support import require_sglang

require_sglang()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorage,
    HiCacheStorageFailureInjector,
    PoolTransfer,
)
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from hicache.domain.errors import ConfigError  # noqa: E402
from hicache.integrations.sglang import HiCacheBackend  # noqa: E402
from hicache.integrations.sglang.settings import SGLANG_KEYS  # noqa: E402
from tests.integrations.sglang.conftest import extra, storage_config  # noqa: E402
from tests.integrations.sglang.pools import (  # noqa: E402
    fill_page,
    keys,
    mamba_pool,
    mha_pool,
    mla_pool,
    page_bytes,
    tokens,
)

pytestmark = pytest.mark.sglang


def test_sglangs_factory_builds_the_backend_from_the_documented_extra_config(
    tmp_path: Path,
) -> None:
    pool = mha_pool("page_first")
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra(tmp_path)), pool)
    try:
        assert isinstance(backend, HiCacheBackend)
        assert isinstance(backend, HiCacheStorage)
        assert backend.interface_v1
        backend.register_mem_pool_host(pool)
        assert backend.store.name.startswith("directory")
    finally:
        backend.close()
    backend.close()  # idempotent


def test_sglangs_fault_injector_wraps_the_backend_when_its_variable_is_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "1.0")
    pool = mha_pool("page_first")
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra(tmp_path)), pool)
    try:
        assert isinstance(backend, HiCacheStorageFailureInjector)
        backend.register_mem_pool_host(pool)
        fill_page(pool, 0, 1)
        # Every call fails before reaching hicache: a backup fails, a query misses.
        assert backend.batch_set_v1(keys(1), tokens(pool, 0, 1)) == [False]
        assert backend.batch_exists(keys(1)) == 0
        assert backend._backend.statistics()["pools"]["kv"]["tier"]["pages_written_ok"] == 0
    finally:
        backend.close()


@pytest.mark.parametrize(
    ("more", "named"),
    [
        ({"capacity_bytes": -1}, "capacity_bytes"),
        ({"no_such_key": 1}, "no_such_key"),
        ({"deadline_s": 0}, "deadline_s"),
        ({"breaker_threshold": "5"}, "breaker_threshold"),
        ({"store": ""}, "store"),
        ({"root": "/tmp/x"}, "root"),
        ({"store": "mooncake", "store_path": "/tmp/x"}, "store_path"),
        ({"store": "mooncake", "bogus_mooncake_key": 1}, "bogus_mooncake_key"),
        ({"checksum": "md5"}, "md5"),
    ],
)
def test_a_bad_or_unknown_key_fails_the_start_with_one_error_naming_it(
    tmp_path: Path, more: dict[str, Any], named: str
) -> None:
    config = extra(None if more.get("store") == "mooncake" else tmp_path)
    config.update(more)
    with pytest.raises(ConfigError, match=named):
        StorageBackendFactory.create_backend(
            "dynamic", storage_config(config), mha_pool("page_first")
        )


def test_sglangs_own_keys_are_accepted_and_change_nothing(make_backend: Any) -> None:
    """Every key SGLang reads from the same extra config (SGLANG_KEYS) starts the backend and is
    kept from the store (the directory store refuses unknown keys): pages round-trip exactly as
    without them."""
    own = {
        "allocator": "shm",
        "tp_lcm_size": 2,
        "prefetch_threshold": 256,
        "prefetch_timeout_base": 1,
        "prefetch_timeout_per_ki_token": 0.25,
        "prefetch_timeout_max": 30,
        "hicache_storage_pass_prefix_keys": True,
    }
    assert set(own) | set(extra(None)) - {"store"} >= SGLANG_KEYS  # every one of them
    pool = mha_pool("page_first")
    backend = make_backend(pool, config=own)
    written = [fill_page(pool, 0, 1), fill_page(pool, pool.page_size, 2)]
    assert backend.batch_set_v1(keys(2), tokens(pool, 0, 2)) == [True, True]
    assert backend.batch_get_v1(keys(2), tokens(pool, 4, 2)) == [True, True]
    assert [page_bytes(pool, p * pool.page_size) for p in (4, 5)] == written


def _roundtrip_hits(
    make_backend: Any, writer: dict[str, Any], reader: dict[str, Any]
) -> list[bool]:
    """Write 2 pages with one backend setting, read them with another (same store)."""
    wpool = writer.pop("pool")
    rpool = reader.pop("pool")
    w = make_backend(wpool, **writer)
    fill_page(wpool, 0, 1)
    fill_page(wpool, wpool.page_size, 2)
    assert w.batch_set_v1(keys(2), tokens(wpool, 0, 2)) == [True, True]
    r = make_backend(rpool, **reader)
    return list(r.batch_get_v1(keys(2), tokens(rpool, 4, 2)))


@pytest.mark.parametrize(
    "change",
    [
        {"pool": "dtype"},
        {"pool": "layout"},
        {"pool": "page_size"},
        {"model_name": "org/other-model"},
        {"tp_rank": 1, "tp_size": 2},
        {"pp_rank": 1, "pp_size": 2},
    ],
)
def test_a_changed_setting_is_a_miss_never_wrong_bytes(
    make_backend: Any, change: dict[str, Any]
) -> None:
    pools = {
        "dtype": lambda: mha_pool("page_first", dtype=torch.float16),
        "layout": lambda: mha_pool("page_first_direct"),
        "page_size": lambda: mha_pool("page_first", page_size=8, head_dim=4),
    }
    reader: dict[str, Any] = {k: v for k, v in change.items() if k != "pool"}
    reader["pool"] = pools[change["pool"]]() if "pool" in change else mha_pool("page_first")
    hits = _roundtrip_hits(make_backend, {"pool": mha_pool("page_first")}, reader)
    assert hits == [False, False]


def test_the_same_settings_hit_from_another_backend(make_backend: Any) -> None:
    hits = _roundtrip_hits(
        make_backend, {"pool": mha_pool("page_first")}, {"pool": mha_pool("page_first")}
    )
    assert hits == [True, True]


def test_rank_replicated_kv_is_shared_by_tp_ranks_and_mha_kv_is_not(make_backend: Any) -> None:
    mla = _roundtrip_hits(
        make_backend,
        {"pool": mla_pool("page_first"), "is_mla_model": True, "tp_rank": 0, "tp_size": 2},
        {"pool": mla_pool("page_first"), "is_mla_model": True, "tp_rank": 1, "tp_size": 2},
    )
    assert mla == [True, True]
    mha = _roundtrip_hits(
        make_backend,
        {"pool": mha_pool("page_first"), "tp_rank": 0, "tp_size": 2},
        {"pool": mha_pool("page_first"), "tp_rank": 1, "tp_size": 2},
    )
    assert mha == [False, False]


def test_only_the_writer_rank_stores_rank_replicated_pages(make_backend: Any) -> None:
    pool = mla_pool("page_first")
    backend = make_backend(pool, is_mla_model=True, tp_rank=1, tp_size=2)
    assert not backend.storage_config.is_storage_writer
    fill_page(pool, 0, 1)
    # Acknowledged (SGLang's writer rank stores the same bytes), but nothing is written.
    assert backend.batch_set_v1(keys(1), tokens(pool, 0, 1)) == [True]
    assert backend.statistics()["skipped_non_writer"] == 1
    assert backend.statistics()["pools"]["kv"]["tier"]["pages_written_ok"] == 0
    assert backend.batch_exists(keys(1)) == 0


def test_mamba_state_stays_per_rank_under_a_rank_replicated_model(make_backend: Any) -> None:
    kv0, m0 = mla_pool("page_first"), mamba_pool()
    kv1, m1 = mla_pool("page_first"), mamba_pool()
    b0 = make_backend(kv0, {"mamba": m0}, is_mla_model=True, tp_rank=0, tp_size=2)
    b1 = make_backend(kv1, {"mamba": m1}, is_mla_model=True, tp_rank=1, tp_size=2)
    assert b0.statistics()["pools"]["mamba"]["replicated"] is False
    assert b0.statistics()["pools"]["kv"]["replicated"] is True
    fill_page(kv0, 0, 1)
    fill_page(m0, 0, 2)
    k = keys(1)
    b0.batch_set_v2(
        [
            PoolTransfer(name="kv", keys=k, host_indices=tokens(kv0, 0, 1)),
            PoolTransfer(name="mamba", keys=k, host_indices=tokens(m0, 0, 1)),
        ]
    )
    got = b1.batch_get_v2(
        [
            PoolTransfer(name="kv", keys=k, host_indices=tokens(kv1, 3, 1)),
            PoolTransfer(name="mamba", keys=k, host_indices=tokens(m1, 3, 1)),
        ]
    )
    assert got == {"kv": [True], "mamba": [False]}
    assert page_bytes(kv1, 3 * kv1.page_size) == page_bytes(kv0, 0)


def test_a_page_written_under_one_namespace_seed_hits_only_under_that_seed(
    make_backend: Any,
) -> None:
    """SGLang seeds a request's key chain with its namespace (extra_key, cache_salt): the
    backend keeps SGLang's keys as given, so a tenant's pages are found under its own seed and
    never under another's or none (a backend keyed by the tokens alone would serve them to
    every tenant)."""
    from sglang.srt.mem_cache.utils import get_hash_str, storage_namespace_seed

    wpool, rpool = mha_pool("page_first"), mha_pool("page_first")
    ps = wpool.page_size
    token_ids = list(range(ps * 2))

    def chain(tenant: str | None) -> list[str]:
        seed = storage_namespace_seed(tenant, None) if tenant is not None else None
        return list(get_hash_str(token_ids, seed, page_size=ps))

    writer = make_backend(wpool)
    written = [fill_page(wpool, 0, 1), fill_page(wpool, ps, 2)]
    assert writer.batch_set_v1(chain("tenant-a"), tokens(wpool, 0, 2)) == [True, True]
    reader = make_backend(rpool)  # another process over the same store
    assert reader.batch_exists(chain("tenant-b")) == 0
    assert reader.batch_get_v1(chain("tenant-b"), tokens(rpool, 0, 2)) == [False, False]
    assert reader.batch_exists(chain(None)) == 0
    assert reader.batch_exists(chain("tenant-a")) == 2
    assert reader.batch_get_v1(chain("tenant-a"), tokens(rpool, 4, 2)) == [True, True]
    assert [page_bytes(rpool, p * ps) for p in (4, 5)] == written
