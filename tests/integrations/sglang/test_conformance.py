"""SGLang's own storage-backend unit test of hybrid prefix intersection, run against hicache's
backend in place of ``HiCacheFile``.

Source: SGLang's CPU-CI unit test ``TestHiCacheFilePrefix`` ("CPU coverage for file-backend
hybrid prefix intersection", under test/registered/unit/mem_cache/ of sgl-project/sglang,
registered with ``register_cpu_ci(suite="base-a-test-cpu")``), read from the stored copy of the
repository (the full clone at the v0.5.23 tag was too large to fetch here; its API --
PoolHitPolicy, PoolTransfer, PoolTransferResult.restorable_prefix_pages -- is the one the installed
sglang 0.5.23 has). Every scenario and expected value is SGLang's.

What was adapted, and why:
- The backend: SGLang builds a bare ``HiCacheFile`` (``__new__``, a temp directory, a fixed
  suffix) and marks pages present by touching its files. hicache's files are checksummed objects
  under hashed names, so presence is made the way an engine makes it: each present page of each
  pool is written through ``batch_set_v2`` from a real SGLang host pool registered under that
  pool's name (KV: MHA; SWA: a second MHA pool; Mamba: SGLang's Mamba pool; indexer: SGLang's
  MiniMax index-K pool).
- The metadata-cache loop (``metadata_enabled`` in SGLang's test) is HiCacheFile's own cache;
  hicache has none, so that loop is gone. The reversed order of the transfers and the second
  (warm) query are kept.
- The keys ``page1``..``pageN`` are SGLang's; hicache hashes keys that are not 64-hex digests.
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


def check_prefix(
    make_backend: Any,
    kv_pages: set[int],
    pools: list[tuple[PoolName, set[int], PoolHitPolicy, int]],
    expected: list[int],
    num_pages: int = 3,
) -> None:
    kv = mha_pool("page_first")
    side = {
        "swa": mha_pool("page_first"),
        "mamba": mamba_pool(),
        "indexer": minimax_index_pool(kv, "page_first"),
    }
    backend = make_backend(kv, side)
    page_keys = [f"page{i}" for i in range(1, num_pages + 1)]
    for name, pages in [(PoolName.KV, kv_pages)] + [(n, p) for n, p, _, _ in pools]:
        host = kv if name == PoolName.KV else side[name.value]
        for page in pages:
            written = backend.batch_set_v2(
                [
                    PoolTransfer(
                        name=name.value,
                        keys=[page_keys[page - 1]],
                        host_indices=tokens(host, page, 1),
                    )
                ]
            )
            assert written == {name.value: [True]}
    for reverse in (False, True):
        transfers = [
            PoolTransfer(name=name, keys=page_keys[-window:], hit_policy=policy)
            for name, _, policy, window in pools
        ]
        if reverse:
            transfers.reverse()
        for _ in range(2):  # the second query is SGLang's warm query
            result = backend.batch_exists_v2(page_keys, transfers)
            assert result.kv_hit_pages == max(expected, default=0), reverse
            assert result.restorable_prefix_pages == expected, reverse


def test_aligned_checkpoints(make_backend: Any) -> None:
    check_prefix(
        make_backend,
        {1, 2, 3},
        [
            (PoolName.SWA, {3}, PoolHitPolicy.TRAILING_PAGES, 1),
            (PoolName.MAMBA, {3}, PoolHitPolicy.TRAILING_PAGES, 1),
        ],
        [3],
    )


def test_disjoint_checkpoints(make_backend: Any) -> None:
    check_prefix(
        make_backend,
        {1, 2, 3},
        [
            (PoolName.SWA, {3}, PoolHitPolicy.TRAILING_PAGES, 1),
            (PoolName.MAMBA, {2}, PoolHitPolicy.TRAILING_PAGES, 1),
        ],
        [],
    )


def test_preserves_non_contiguous_stop_points(make_backend: Any) -> None:
    check_prefix(
        make_backend,
        {1, 2, 3},
        [(PoolName.MAMBA, {1, 3}, PoolHitPolicy.TRAILING_PAGES, 1)],
        [1, 3],
    )


def test_earlier_common_checkpoint(make_backend: Any) -> None:
    check_prefix(
        make_backend,
        {1, 2, 3},
        [
            (PoolName.SWA, {1, 3}, PoolHitPolicy.TRAILING_PAGES, 1),
            (PoolName.MAMBA, {1, 2}, PoolHitPolicy.TRAILING_PAGES, 1),
        ],
        [1],
    )


def test_all_pages_truncates_trailing_pool(make_backend: Any) -> None:
    check_prefix(
        make_backend,
        {1, 2, 3},
        [
            (PoolName.INDEXER, {1, 2}, PoolHitPolicy.ALL_PAGES, 3),
            (PoolName.MAMBA, {1, 3}, PoolHitPolicy.TRAILING_PAGES, 1),
        ],
        [1],
    )


def test_multi_page_window_with_holes(make_backend: Any) -> None:
    check_prefix(
        make_backend,
        {1, 2, 3, 4, 5},
        [
            (PoolName.SWA, {1, 2, 4, 5}, PoolHitPolicy.TRAILING_PAGES, 2),
            (PoolName.MAMBA, {2, 4}, PoolHitPolicy.TRAILING_PAGES, 1),
        ],
        [2],
        num_pages=5,
    )


def test_prefix_shorter_than_window(make_backend: Any) -> None:
    check_prefix(
        make_backend,
        {1, 2},
        [(PoolName.SWA, {1, 2}, PoolHitPolicy.TRAILING_PAGES, 3)],
        [1, 2],
    )


def test_kv_hole_limits_auxiliary_hits(make_backend: Any) -> None:
    check_prefix(
        make_backend,
        {1, 3},
        [(PoolName.MAMBA, {3}, PoolHitPolicy.TRAILING_PAGES, 1)],
        [],
    )


@pytest.mark.parametrize(
    ("kv_pages", "num_pages", "expected"), [({1, 3}, 3, [1]), (set(), 3, []), (set(), 0, [])]
)
def test_kv_only_and_empty(
    make_backend: Any, kv_pages: set[int], num_pages: int, expected: list[int]
) -> None:
    check_prefix(make_backend, kv_pages, [], expected, num_pages=num_pages)
