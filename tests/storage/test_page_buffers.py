"""Host pool pages as PageBuffers: segments per layout, byte-exact put from one pool, get into another."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hicache.adapters.host_pool import materialise_host_group
from hicache.adapters.storage import (
    DirectorySettings,
    DirectoryStore,
    HostGroupBuffers,
    page_buffer,
)
from hicache.domain import DType, ForeignIndexError, HostMemoryError, Layout
from hicache.domain.storage import StoreStatus, buffer_nbytes
from tests.adapters.pool_plans import fill_random, group_plan, page_bytes, valid
from tests.storage.conftest import key

KINDS = ["mha", "mla", "indexer", "indexer_fp8", "state"]
CASES = [(k, lay) for k in KINDS for lay in Layout if valid(k, lay)]


@pytest.mark.parametrize(("kind", "layout"), CASES, ids=[f"{k}-{lay.value}" for k, lay in CASES])
def test_a_page_put_from_one_host_pool_comes_back_byte_exact_in_another(
    tmp_path: Path, kind: str, layout: Layout
) -> None:
    plan, name = group_plan(kind, layout, DType.BF16 if kind != "indexer_fp8" else DType.FP8_E4M3)
    store = DirectoryStore(DirectorySettings(root=tmp_path))
    with materialise_host_group(plan) as src, materialise_host_group(plan) as dst:
        a, b = src.pool(name), dst.pool(name)
        fill_random(a, 1)
        fill_random(b, 2)
        seg = page_buffer(a, 3)
        assert buffer_nbytes(seg) == a.plan.bytes_per_page
        assert all(s.format == "B" and s.ndim == 1 and not s.readonly for s in seg)
        per_buffer = a.layers if layout is Layout.LAYER_FIRST else 1
        assert len(seg) == len(a.buffers) * per_buffer
        assert store.put([key(3)], [seg]) == [StoreStatus.OK]
        before_other_pages = [page_bytes(b, p) for p in (4, 6)]
        assert store.get([key(3)], [page_buffer(b, 5)]) == [StoreStatus.OK]
        assert page_bytes(b, 5) == page_bytes(a, 3)
        assert [page_bytes(b, p) for p in (4, 6)] == before_other_pages  # nothing spilled
    store.close()


def test_segments_share_the_pools_memory(tmp_path: Path) -> None:
    plan, name = group_plan("mha", Layout.LAYER_FIRST)
    with materialise_host_group(plan) as group:
        pool = group.pool(name)
        seg = page_buffer(pool, 1)
        seg[0][:] = b"\xff" * seg[0].nbytes
        k = pool.buffer("k")
        first = k[0, pool.page_size : 2 * pool.page_size]
        assert bool((first.view(-1).view(torch.uint8) == 255).all())


@pytest.mark.parametrize("page", [-1, 8, True, "1"])
def test_a_page_outside_the_pool_is_a_foreign_index(page: object) -> None:
    plan, name = group_plan("mha", Layout.PAGE_FIRST)
    with materialise_host_group(plan) as group, pytest.raises(ForeignIndexError, match="page"):
        page_buffer(group.pool(name), page)  # type: ignore[arg-type]


def _addresses(segments: list[memoryview]) -> list[tuple[int, int]]:
    import ctypes

    return [(ctypes.addressof(ctypes.c_char.from_buffer(s)), s.nbytes) for s in segments]


@pytest.mark.parametrize(("kind", "layout"), CASES, ids=[f"{k}-{lay.value}" for k, lay in CASES])
def test_group_buffers_give_the_same_segments_as_page_buffer(kind: str, layout: Layout) -> None:
    """HostGroupBuffers works segments out from offsets computed once; they must be exactly the
    segments page_buffer takes from the tensors, for every pool kind and layout."""
    plan, name = group_plan(kind, layout, DType.BF16 if kind != "indexer_fp8" else DType.FP8_E4M3)
    with materialise_host_group(plan) as group:
        buffers = HostGroupBuffers(group)
        pool = group.pool(name)
        for page in range(pool.pages):
            got = buffers.buffer(name, page)
            assert all(s.format == "B" and s.ndim == 1 and not s.readonly for s in got)
            assert _addresses(got) == _addresses(page_buffer(pool, page))
        with pytest.raises(ForeignIndexError, match="page"):
            buffers.buffer(name, pool.pages)


def test_group_buffers_refuse_a_closed_pool() -> None:
    plan, name = group_plan("mha", Layout.PAGE_FIRST_DIRECT)
    group = materialise_host_group(plan)
    buffers = HostGroupBuffers(group)
    assert buffers.buffer(name, 0)
    group.close()
    with pytest.raises(HostMemoryError, match="is closed"):
        buffers.buffer(name, 0)
