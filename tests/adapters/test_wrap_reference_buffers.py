"""DevicePool.wrap adopts the reference engines' real cache buffers as views, without a copy.

- SGLang MLATokenToKVPool: per layer (size + page_size, 1, kv_lora_rank + qk_rope_head_dim).
- vLLM FlashInfer: per layer (num_blocks, 2, block_size, num_kv_heads, head_size); K and V are
  ``t[:, 0]`` and ``t[:, 1]`` (pages contiguous, a page stride of two pages).
"""

from __future__ import annotations

import pytest
import torch

from hicache.adapters.copy import make_transfer
from hicache.adapters.device_pool import DeviceGroup, DevicePool
from hicache.adapters.host_pool import materialise_host_group
from hicache.domain import (
    DeviceError,
    DType,
    HostGroupPlan,
    HostMemory,
    KVGeometry,
    LayerBinding,
    Layout,
    MemoryKind,
    MLAGeometry,
    PoolName,
    PoolPlan,
    PoolRole,
)
from hicache.domain.ports import PageMap

LAYERS, PAGE, BLOCKS = 3, 16, 6
BACKENDS = ["memcpy", "torch", "naive"]


def _plan(geometry: KVGeometry | MLAGeometry, layout: Layout) -> HostGroupPlan:
    return HostGroupPlan(
        host_memory=HostMemory(MemoryKind("anonymous")),
        pools=[
            PoolPlan(
                name=PoolName.KV,
                role=PoolRole.ANCHOR,
                geometry=geometry,
                binding=LayerBinding.contiguous(list(range(LAYERS))),
                layout=layout,
                page_size=PAGE,
                capacity=8 * PAGE,
            )
        ],
    )


def sglang_mla_buffers() -> list[torch.Tensor]:
    # (size + page_size, 1, 512 + 64) per layer, as MLATokenToKVPool allocates it.
    return [torch.randn((BLOCKS * PAGE, 1, 576)).to(torch.bfloat16) for _ in range(LAYERS)]


def vllm_flashinfer_caches(heads: int = 2, head_dim: int = 64) -> list[torch.Tensor]:
    # (num_blocks, 2, block_size, num_kv_heads, head_size) per layer (get_kv_cache_shape).
    shape = (BLOCKS, 2, PAGE, heads, head_dim)
    return [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS)]


def _round_trip(plan: HostGroupPlan, tensors: dict[str, list[torch.Tensor]], backend: str) -> None:
    """Back up pages 1, 4, 5 to host, scribble over them on the device, load them back."""
    before = {k: [t.clone() for t in ts] for k, ts in tensors.items()}
    host = materialise_host_group(plan, device="cpu")
    try:
        device = DeviceGroup.wrap(plan, {PoolName.KV: tensors})
        transfer = make_transfer(host, device, backend=backend)
        dev_pages = [1, 4, 5]
        maps = [PageMap(PoolName.KV, [6, 0, 3], dev_pages)]
        transfer.backup(maps)
        pool = device.pool(PoolName.KV)
        for name in tensors:
            for paged in pool.paged(name):
                paged[dev_pages] = 0
        for layer in range(LAYERS):
            transfer.load_layer(layer, maps)
        for name, ts in tensors.items():
            for t, b in zip(ts, before[name], strict=True):
                assert torch.equal(t.view(torch.uint8), b.view(torch.uint8))
    finally:
        host.close()


@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST_DIRECT, Layout.LAYER_FIRST])
@pytest.mark.parametrize("backend", BACKENDS)
def test_sglang_mla_buffers_are_wrapped_as_views_and_round_trip_byte_exact(
    backend: str, layout: Layout
) -> None:
    plan = _plan(MLAGeometry(kv_lora_rank=512, qk_rope_head_dim=64), layout)
    layers = sglang_mla_buffers()
    pool = DevicePool.wrap(plan.anchor, {"kv": layers})
    assert pool.capacity == BLOCKS * PAGE
    for i, t in enumerate(layers):
        assert pool.layer("kv", i).data_ptr() == t.data_ptr()  # no copy
        assert pool.paged("kv")[i].data_ptr() == t.data_ptr()
        assert pool.paged("kv")[i].shape == (BLOCKS, PAGE, 576)
    _round_trip(plan, {"kv": layers}, backend)


