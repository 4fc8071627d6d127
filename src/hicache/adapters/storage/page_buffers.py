"""The bytes of one page of one host pool, as the writable segments a Store reads and writes.

- page_buffer: the PageBuffer (memoryview segments, no copy) of page ``page`` of a HostPool.
- HostGroupBuffers: the HostPageBuffers port over a materialised HostGroup.

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
from hicache.domain import ForeignIndexError, Layout, PoolName
from hicache.domain.storage import PageBuffer


def _bytes_of(buf: torch.Tensor) -> memoryview:
    """The whole buffer as one flat writable memoryview of bytes (no copy)."""
    flat = buf.reshape(-1).view(torch.uint8)
    return flat.numpy().data


def page_buffer(pool: HostPool, page: int) -> list[memoryview]:
    """The segments of page ``page`` of ``pool`` (see the module docstring for their order)."""
    if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < pool.pages:
        raise ForeignIndexError(
            f"page {page!r} does not belong to host pool {pool.name.value!r} "
            f"(pages 0..{pool.pages - 1})"
        )
    size = pool.page_size
    segments: list[memoryview] = []
    for buf in pool.buffers.values():
        whole = _bytes_of(buf)
        base = buf.data_ptr()
        if pool.layout is Layout.LAYER_FIRST:
            views = [buf[layer, page * size : (page + 1) * size] for layer in range(buf.shape[0])]
        elif pool.layout is Layout.PAGE_FIRST:
            views = [buf[page * size : (page + 1) * size]]
        else:
            views = [buf[page]]
        for view in views:
            start = view.data_ptr() - base
            segments.append(whole[start : start + view.numel() * view.element_size()])
    return segments


class HostGroupBuffers:
    """HostPageBuffers over a materialised HostGroup: ``buffer(pool, page)`` = page_buffer."""

    def __init__(self, group: HostGroup) -> None:
        self._group = group

    def buffer(self, pool: PoolName, page: int) -> PageBuffer:
        return page_buffer(self._group.pool(pool), page)
