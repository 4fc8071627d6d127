"""The worker takes vLLM's attention caches in every KV cache layout vLLM 0.32 can resolve where
a block is one run of bytes (the views built by vLLM's own ``create_kv_cache_views``), and
refuses the layouts with heads outside the blocks."""

from __future__ import annotations

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from types import SimpleNamespace  # noqa: E402

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from hicache.domain import DeviceError  # noqa: E402
from hicache.domain.storage import StoreKey  # noqa: E402
from hicache.integrations.vllm.block_rows import (  # noqa: E402
    block_order,
    block_rows,
    manager_blocks,
    whole_pages,
)
from hicache.integrations.vllm.layout import Shape  # noqa: E402
from hicache.integrations.vllm.settings import ConnectorSettings  # noqa: E402
from hicache.integrations.vllm.stats import ConnectorStats  # noqa: E402
from hicache.integrations.vllm.tp_reads import LayerHeads, head_geometry  # noqa: E402
from hicache.integrations.vllm.worker_role import WorkerConnector  # noqa: E402

pytestmark = pytest.mark.vllm
BLOCKS, LAYERS, HEADS = 5, 3, 2
SPEC = FullAttentionSpec(block_size=16, num_kv_heads=HEADS, head_size=8, dtype=torch.float16)
PAGE = SPEC.page_size_bytes


