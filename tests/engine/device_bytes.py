"""Device bytes in the end-to-end engine tests (real CPU or GPU device groups, torch):
write_device fills pages with random bytes and remembers them, layer_matches checks one
transfer layer of a load against them, poison overwrites every device byte."""

from __future__ import annotations

import torch

from hicache.bootstrap.runtime import Runtime
from hicache.domain import PoolName, PoolRole


def _pages_of(rt: Runtime, pool: PoolName, pages: dict[PoolName, tuple[int, ...]]) -> list[int]:
    owner = rt.plan.anchor.name if rt.plan.pool(pool).role is PoolRole.SIDECAR else pool
    return list(pages.get(owner, ()))


def write_device(rt: Runtime, pages: dict[PoolName, tuple[int, ...]], seed: int) -> dict:
    """Random bytes into every layer of the given device pages; returns what was written."""
    gen = torch.Generator().manual_seed(seed)
    written: dict = {}
    for name, pool in rt.device.pools.items():
        ps = pool.page_size
        for buf, layers in pool.buffers.items():
            for pl, t in enumerate(layers):
                raw = t.view(torch.uint8).view(t.shape[0], -1)
                for page in _pages_of(rt, name, pages):
                    rows = raw[page * ps : (page + 1) * ps]
                    data = torch.randint(0, 256, rows.shape, generator=gen, dtype=torch.uint8)
                    rows.copy_(data)
                    written[(name, buf, pl, page)] = data
    return written


def layer_matches(
    rt: Runtime,
    layer: int,
    written: dict,
    src: dict[PoolName, tuple[int, ...]],
    dst: dict[PoolName, tuple[int, ...]],
) -> bool:
    """Whether transfer layer ``layer`` of every pool holds, in ``dst``, what ``src`` held."""
    for name, pool in rt.device.pools.items():
        pl = pool.plan.binding.pool_layer(layer)
        if pl is None:
            continue
        ps = pool.page_size
        for buf, layers in pool.buffers.items():
            raw = layers[pl].view(torch.uint8).view(layers[pl].shape[0], -1)
            for s, d in zip(_pages_of(rt, name, src), _pages_of(rt, name, dst), strict=True):
                # .cpu() runs on the current stream, so on a GPU it reads after wait_layer.
                if not torch.equal(raw[d * ps : (d + 1) * ps].cpu(), written[(name, buf, pl, s)]):
                    return False
    return True


def poison(rt: Runtime) -> None:
    for pool in rt.device.pools.values():
        for layers in pool.buffers.values():
            for t in layers:
                t.view(torch.uint8).fill_(0xA5)