@pytest.mark.parametrize("layout", [Layout.PAGE_FIRST_DIRECT, Layout.PAGE_FIRST])
@pytest.mark.parametrize("backend", BACKENDS)
def test_vllm_flashinfer_caches_are_wrapped_as_views_and_round_trip_byte_exact(
    backend: str, layout: Layout
) -> None:
    plan = _plan(KVGeometry(kv_heads=2, head_dim=64, dtype=DType.BF16), layout)
    caches = vllm_flashinfer_caches()
    tensors = {"k": [c[:, 0] for c in caches], "v": [c[:, 1] for c in caches]}
    pool = DevicePool.wrap(plan.anchor, tensors)
    assert pool.capacity == BLOCKS * PAGE
    for i, c in enumerate(caches):
        assert pool.paged("k")[i].data_ptr() == c.data_ptr()  # views, no copy
        assert pool.paged("v")[i].data_ptr() == c[:, 1].data_ptr()
    _round_trip(plan, tensors, backend)
    # And the pages really are the cache's: page 4 of layer 2's V is block 4 of caches[2][:, 1].
    assert torch.equal(pool.paged("v")[2][4], caches[2][4, 1])


def test_flashinfer_layers_in_one_allocation_share_an_all_layer_view() -> None:
    plan = _plan(KVGeometry(kv_heads=2, head_dim=64, dtype=DType.BF16), Layout.PAGE_FIRST_DIRECT)
    whole = torch.zeros((LAYERS, BLOCKS, 2, PAGE, 2, 64), dtype=torch.bfloat16)
    pool = DevicePool.wrap(
        plan.anchor, {"k": [w[:, 0] for w in whole], "v": [w[:, 1] for w in whole]}
    )
    stacked = pool.paged_stacked("k")
    assert stacked is not None
    assert stacked.shape == (LAYERS, BLOCKS, PAGE, 2, 64)
    assert stacked.data_ptr() == whole.data_ptr()
    assert pool.stacked("k") is None  # no (L, capacity, *row) view of a paged buffer


def test_a_block_size_other_than_the_page_size_is_refused_with_what_was_expected() -> None:
    plan = _plan(KVGeometry(kv_heads=2, head_dim=64, dtype=DType.BF16), Layout.PAGE_FIRST_DIRECT)
    caches = [torch.zeros((BLOCKS, 2, 8, 2, 64), dtype=torch.bfloat16) for _ in range(LAYERS)]
    with pytest.raises(DeviceError, match=r"layer 0: shape \(6, 8, 2, 64\) does not match"):
        DevicePool.wrap(
            plan.anchor, {"k": [c[:, 0] for c in caches], "v": [c[:, 1] for c in caches]}
        )


def test_pages_that_are_not_contiguous_are_refused() -> None:
    plan = _plan(KVGeometry(kv_heads=2, head_dim=64, dtype=DType.BF16), Layout.PAGE_FIRST_DIRECT)
    # HND order (blocks, 2, H, block, D) viewed as NHD: a page is not one contiguous block.
    caches = [torch.zeros((BLOCKS, 2, 2, PAGE, 64), dtype=torch.bfloat16) for _ in range(LAYERS)]
    k = [c[:, 0].transpose(1, 2) for c in caches]
    v = [c[:, 1].transpose(1, 2) for c in caches]
    with pytest.raises(DeviceError, match=r"pages of shape .* are not contiguous"):
        DevicePool.wrap(plan.anchor, {"k": k, "v": v})


def test_a_row_that_differs_beyond_size_one_axes_is_refused() -> None:
    plan = _plan(MLAGeometry(kv_lora_rank=512, qk_rope_head_dim=64), Layout.PAGE_FIRST_DIRECT)
    layers = [torch.zeros((BLOCKS * PAGE, 2, 288), dtype=torch.bfloat16) for _ in range(LAYERS)]
    with pytest.raises(DeviceError, match=r"shape \(96, 2, 288\) does not match the plan"):
        DevicePool.wrap(plan.anchor, {"kv": layers})


def test_buffer_names_of_mixed_types_are_a_device_error_naming_them() -> None:
    plan = _plan(MLAGeometry(kv_lora_rank=512, qk_rope_head_dim=64), Layout.LAYER_FIRST)
    layers = sglang_mla_buffers()
    with pytest.raises(DeviceError, match=r"unexpected \[\(2, 3\), 1\]"):
        DevicePool.wrap(plan.anchor, {"kv": layers, 1: layers, (2, 3): layers})  # type: ignore[dict-item]
