"""Small pool plans and host-page readers shared by the adapter, storage and engine tests.

- GEOMETRIES / with_dtype(kind, dtype): a small geometry of every pool kind.
- pool_plan(...) / group_plan(kind, layout): a pool, and a group whose pool of interest has
  that kind in that layout; valid(kind, layout) says which pairs exist.
- host_page(buf, layout, layer, page, p): one page of one layer, from the layout's definition.
- fill_random(pool, seed) / page_bytes(pool, page): random host bytes and reading them back.
- framework_tensors(plan): zeroed tensors shaped as a framework allocates them.
- my_segments(): this process's shared-memory segments under /dev/shm.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from hicache.adapters.dtypes import torch_dtype
from hicache.adapters.host_pool import HostPool
from hicache.domain import (
    DType,
    HostGroupPlan,
    HostMemory,
    IndexerGeometry,
    KVGeometry,
    LayerBinding,
    Layout,
    MemoryKind,
    MLAGeometry,
    Pinning,
    PoolName,
    PoolPlan,
    PoolRole,
    mamba2_state,
)
from hicache.domain.geometry import AnyGeometry

ANON = HostMemory(MemoryKind("anonymous"), Pinning.AUTO)


PAGE = 4


GEOMETRIES: dict[str, AnyGeometry] = {
    "mha": KVGeometry(kv_heads=2, head_dim=16, v_head_dim=8),
    "mla": MLAGeometry(kv_lora_rank=24, qk_rope_head_dim=8),
    "indexer": IndexerGeometry(heads=2, head_dim=16),
    "indexer_fp8": IndexerGeometry(heads=1, head_dim=64, dtype=DType.FP8_E4M3, scale_block=32),
    "state": mamba2_state(heads=2, head_dim=4, state_size=8, n_groups=1, conv_kernel=4),
}


def with_dtype(kind: str, dtype: DType) -> AnyGeometry:
    """The kind's geometry with its cache dtype set (state pools keep bf16 conv + fp32 SSM)."""
    geo = GEOMETRIES[kind]
    if kind == "mha":
        return KVGeometry(kv_heads=2, head_dim=16, v_head_dim=8, dtype=dtype)
    if kind == "mla":
        return MLAGeometry(kv_lora_rank=24, qk_rope_head_dim=8, dtype=dtype)
    if kind == "indexer":
        return IndexerGeometry(heads=2, head_dim=16, dtype=dtype)
    return geo


def pool_plan(
    name: PoolName,
    role: PoolRole,
    geometry: AnyGeometry,
    *,
    transfer: list[int],
    layout: Layout = Layout.PAGE_FIRST,
    page_size: int = PAGE,
    pages: int = 8,
    device_pages: int = 6,
) -> PoolPlan:
    return PoolPlan(
        name=name,
        role=role,
        geometry=geometry,
        binding=LayerBinding.contiguous(transfer),
        layout=layout,
        page_size=page_size,
        capacity=pages * page_size,
        device_capacity=device_pages * page_size,
    )


def group_plan(
    kind: str,
    layout: Layout,
    dtype: DType = DType.BF16,
    memory: HostMemory = ANON,
) -> tuple[HostGroupPlan, PoolName]:
    """A group whose pool of interest has ``kind`` in ``layout``; returns it and that pool's name.

    mha / mla are the anchor (transfer layers 0..3); an indexer is a sidecar of an MHA anchor;
    a state pool is independent, on transfer layers 0 and 2, with the anchor on 1 and 3.
    """
    geo = with_dtype(kind, dtype)
    if kind in ("mha", "mla"):
        anchor = pool_plan(PoolName.KV, PoolRole.ANCHOR, geo, transfer=[0, 1, 2, 3], layout=layout)
        return HostGroupPlan(host_memory=memory, pools=[anchor]), PoolName.KV
    if kind.startswith("indexer"):
        anchor = pool_plan(PoolName.KV, PoolRole.ANCHOR, GEOMETRIES["mha"], transfer=[0, 1, 2])
        side = pool_plan(PoolName.INDEXER, PoolRole.SIDECAR, geo, transfer=[0, 1, 2], layout=layout)
        return HostGroupPlan(host_memory=memory, pools=[anchor, side]), PoolName.INDEXER
    anchor = pool_plan(PoolName.KV, PoolRole.ANCHOR, GEOMETRIES["mha"], transfer=[1, 3])
    state = pool_plan(
        PoolName.MAMBA,
        PoolRole.INDEPENDENT,
        geo,
        transfer=[0, 2],
        layout=layout,
        page_size=1,
        pages=8,
        device_pages=5,
    )
    return HostGroupPlan(host_memory=memory, pools=[anchor, state]), PoolName.MAMBA


def valid(kind: str, layout: Layout) -> bool:
    if kind == "state":
        return layout in (Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT)
    return not (kind == "mla" and layout is Layout.PAGE_HEAD)


def host_page(buf: torch.Tensor, layout: Layout, layer: int, page: int, p: int) -> torch.Tensor:
    """Page ``page`` of layer ``layer`` as (P, *row), straight from the layout's definition."""
    if layout is Layout.LAYER_FIRST:
        return buf[layer, page * p : (page + 1) * p]
    if layout is Layout.PAGE_FIRST:
        return buf[page * p : (page + 1) * p, layer]
    if layout is Layout.PAGE_FIRST_DIRECT:
        return buf[page, layer]
    return buf[page, :, :, layer].transpose(0, 1)  # page_head: (H, P, *R1) -> (P, H, *R1)


def my_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob(f"hicache-{os.getpid()}-*")}


def framework_tensors(plan: PoolPlan, capacity: int = 24) -> dict[str, list[torch.Tensor]]:
    return {
        spec.name: [
            torch.zeros((capacity, *spec.shape), dtype=torch_dtype(spec.dtype))
            for _ in range(plan.layers)
        ]
        for spec in plan.geometry.buffers
    }


def fill_random(pool: HostPool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for buf in pool.buffers.values():
        raw = buf.view(-1).view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def page_bytes(pool: HostPool, page: int) -> list[bytes]:
    """Page ``page`` of every buffer and layer, read through the layout's definition."""
    out = []
    for buf in pool.buffers.values():
        layers = buf.shape[0] if pool.layout is Layout.LAYER_FIRST else buf.shape[1]
        if pool.layout is Layout.PAGE_HEAD:
            layers = buf.shape[3]
        for layer in range(layers):
            view = host_page(buf, pool.layout, layer, page, pool.page_size)
            out.append(view.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out
