"""Closing a runtime gives its host memory back at once: RSS and /dev/shm, no gc needed."""

from __future__ import annotations

import os
import subprocess

import anyio
import pytest
import torch

from hicache.adapters.host_memory import AnonymousRegion, ShmRegion
from hicache.bootstrap.runtime import open_runtime
from hicache.domain import (
    DType,
    HostGroupPlan,
    HostMemory,
    KVGeometry,
    LayerBinding,
    Layout,
    MemoryKind,
    PoolName,
    PoolPlan,
    PoolRole,
    TransferError,
)
from hicache.domain.ports import PageMap
from tests.adapters.conftest import PAGE, SHM_DIR, python_command, rss_bytes

MiB = 1 << 20


def _plan(kind: str, host_mib: int) -> HostGroupPlan:
    geometry = KVGeometry(kv_heads=8, head_dim=128, dtype=DType.BF16)  # 4 KiB a token, K+V
    layers, page_size = 4, 16
    tokens = host_mib * MiB // (4096 * layers)
    return HostGroupPlan(
        host_memory=HostMemory(MemoryKind(kind)),
        pools=[
            PoolPlan(
                name=PoolName.KV,
                role=PoolRole.ANCHOR,
                geometry=geometry,
                binding=LayerBinding.contiguous(list(range(layers))),
                layout=Layout.PAGE_FIRST,
                page_size=page_size,
                capacity=tokens,
                device_capacity=64 * page_size,
            )
        ],
    )


def _our_segments_bytes() -> int:
    prefix = f"hicache-{os.getpid()}-"
    return sum(e.stat().st_size for e in os.scandir(SHM_DIR) if e.name.startswith(prefix))


def _host_rss() -> int:
    return rss_bytes("RssAnon") + rss_bytes("RssShmem")


@pytest.mark.parametrize("kind", ["shm", "anonymous"])
def test_closing_a_runtime_gives_its_host_memory_back_while_it_is_still_referenced(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HICACHE_COPY_BACKEND", "torch")  # the backend that keeps staging views
    host_bytes = 64 * MiB
    before_shm = _our_segments_bytes()
    runtime = open_runtime(_plan(kind, 64), device="cpu")
    in_use: list[int] = []

    async def use_and_close() -> None:
        async with runtime:
            maps = [PageMap(PoolName.KV, list(range(0, 64, 3)), list(range(22)))]
            runtime.transfer.backup(maps)
            for layer in range(runtime.transfer.transfer_layers):
                runtime.transfer.load_layer(layer, maps)
            in_use.append(_host_rss())

    anyio.run(use_and_close)
    assert runtime.closed  # and still referenced here: no garbage collection involved
    released_rss = in_use[0] - _host_rss()
    assert released_rss >= 0.99 * host_bytes
    assert _our_segments_bytes() == before_shm
    with pytest.raises(TransferError, match="closed"):
        runtime.transfer.load_layer(0, [PageMap(PoolName.KV, [0], [0])])


def test_a_closed_regions_pages_leave_rss_while_a_view_still_exists() -> None:
    region = AnonymousRegion.allocate(32 * MiB)
    view = region.tensor()[PAGE:]
    view.fill_(1)
    before = rss_bytes("RssAnon")
    region.close()
    assert before - rss_bytes("RssAnon") >= 31 * MiB
    assert view.numel() == 32 * MiB - PAGE  # the tensor object itself is still there
    del view


def test_a_closed_shm_segment_leaves_dev_shm_while_a_view_still_exists() -> None:
    region = ShmRegion.create(16 * MiB)
    view = region.tensor()[PAGE:]
    view.fill_(1)
    before = rss_bytes("RssShmem")
    region.close()
    assert not region.path.exists()
    assert before - rss_bytes("RssShmem") >= 15 * MiB
    del view


def test_using_a_view_after_close_faults_instead_of_reading_stale_memory() -> None:
    code = """
    from hicache.adapters.host_memory import AnonymousRegion
    region = AnonymousRegion.allocate(1 << 20)
    view = region.tensor()
    view.fill_(7)
    region.close()
    print("closed", flush=True)
    print(int(view.sum()), flush=True)
    """
    proc = subprocess.run(python_command(code), capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == ["closed"]
    assert proc.returncode != 0


def test_torch_cpu_tensors_of_the_regions_are_not_needed_for_release() -> None:
    # Dropping the region object without close() still releases (garbage collection path).
    region = AnonymousRegion.allocate(8 * MiB)
    region.tensor().fill_(1)
    before = rss_bytes("RssAnon")
    del region
    assert before - rss_bytes("RssAnon") >= 7 * MiB
    assert torch.zeros(1).item() == 0
