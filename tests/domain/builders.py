"""Small builders of pool plans shared by the domain tests (pure values, no fakes needed)."""

from __future__ import annotations

from hicache.domain import (
    DType,
    HostMemory,
    IndexerGeometry,
    KVGeometry,
    LayerBinding,
    Layout,
    MemoryKind,
    PoolName,
    PoolPlan,
    PoolRole,
    mamba2_state,
)
from hicache.domain.geometry import AnyGeometry

ANON = HostMemory(MemoryKind("anonymous"))
SHM = HostMemory(MemoryKind("shm"))
MOONCAKE = HostMemory(MemoryKind("store:mooncake"))

KV = KVGeometry(kv_heads=2, head_dim=64)
INDEXER = IndexerGeometry(heads=1, head_dim=128, dtype=DType.FP8_E4M3, scale_block=128)
STATE = mamba2_state(heads=4, head_dim=16, state_size=8, n_groups=1, conv_kernel=4)


def pool(
    name: PoolName,
    role: PoolRole,
    *,
    geometry: AnyGeometry = KV,
    transfer: list[int] | None = None,
    page_size: int = 16,
    capacity: int = 64,
    layout: Layout = Layout.PAGE_FIRST,
) -> PoolPlan:
    return PoolPlan(
        name=name,
        role=role,
        geometry=geometry,
        binding=LayerBinding.contiguous(transfer if transfer is not None else [0, 1]),
        layout=layout,
        page_size=page_size,
        capacity=capacity,
    )


def anchor(**kw: object) -> PoolPlan:
    return pool(PoolName.KV, PoolRole.ANCHOR, **kw)  # type: ignore[arg-type]


def sidecar(**kw: object) -> PoolPlan:
    kw.setdefault("geometry", INDEXER)
    return pool(PoolName.INDEXER, PoolRole.SIDECAR, **kw)  # type: ignore[arg-type]


def state_pool(**kw: object) -> PoolPlan:
    kw.setdefault("geometry", STATE)
    kw.setdefault("page_size", 1)
    kw.setdefault("capacity", 8)
    kw.setdefault("transfer", [2, 3])
    return pool(PoolName.MAMBA, PoolRole.INDEPENDENT, **kw)  # type: ignore[arg-type]
