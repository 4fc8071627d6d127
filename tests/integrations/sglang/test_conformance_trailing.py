"""SGLang's CPU unit test of hybrid-prefix queries (TRAILING_PAGES endpoints, ALL_PAGES
boundaries), run against hicache's backend in place of ``HiCacheFile``.

Source: the test module "CPU coverage for hybrid-prefix queries in the HiCache file backend"
(``register_cpu_ci(est_time=1, suite="base-a-test-cpu")``, functions
``test_trailing_pools_use_common_valid_endpoint``, ``test_empty_kv_prefix_is_not_restorable``,
``test_all_pages_boundary_intersects_trailing_endpoints``), read through the search tool's code
index, which holds its text but not its path; it builds HiCacheFile with a
``_get_component_path`` helper that sglang 0.5.23 does not have, so it is from a later tree. Its
calls (``batch_exists_v2``, ``PoolTransfer``, ``PoolHitPolicy``, ``PoolTransferResult``) are
those of the installed 0.5.23. Every scenario and expected value is SGLang's.

What was adapted, and why:
- The backend: SGLang builds a bare ``HiCacheFile`` (``__new__``, a temp directory) and marks a
  page present by touching its file. hicache stores checksummed objects under hashed names, so
  each present page of each pool is written through ``batch_set_v2`` from a real SGLang host pool
  registered under that pool's name (KV and SWA: MHA pools; Mamba: SGLang's Mamba pool; indexer:
  SGLang's MiniMax index-K pool), as an engine makes it present.
- SGLang's keys ``p1``..``p3`` are kept (hicache hashes keys that are not 64-hex digests).
- pytest's parametrize is kept; the temp directory is the ``make_backend`` fixture's.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from tests.integrations.sglang.pools import (  # noqa: E402
    mamba_pool,
    mha_pool,
    minimax_index_pool,
    tokens,
)

pytestmark = pytest.mark.sglang

KEYS = ["p1", "p2", "p3"]


def query(
    make_backend: Any,
    kv_pages: set[int],
    pools: list[tuple[PoolName, set[int], PoolHitPolicy]],
) -> Any:
    kv = mha_pool("page_first")
    side = {
        "swa": mha_pool("page_first"),
        "mamba": mamba_pool(),
        "indexer": minimax_index_pool(kv, "page_first"),
    }
    backend = make_backend(kv, side)
    for name, pages in [(PoolName.KV, kv_pages)] + [(n, p) for n, p, _ in pools]:
        host = kv if name == PoolName.KV else side[name.value]
        present = [KEYS[p - 1] for p in sorted(pages)]
        if present:
            written = backend.batch_set_v2(
                [
                    PoolTransfer(
                        name=name.value, keys=present, host_indices=tokens(host, 0, len(present))
                    )
                ]
            )
            assert written == {name.value: [True] * len(present)}
    transfers = [
        PoolTransfer(name=name, keys=[KEYS[-1]], hit_policy=policy) for name, _, policy in pools
    ]
    return backend.batch_exists_v2(KEYS, transfers)


@pytest.mark.parametrize(
    ("swa_pages", "mamba_pages", "expected", "restorable"),
    [
        ({3}, {3}, 3, [3]),
        ({3}, {2}, 0, []),
        ({1, 3}, {1, 2}, 1, [1]),
    ],
)
def test_trailing_pools_use_common_valid_endpoint(
    make_backend: Any,
    swa_pages: set[int],
    mamba_pages: set[int],
    expected: int,
    restorable: list[int],
) -> None:
    result = query(
        make_backend,
        {1, 2, 3},
        [
            (PoolName.SWA, swa_pages, PoolHitPolicy.TRAILING_PAGES),
            (PoolName.MAMBA, mamba_pages, PoolHitPolicy.TRAILING_PAGES),
        ],
    )
    assert result.kv_hit_pages == expected
    assert result.restorable_prefix_pages == restorable


def test_empty_kv_prefix_is_not_restorable(make_backend: Any) -> None:
    result = query(make_backend, set(), [(PoolName.SWA, {1, 2, 3}, PoolHitPolicy.TRAILING_PAGES)])
    assert result.kv_hit_pages == 0
    assert result.extra_pool_hit_pages == {}
    assert result.restorable_prefix_pages == []


@pytest.mark.parametrize(
    ("trailing_pages", "expected", "restorable"),
    [
        ({3}, 0, []),
        ({1, 2, 3}, 2, [1, 2]),
    ],
)
def test_all_pages_boundary_intersects_trailing_endpoints(
    make_backend: Any, trailing_pages: set[int], expected: int, restorable: list[int]
) -> None:
    result = query(
        make_backend,
        {1, 2, 3},
        [
            (PoolName.INDEXER, {1, 2}, PoolHitPolicy.ALL_PAGES),
            (PoolName.SWA, trailing_pages, PoolHitPolicy.TRAILING_PAGES),
        ],
    )
    assert result.kv_hit_pages == expected
    assert result.restorable_prefix_pages == restorable
