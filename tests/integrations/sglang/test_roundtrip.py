"""Byte-exact round trips through SGLang's real host pools of every kind and layout.

v1 zero-copy (batch_set_v1 / batch_get_v1), legacy flat pages (batch_set / batch_get) and v2 side
pools (batch_set_v2 / batch_get_v2) move the same bytes: a page written by one path is read back
byte-exact by the others (one byte order per page: SGLang's flat page order).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.integrations.sglang.support import require_sglang

require_sglang()

from sglang.srt.mem_cache.hicache_storage import PoolTransfer  # noqa: E402

from tests.integrations.sglang.pools import (  # noqa: E402
    MHA_LAYOUTS,
    MLA_LAYOUTS,
    dsa_indexer_pool,
    fill_page,
    keys,
    mamba_pool,
    mha_pool,
    minimax_index_pool,
    minimax_k_only_pool,
    mla_pool,
    page_bytes,
    tokens,
)

pytestmark = pytest.mark.sglang

ANCHORS = [("mha", lay) for lay in MHA_LAYOUTS] + [("mla", lay) for lay in MLA_LAYOUTS]


def anchor(kind: str, layout: str) -> Any:
    return mha_pool(layout) if kind == "mha" else mla_pool(layout)


def fill(pool: Any, first: int, n: int, seed: int = 0) -> list[bytes]:
    ps = pool.page_size
    return [fill_page(pool, (first + i) * ps, seed + i) for i in range(n)]


def read(pool: Any, first: int, n: int) -> list[bytes]:
    ps = pool.page_size
    return [page_bytes(pool, (first + i) * ps) for i in range(n)]


@pytest.mark.parametrize(("kind", "layout"), ANCHORS)
def test_v1_pages_come_back_byte_exact_in_other_host_pages(
    make_backend: Any, kind: str, layout: str
) -> None:
    pool = anchor(kind, layout)
    backend = make_backend(pool, is_mla_model=kind == "mla")
    written = fill(pool, 2, 5)
    k = keys(5)
    assert backend.batch_set_v1(k, tokens(pool, 2, 5)) == [True] * 5
    assert backend.batch_exists(k) == 5
    assert backend.batch_get_v1(k, tokens(pool, 20, 5)) == [True] * 5
    assert read(pool, 20, 5) == written


@pytest.mark.parametrize(("kind", "layout"), ANCHORS)
def test_legacy_and_v1_paths_share_one_byte_order(
    make_backend: Any, kind: str, layout: str
) -> None:
    pool = anchor(kind, layout)
    backend = make_backend(pool, is_mla_model=kind == "mla")
    written = fill(pool, 1, 3)
    k = keys(3)
    # v1 write, legacy read into SGLang's dummy flat pages.
    assert backend.batch_set_v1(k, tokens(pool, 1, 3)) == [True] * 3
    got = backend.batch_get(k, [pool.get_dummy_flat_data_page() for _ in k])
    assert [
        bytes(t.view(-1).contiguous().view(__import__("torch").uint8).numpy()) for t in got
    ] == written
    # legacy write (SGLang's flat pages), v1 read into host pages.
    k2 = keys(3, salt="legacy")
    flat = [pool.get_data_page(i * pool.page_size, flat=True) for i in range(1, 4)]
    assert backend.batch_set(k2, flat) is True
    assert backend.batch_get_v1(k2, tokens(pool, 10, 3)) == [True] * 3
    assert read(pool, 10, 3) == written


def test_a_missing_page_ends_the_hit_at_a_leading_run(make_backend: Any) -> None:
    pool = mha_pool("page_first")
    backend = make_backend(pool)
    fill(pool, 0, 4)
    k = keys(4)
    assert backend.batch_set_v1([k[0], k[1], k[3]], tokens(pool, 0, 3)) == [True] * 3
    assert backend.batch_exists(k) == 2
    assert backend.batch_get_v1(k, tokens(pool, 8, 4)) == [True, True, False, False]
    got = backend.batch_get(k, [pool.get_dummy_flat_data_page() for _ in k])
    assert [g is not None for g in got] == [True, True, False, False]
    assert backend.exists(k[0])
    assert not backend.exists(k[2])


SIDES = [
    ("mamba", "page_first"),
    ("mamba", "page_first_direct"),
    ("indexer", "layer_first"),
    ("indexer", "page_first"),
    ("indexer", "page_first_direct"),
    ("minimax", "layer_first"),
    ("minimax", "page_first"),
    ("minimax", "page_first_direct"),
    ("minimax_k", "layer_first"),
    ("minimax_k", "page_first"),
]


def side_pools(kind: str, layout: str) -> tuple[Any, str, Any, bool]:
    """(anchor, side pool name, side pool, is_mla_model)."""
    if kind == "mamba":
        return mha_pool("page_first"), "mamba", mamba_pool(layout), False
    if kind == "indexer":
        kv = mla_pool(layout)
        return kv, "indexer", dsa_indexer_pool(kv), True
    kv = mha_pool(layout)
    if kind == "minimax_k":
        return kv, "indexer", minimax_k_only_pool(kv, layout), False
    return kv, "indexer", minimax_index_pool(kv, layout), False


@pytest.mark.parametrize(("kind", "layout"), SIDES)
def test_v2_side_pool_pages_come_back_byte_exact(make_backend: Any, kind: str, layout: str) -> None:
    kv, name, side, mla = side_pools(kind, layout)
    backend = make_backend(kv, {name: side}, is_mla_model=mla)
    kv_bytes = fill(kv, 1, 3)
    side_bytes = fill(side, 1, 3, seed=100)
    k = keys(3)
    result = backend.batch_set_v2(
        [
            PoolTransfer(name="kv", keys=k, host_indices=tokens(kv, 1, 3)),
            PoolTransfer(name=name, keys=k, host_indices=tokens(side, 1, 3)),
        ]
    )
    assert result == {"kv": [True] * 3, name: [True] * 3}
    got = backend.batch_get_v2(
        [
            PoolTransfer(name="kv", keys=k, host_indices=tokens(kv, 6, 3)),
            PoolTransfer(name=name, keys=k, host_indices=tokens(side, 6, 3)),
        ]
    )
    assert got == {"kv": [True] * 3, name: [True] * 3}
    assert read(kv, 6, 3) == kv_bytes
    assert read(side, 6, 3) == side_bytes
    stats = backend.statistics()["pools"][name]
    assert stats["tier"]["pages_read_ok"] == 3
    # layer_first side pools have no zero-copy meta in SGLang: they are staged, and say why.
    assert stats["zero_copy"] == (layout != "layer_first"), stats["copy_reason"]


def test_v2_indices_of_the_wrong_length_fail_that_pool_only(make_backend: Any) -> None:
    kv, name, side, _ = side_pools("mamba", "page_first")
    backend = make_backend(kv, {name: side})
    fill(kv, 0, 2)
    k = keys(2)
    result = backend.batch_set_v2(
        [
            PoolTransfer(name="kv", keys=k, host_indices=tokens(kv, 0, 2)),
            PoolTransfer(name=name, keys=k, host_indices=tokens(side, 0, 1)),
        ]
    )
    assert result == {"kv": [True, True], name: [False, False]}


def test_sglangs_zero_copy_order_differs_for_layer_first_and_the_backend_reorders_it() -> None:
    import ctypes

    from hicache.integrations.sglang.pages import PoolPages

    pool = mha_pool("layer_first")
    flat = fill_page(pool, 0, 7)
    ptrs, sizes = pool.get_page_buffer_meta(tokens(pool, 0, 1))
    raw = [ctypes.string_at(p, s) for p, s in zip(ptrs, sizes, strict=True)]
    # SGLang's two orders of one page: the same bytes, k0 v0 k1 v1 ... vs all K then all V.
    assert b"".join(raw) != flat
    assert sorted(raw) == sorted(flat[i : i + sizes[0]] for i in range(0, len(flat), sizes[0]))
    pages = PoolPages("kv", pool)
    assert pages.zero_copy
    assert b"".join(bytes(s) for s in pages.segments(0)) == flat


class _Untiled:
    """A real SGLang pool whose zero-copy meta misses one segment (the broken case)."""

    def __init__(self, pool: Any) -> None:
        self._pool = pool

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pool, name)

    def get_page_buffer_meta(self, indices: Any) -> Any:
        ptrs, sizes = self._pool.get_page_buffer_meta(indices)
        return ptrs[:-1], sizes[:-1]


def test_a_pool_whose_segments_do_not_tile_its_flat_page_is_staged_not_misread(
    make_backend: Any,
) -> None:
    pool = _Untiled(mha_pool("page_first"))
    backend = make_backend(pool)
    stats = backend.statistics()["pools"]["kv"]
    assert stats["zero_copy"] is False
    assert "do not tile" in stats["copy_reason"]
    written = fill(pool, 0, 2)
    k = keys(2)
    assert backend.batch_set_v1(k, tokens(pool, 0, 2)) == [True, True]
    assert backend.batch_get_v1(k, tokens(pool, 5, 2)) == [True, True]
    assert read(pool, 5, 2) == written


def test_sglangs_threads_calling_at_once_each_get_their_own_pages(make_backend: Any) -> None:
    """SGLang's prefetch and backup threads call the backend concurrently."""
    import threading

    pool = mha_pool("layer_first", ratio=4.0)
    backend = make_backend(pool)
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            src, dst = 2 * w * 3, (2 * w + 1) * 3
            written = fill(pool, src, 3, seed=10 * w)
            k = keys(3, salt=f"worker{w}")
            for _ in range(5):
                assert backend.batch_set_v1(k, tokens(pool, src, 3)) == [True] * 3
                assert backend.batch_get_v1(k, tokens(pool, dst, 3)) == [True] * 3
                assert read(pool, dst, 3) == written
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert backend.statistics()["pools"]["kv"]["tier"]["pages_read_ok"] == 4 * 5 * 3
