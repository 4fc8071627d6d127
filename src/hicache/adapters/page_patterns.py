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
        # Per pool: (buffer name, (layers, pages, words per page-layer) int64 view, base words).
        self._views: dict[PoolName, list[tuple[str, torch.Tensor, torch.Tensor]]] = {}
        for p in plan.pools:
            dp = device.pool(p.name)
            views = []
            for name in dp.buffers:
                stacked = dp.paged_stacked(name)
                if stacked is None:  # wrapped framework tensors of differing strides
                    raise ValueError(f"pool {p.name.value!r} buffer {name!r} is not stacked")
                raw = stacked.view(torch.uint8).reshape(stacked.shape[0], stacked.shape[1], -1)
                if raw.shape[2] % 8:
                    raise ValueError(
                        f"pool {p.name.value!r} buffer {name!r}: {raw.shape[2]} B per page and "
                        "layer, not a multiple of 8"
                    )
                words = raw.view(torch.int64)
                base = torch.arange(words.shape[0] * words.shape[2], dtype=torch.int64) * _M
                views.append((name, words, base.view(words.shape[0], words.shape[2])))
            self._views[p.name] = views
        anchor = plan.anchor.name
        self._sidecars = {anchor: tuple(p.name for p in plan.pools if p.role is PoolRole.SIDECAR)}

    @staticmethod
    def _seed(pool: PoolName, name: str, key: bytes) -> int:
        digest = hashlib.blake2b(key + pool.value.encode() + b"/" + name.encode()).digest()
        return int.from_bytes(digest[:8], "little", signed=True)

    def _pools(self, pool: PoolName) -> tuple[PoolName, ...]:
        return (pool, *self._sidecars.get(pool, ()))

    def fill(self, pool: PoolName, page: int, key: bytes) -> None:
        """Write the pattern of ``key`` into ``page`` of ``pool`` (and of its sidecars)."""
        for p in self._pools(pool):
            for name, words, base in self._views[p]:
                torch.add(base, self._seed(p, name, key), out=words[:, page])

    def check(self, pool: PoolName, page: int, key: bytes) -> bool:
        """Whether ``page`` of ``pool`` (and of its sidecars) holds the pattern of ``key``."""
        for p in self._pools(pool):
            for name, words, base in self._views[p]:
                if not torch.equal(words[:, page], base + self._seed(p, name, key)):
                    return False
        return True


__all__ = ["DevicePatterns"]
