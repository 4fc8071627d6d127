"""Layouts: host buffer shapes of every pool kind; unusable combinations say which and why."""

from __future__ import annotations

import pytest

from hicache.domain import (
    DType,
    IndexerGeometry,
    KVGeometry,
    Layout,
    LayoutError,
    MLAGeometry,
    check_layout,
    gated_deltanet_state,
    host_buffer_shape,
    mamba2_state,
)

L, N, P = 4, 256, 64  # pool layers, capacity in units, page size

KV = KVGeometry(kv_heads=8, head_dim=128, v_head_dim=64)
MLA = MLAGeometry(kv_lora_rank=512, qk_rope_head_dim=64)
PLAIN_INDEXER = IndexerGeometry(heads=4, head_dim=128)
FP8_INDEXER = IndexerGeometry(heads=1, head_dim=128, dtype=DType.FP8_E4M3, scale_block=128)
MAMBA = mamba2_state(heads=8, head_dim=64, state_size=16, n_groups=1, conv_kernel=4)
GDN = gated_deltanet_state(key_heads=2, value_heads=4, key_dim=32, value_dim=32, conv_kernel=4)


def shapes(layout: Layout, geometry: object, capacity: int = N, page: int = P) -> dict[str, tuple]:
    return {
        b.name: host_buffer_shape(layout, b, layers=L, capacity=capacity, page_size=page)
        for b in geometry.buffers  # type: ignore[attr-defined]
    }


def test_parse_accepts_names_and_rejects_others_listing_the_choices() -> None:
    assert Layout.parse("page_first_direct") is Layout.PAGE_FIRST_DIRECT
    assert Layout.parse(" PAGE_HEAD ") is Layout.PAGE_HEAD
    assert Layout.parse(Layout.LAYER_FIRST) is Layout.LAYER_FIRST
    with pytest.raises(LayoutError, match=r"unknown layout 'page_last'.*layer_first, page_first"):
        Layout.parse("page_last")


def test_mha_shapes_in_every_layout() -> None:
    assert shapes(Layout.LAYER_FIRST, KV) == {"k": (L, N, 8, 128), "v": (L, N, 8, 64)}
    assert shapes(Layout.PAGE_FIRST, KV) == {"k": (N, L, 8, 128), "v": (N, L, 8, 64)}
    assert shapes(Layout.PAGE_FIRST_DIRECT, KV) == {
        "k": (N // P, L, P, 8, 128),
        "v": (N // P, L, P, 8, 64),
    }
    assert shapes(Layout.PAGE_HEAD, KV) == {
        "k": (N // P, 8, P, L, 128),
        "v": (N // P, 8, P, L, 64),
    }


def test_mla_shapes() -> None:
    assert shapes(Layout.LAYER_FIRST, MLA) == {"kv": (L, N, 576)}
    assert shapes(Layout.PAGE_FIRST, MLA) == {"kv": (N, L, 576)}
    assert shapes(Layout.PAGE_FIRST_DIRECT, MLA) == {"kv": (N // P, L, P, 576)}


def test_indexer_shapes_plain_and_fp8() -> None:
    assert shapes(Layout.PAGE_FIRST, PLAIN_INDEXER) == {"k": (N, L, 4, 128)}
    assert shapes(Layout.PAGE_HEAD, PLAIN_INDEXER) == {"k": (N // P, 4, P, L, 128)}
    # fp8 values and their scale are packed as 128 + 4 bytes per head
    assert shapes(Layout.PAGE_FIRST_DIRECT, FP8_INDEXER) == {"k": (N // P, L, P, 1, 132)}


def test_state_shapes_one_slot_per_page() -> None:
    conv_dim = 8 * 64 + 2 * 1 * 16
    assert shapes(Layout.PAGE_FIRST, MAMBA, capacity=10, page=1) == {
        "conv": (10, L, conv_dim, 3),
        "temporal": (10, L, 8, 64, 16),
    }
    assert shapes(Layout.PAGE_FIRST_DIRECT, GDN, capacity=10, page=1) == {
        "conv": (10, L, 1, 2 * 2 * 32 + 4 * 32, 3),
        "temporal": (10, L, 1, 4, 32, 32),
    }


def test_shape_needs_whole_pages() -> None:
    with pytest.raises(LayoutError, match="capacity 100 is not a whole number of pages of 64"):
        host_buffer_shape(Layout.PAGE_FIRST, KV.buffers[0], layers=L, capacity=100, page_size=P)


@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT])
@pytest.mark.parametrize("state", [MAMBA, GDN])
def test_state_pools_take_the_page_first_family(layout: Layout, state: object) -> None:
    check_layout(layout, state, pool="mamba")  # type: ignore[arg-type]


@pytest.mark.parametrize("layout", [Layout.LAYER_FIRST, Layout.PAGE_HEAD])
def test_state_pools_reject_other_layouts_saying_which_and_why(layout: Layout) -> None:
    with pytest.raises(LayoutError) as info:
        check_layout(layout, MAMBA, pool="mamba")
    msg = str(info.value)
    assert "'mamba'" in msg
    assert repr(layout.value) in msg
    assert "recurrent state" in msg
    assert "page_first" in msg


def test_page_head_rejects_buffers_without_a_head_axis() -> None:
    with pytest.raises(LayoutError, match=r"pool 'kv' \(mla\) has buffers \['kv'\] without a head"):
        check_layout(Layout.PAGE_HEAD, MLA, pool="kv")
    with pytest.raises(LayoutError, match="'kv' has no head axis"):
        host_buffer_shape(Layout.PAGE_HEAD, MLA.buffers[0], layers=L, capacity=N, page_size=P)


@pytest.mark.parametrize("geometry", [KV, PLAIN_INDEXER, FP8_INDEXER])
def test_page_head_takes_buffers_with_a_head_axis(geometry: object) -> None:
    check_layout(Layout.PAGE_HEAD, geometry, pool="kv")  # type: ignore[arg-type]


def test_layer_first_is_rejected_with_mooncake_storage() -> None:
    with pytest.raises(LayoutError) as info:
        check_layout(Layout.LAYER_FIRST, KV, pool="kv", storage_backend="mooncake")
    msg = str(info.value)
    assert "'mooncake'" in msg
    assert "'layer_first'" in msg
    assert "whole pages" in msg


def test_layer_first_is_fine_without_a_page_object_store() -> None:
    check_layout(Layout.LAYER_FIRST, KV, pool="kv")
    check_layout(Layout.LAYER_FIRST, KV, pool="kv", storage_backend="file")
    for layout in (Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT, Layout.PAGE_HEAD):
        check_layout(layout, KV, pool="kv", storage_backend="mooncake")


def test_only_layer_first_scatters_pages() -> None:
    assert [lay for lay in Layout if not lay.page_objects] == [Layout.LAYER_FIRST]
