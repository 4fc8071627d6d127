"""``"store": "mooncake"``: the backend over a real local Mooncake master and storage node
(started for the test and stopped at close), zero-copy from SGLang's host pool memory, which
the backend registers with Mooncake when the pool is registered."""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.sglang.support import require_sglang
from tests.storage.mooncake_support import require_mooncake

require_sglang()
require_mooncake()

from hicache.integrations.sglang import HiCacheBackend  # noqa: E402
from tests.integrations.sglang.conftest import extra, storage_config  # noqa: E402
from tests.integrations.sglang.pools import fill_page, keys, mha_pool, page_bytes, tokens  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.mooncake]


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_pages_round_trip_through_mooncake_zero_copy(layout: str) -> None:
    pool: Any = mha_pool(layout)
    backend = HiCacheBackend(storage_config(extra(None, store="mooncake")), {})
    try:
        backend.register_mem_pool_host(pool)
        ps = pool.page_size
        written = [fill_page(pool, i * ps, i) for i in range(3)]
        k = keys(3)
        assert backend.batch_set_v1(k, tokens(pool, 0, 3)) == [True] * 3
        assert backend.batch_exists(k) == 3
        assert backend.batch_get_v1(k, tokens(pool, 10, 3)) == [True] * 3
        assert [page_bytes(pool, (10 + i) * ps) for i in range(3)] == written
        # SGLang's legacy flat pages lie outside registered memory: refused per page, a miss.
        got = backend.batch_get(k[:1], [pool.get_dummy_flat_data_page()])
        assert got == [None]
        assert backend.statistics()["pools"]["kv"]["tier"]["statuses"] == {"invalid": 1}
    finally:
        backend.close()


def test_mooncake_without_interface_v1_or_with_a_staged_pool_is_refused_at_start() -> None:
    from hicache.domain.errors import ConfigError
    from tests.integrations.sglang.pools import minimax_index_pool

    with pytest.raises(ConfigError, match="interface_v1"):
        HiCacheBackend(storage_config(extra(None, store="mooncake", interface_v1=0)), {})
    kv = mha_pool("layer_first")
    backend = HiCacheBackend(storage_config(extra(None, store="mooncake")), {})
    try:
        backend.register_mem_pool_host(kv)
        with pytest.raises(ConfigError, match="no zero-copy segments"):
            backend.register_mem_host_pool_v2(minimax_index_pool(kv, "layer_first"), "indexer")
    finally:
        backend.close()
