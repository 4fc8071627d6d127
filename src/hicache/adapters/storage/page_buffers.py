"""The bytes of one page of one host pool, as the writable segments a Store reads and writes.

- page_buffer: the PageBuffer (memoryview segments, no copy) of page ``page`` of a HostPool.
- PoolSegments: a pool's page segments from byte offsets worked out once (no torch call per page).
- HostGroupBuffers: the HostPageBuffers port over a materialised HostGroup (one PoolSegments per
  pool, kept).
- whole_bytes: one buffer as a flat writable memoryview (what a zero-copy store registers).

Segments come buffer by buffer (K then V for MHA; one buffer for MLA and the indexer; one per
state tensor), and within a buffer:
  layer_first        one segment per layer (the page's tokens of that layer)
  page_first         one segment (the page's tokens x all layers)
  page_first_direct  one segment (the page's slab)
  page_head          one segment (the page's slab)
Every segment is a flat, C-contiguous, writable ``memoryview`` of unsigned bytes that shares the
pool's memory; the concatenation is the page's stored object.
"""

from __future__ import annotations

import torch

from hicache.adapters.host_pool import HostGroup, HostPool
from hicache.domain import ForeignIndexError, HostMemoryError, Layout, PoolName
from hicache.domain.storage import PageBuffer


def whole_bytes(buf: torch.Tensor) -> memoryview:
    """The whole buffer as one flat writable memoryview of bytes (no copy)."""
    flat = buf.reshape(-1).view(torch.uint8)
    return flat.numpy().data


def page_buffer(pool: HostPool, page: int) -> list[memoryview]:
    """The segments of page ``page`` of ``pool`` (see the module docstring for their order)."""
    return PoolSegments(pool).buffer(page)


class PoolSegments:
    """The segments of one pool's pages from byte offsets worked out once: a page's segments
    are slices of one memoryview per buffer, so building them costs no torch call (indexing a
    tensor per segment took about 20 ms for 64 pages of a 61-layer layer_first pool)."""

    def __init__(self, pool: HostPool) -> None:
        self.pool = pool
        size = pool.page_size
        # Per buffer: (whole, [(offset of page 0's segment, bytes)], page stride in bytes).
        self._tables: list[tuple[memoryview, list[tuple[int, int]], int]] = []
        for buf in pool.buffers.values():
            if not buf.is_contiguous():  # pragma: no cover - host pools are contiguous
                raise ForeignIndexError(f"host pool {pool.name.value!r} has a strided buffer")
            item = buf.element_size()
            if pool.layout is Layout.LAYER_FIRST:
                seg = size * buf.stride(1) * item
                firsts = [(layer * buf.stride(0) * item, seg) for layer in range(buf.shape[0])]
                stride = seg
            elif pool.layout is Layout.PAGE_FIRST:
                stride = size * buf.stride(0) * item
                firsts = [(0, stride)]
            else:
                stride = buf.stride(0) * item
                firsts = [(0, stride)]
            self._tables.append((whole_bytes(buf), firsts, stride))

    def buffer(self, page: int) -> list[memoryview]:
        """The segments of ``page``; HostMemoryError once the pool is closed (its memory is
        given back, so a segment would point at nothing)."""
        pool = self.pool
        if pool.closed:
            self._tables.clear()
            raise HostMemoryError(f"host pool {pool.name.value!r} is closed")
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < pool.pages:
            raise ForeignIndexError(
                f"page {page!r} does not belong to host pool {pool.name.value!r} "
                f"(pages 0..{pool.pages - 1})"
            )
        segments: list[memoryview] = []
        for whole, firsts, stride in self._tables:
            at = page * stride
            segments.extend(whole[at + off : at + off + n] for off, n in firsts)
        return segments


class HostGroupBuffers:
    """HostPageBuffers over a materialised HostGroup: ``buffer(pool, page)`` is
    ``page_buffer(group.pool(pool), page)``, from a PoolSegments kept per pool."""

    def __init__(self, group: HostGroup) -> None:
        self._group = group
        self._pools: dict[PoolName, PoolSegments] = {}

    def buffer(self, pool: PoolName, page: int) -> PageBuffer:
        segments = self._pools.get(pool)
        if segments is None:
            segments = self._pools[pool] = PoolSegments(self._group.pool(pool))
        return segments.buffer(page)
