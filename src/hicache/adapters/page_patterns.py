"""Deterministic device-page contents derived from a page key: a soak and test tool.

- DevicePatterns(device, plan): ``fill(pool, page, key)`` writes the pattern of ``key`` into
  device page ``page`` of ``pool`` (every layer, every buffer; an anchor's sidecars too, since
  they share its page ids); ``check(pool, page, key)`` says whether the page still holds it.

The pattern of (key, pool, buffer) over all layers is one run of 64-bit words
``w[j] = j * M + s`` (M a fixed odd multiplier, s taken from blake2b of the key, the pool and
the buffer name),
so a page restored from the wrong host page, a torn or stale copy, or bytes of another pool
differ from it with near certainty. Used by ``hicache bench soak`` to verify every restored byte.
"""

from __future__ import annotations

import hashlib

import torch

from hicache.adapters.device_pool import DeviceGroup
from hicache.domain import HostGroupPlan, PoolName, PoolRole

_M = 0x9E3779B97F4A7C15 - (1 << 64)  # odd: consecutive words differ in every byte position


class DevicePatterns:
    """Fill and check device pages with key-derived bytes (see the module docstring)."""

    def __init__(self, device: DeviceGroup, plan: HostGroupPlan) -> None:
        self._views: dict[PoolName, list[tuple[str, torch.Tensor]]] = {}
        self._words: dict[tuple[PoolName, str], torch.Tensor] = {}
        for p in plan.pools:
            dp = device.pool(p.name)
            views = []
            for name in dp.buffers:
                stacked = dp.paged_stacked(name)
                if stacked is None:  # wrapped framework tensors of differing strides
                    raise ValueError(f"pool {p.name.value!r} buffer {name!r} is not stacked")
                raw = stacked.view(torch.uint8).reshape(stacked.shape[0], stacked.shape[1], -1)
                views.append((name, raw))
                per_page = raw.shape[0] * raw.shape[2]
                words = torch.arange((per_page + 7) // 8, dtype=torch.int64)
                self._words[(p.name, name)] = words * _M
            self._views[p.name] = views
        anchor = plan.anchor.name
        self._sidecars = {
            anchor: tuple(p.name for p in plan.pools if p.role is PoolRole.SIDECAR)
        }

    def _pattern(self, pool: PoolName, name: str, key: bytes, shape: torch.Size) -> torch.Tensor:
        digest = hashlib.blake2b(key + pool.value.encode() + b"/" + name.encode()).digest()
        s = int.from_bytes(digest[:8], "little", signed=True)
        words = self._words[(pool, name)] + s
        n = shape[0] * shape[1]
        return words.view(torch.uint8)[:n].view(shape)

    def _pools(self, pool: PoolName) -> tuple[PoolName, ...]:
        return (pool, *self._sidecars.get(pool, ()))

    def fill(self, pool: PoolName, page: int, key: bytes) -> None:
        """Write the pattern of ``key`` into ``page`` of ``pool`` (and of its sidecars)."""
        for p in self._pools(pool):
            for name, raw in self._views[p]:
                slab = raw[:, page]
                slab.copy_(self._pattern(p, name, key, slab.shape))

    def check(self, pool: PoolName, page: int, key: bytes) -> bool:
        """Whether ``page`` of ``pool`` (and of its sidecars) holds the pattern of ``key``."""
        for p in self._pools(pool):
            for name, raw in self._views[p]:
                slab = raw[:, page]
                if not torch.equal(slab, self._pattern(p, name, key, slab.shape)):
                    return False
        return True


__all__ = ["DevicePatterns"]