def views(
    layout: KVCacheLayout, kernel_block_size: int | None = None
) -> tuple[torch.Tensor, list[torch.Tensor], int, int]:
    """vLLM's per-layer views over one buffer of distinct bytes, with the layer and block
    strides of ``layout`` (vllm/v1/kv_cache_interface.py, KVCacheTensor), the attention
    kernel's blocks ``kernel_block_size`` tokens where given."""
    if layout.is_layer_compact:
        layer_stride, block_stride = PAGE * BLOCKS, PAGE
    else:
        layer_stride, block_stride = PAGE, PAGE * LAYERS
    if layout is KVCacheLayout.LHBNC:
        block_stride = PAGE // HEADS
    if layout is KVCacheLayout.BHLNC:
        layer_stride = PAGE // HEADS
    tensor = KVCacheTensor(
        size=PAGE * BLOCKS * LAYERS,
        layers=[f"l{i}" for i in range(LAYERS)],
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    raw = (torch.arange(PAGE * BLOCKS * LAYERS, dtype=torch.int64) * 7 % 251).to(torch.int8)
    per_layer = create_kv_cache_views(raw, SPEC, BLOCKS, layout, tensor, kernel_block_size)
    return raw, per_layer, layer_stride, block_stride


BLOCK_RUNS = [m for m in KVCacheLayout if m not in (KVCacheLayout.LHBNC, KVCacheLayout.BHLNC)]


@pytest.mark.parametrize("layout", BLOCK_RUNS, ids=lambda m: m.name)
def test_each_row_is_the_bytes_of_one_block_in_memory_order(layout: KVCacheLayout) -> None:
    raw, per_layer, layer_stride, block_stride = views(layout)
    flat = raw.view(torch.uint8)
    for layer, view in enumerate(per_layer):
        rows = block_rows(f"l{layer}", view, BLOCKS)
        assert tuple(rows.shape) == (BLOCKS, PAGE)
        for b in range(BLOCKS):
            start = layer * layer_stride + b * block_stride
            assert torch.equal(rows[b], flat[start : start + PAGE])
    # a write through a row lands in vLLM's view of that block and nowhere else
    rows = block_rows("l1", per_layer[1], BLOCKS)
    before = raw.clone()
    rows[3].fill_(0x5A)
    assert torch.all(per_layer[1][3].contiguous().view(torch.uint8) == 0x5A)
    changed = (raw != before).nonzero().flatten()
    start = layer_stride + 3 * block_stride
    assert changed.min() >= start
    assert changed.max() < start + PAGE


def test_the_inner_order_of_a_block_is_what_the_layout_says() -> None:
    heads_first = block_order(views(KVCacheLayout.LBHNC)[1][0])
    tokens_first = block_order(views(KVCacheLayout.LBNHC)[1][0])
    assert heads_first == (1, 2, 3)  # [heads, tokens, content]
    assert tokens_first == (2, 1, 3)  # [tokens, heads, content]
    assert block_order(views(KVCacheLayout.BLNHC)[1][0]) == tokens_first


@pytest.mark.parametrize("layout", BLOCK_RUNS, ids=lambda m: m.name)
def test_pages_of_another_tp_size_are_sliced_by_head_in_every_layout(
    layout: KVCacheLayout,
) -> None:
    # a head is one run of a block (heads first) or one run per token (tokens first)
    view = views(layout)[1][0]
    tokens_first = layout.name.endswith("NHC")
    per_token = PAGE // HEADS // 16
    expected = (
        LayerHeads("l0", 16, per_token) if tokens_first else LayerHeads("l0", 1, PAGE // HEADS)
    )
    assert head_geometry("l0", view, BLOCKS, HEADS) == expected


@pytest.mark.parametrize("layout", [KVCacheLayout.LHBNC, KVCacheLayout.BHLNC], ids=str)
def test_layouts_with_heads_outside_the_blocks_are_refused_naming_a_layout_that_works(
    layout: KVCacheLayout,
) -> None:
    _, per_layer, _, _ = views(layout)
    assert block_order(per_layer[0]) is None
    with pytest.raises(DeviceError, match="VLLM_KV_CACHE_LAYOUT=LBHNC"):
        block_rows("l0", per_layer[0], BLOCKS)


@pytest.mark.parametrize("layout", BLOCK_RUNS, ids=lambda m: m.name)
def test_a_block_outermost_layout_saves_each_page_as_one_row_of_every_layer(
    layout: KVCacheLayout,
) -> None:
    raw, per_layer, _, block_stride = views(layout)
    rows = [block_rows(f"l{i}", v, BLOCKS) for i, v in enumerate(per_layer)]
    pages = whole_pages(rows)
    if layout.is_layer_compact:  # each layer's blocks lie apart: one copy per layer
        assert pages is None
        return
    assert pages is not None
    flat = raw.view(torch.uint8)
    for b in range(BLOCKS):  # the page is the block's layers in the host page's order
        assert torch.equal(pages[b], torch.cat([r[b] for r in rows]))
        assert torch.equal(pages[b], flat[b * block_stride : b * block_stride + PAGE * LAYERS])
    # another order of the layers than the host page's is not one run in that order
    assert whole_pages(rows[::-1]) is None
    assert whole_pages([rows[0], rows[2]]) is None  # a layer missing between


def test_kernel_blocks_with_tokens_outermost_are_the_bytes_of_vllms_blocks() -> None:
    # the attention kernel takes 4-token blocks: vLLM registers 4 per block of 16 (only in a
    # layer-compact layout: vLLM refuses kernel blocks where a block stride spans layers)
    layout = KVCacheLayout.LBNHC
    _, split, _, _ = views(layout, kernel_block_size=4)
    _, whole, _, _ = views(layout)
    assert split[0].shape[0] == 4 * BLOCKS
    for layer in range(LAYERS):
        merged = manager_blocks(f"l{layer}", split[layer], BLOCKS)
        assert tuple(merged.shape) == tuple(whole[layer].shape)
        assert torch.equal(
            block_rows(f"l{layer}", merged, BLOCKS), block_rows(f"l{layer}", whole[layer], BLOCKS)
        )


def test_kernel_blocks_with_heads_outermost_are_refused_naming_a_layout_that_works() -> None:
    # each 4-token kernel block restarts the heads: the bytes depend on the kernel's size
    _, split, _, _ = views(KVCacheLayout.LBHNC, kernel_block_size=4)
    with pytest.raises(DeviceError, match="VLLM_KV_CACHE_LAYOUT=LBNHC"):
        manager_blocks("l0", split[0], BLOCKS)


def _worker(resolved: KVCacheLayout) -> WorkerConnector:
    """A worker whose Shape comes from a KVCacheConfig on which vLLM resolved ``resolved``."""
    layers = [f"l{i}" for i in range(LAYERS)]
    config = KVCacheConfig(
        num_blocks=BLOCKS, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(layers, SPEC)]
    )
    config.kv_cache_layout = resolved.name
    vllm = SimpleNamespace(
        parallel_config=SimpleNamespace(
            tensor_parallel_size=1, decode_context_parallel_size=1, pipeline_parallel_size=1
        ),
        model_config=SimpleNamespace(
            use_mla=False, get_total_num_kv_heads=lambda: HEADS, model="m", dtype=torch.float16
        ),
        cache_config=SimpleNamespace(block_size=16, mamba_cache_mode="align"),
    )
    settings = ConnectorSettings.from_extra_config({"host_gib": 0.001})
    shape = Shape.of(vllm, config, settings)  # type: ignore[arg-type]
    return WorkerConnector(
        shape,
        settings,
        num_blocks=BLOCKS,
        store=None,
        store_key=lambda rank, page: StoreKey("ns", "kv", page.hex()),
        stats=ConnectorStats(),
    )


def test_the_worker_refuses_caches_whose_block_order_differs_from_the_resolved_layout() -> None:
    # the namespace says tokens-first (LBNHC); caches handed over heads-first would store pages
    # under the wrong name: the worker stops at registration instead
    worker = _worker(KVCacheLayout.LBNHC)
    _, per_layer, _, _ = views(KVCacheLayout.LBHNC)
    with pytest.raises(DeviceError, match=r"holds each block as HNC; .* says NHC"):
        worker.register({f"l{i}": v for i, v in enumerate(per_layer)}, rank=0)
    # the same order in another arrangement of layers and blocks registers
    worker = _worker(KVCacheLayout.LBNHC)
    _, per_layer, _, _ = views(KVCacheLayout.BLNHC)
    worker.register({f"l{i}": v for i, v in enumerate(per_layer)}, rank=0)
    worker.shutdown()


def test_the_worker_registers_caches_that_the_attention_kernel_splits() -> None:
    worker = _worker(KVCacheLayout.LBNHC)
    _, split, _, _ = views(KVCacheLayout.LBNHC, kernel_block_size=4)
    worker.register({f"l{i}": v for i, v in enumerate(split)}, rank=0)
    _, whole, _, _ = views(KVCacheLayout.LBNHC)
    try:
        rows = worker.transfers.rows
        for layer, view in enumerate(whole):
            assert torch.equal(rows[f"l{layer}"], block_rows(f"l{layer}", view, BLOCKS))
    finally:
        worker.shutdown()
