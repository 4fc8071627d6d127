"""Host buffer layouts and the shapes they give each pool buffer.

- Layout: layer_first, page_first, page_first_direct, page_head.
- host_buffer_shape: the host tensor shape of one pool buffer in a layout.
- check_layout: raises LayoutError when a layout cannot hold a pool kind or serve a storage backend.

Shapes, with L pool layers, N capacity units, P page size and R the buffer's per-unit shape:
  layer_first        (L, N, *R)
  page_first         (N, L, *R)
  page_first_direct  (N/P, L, P, *R)
  page_head          (N/P, H, P, L, *R[1:])   R[0] = H heads; only buffers with a head axis
"""

from __future__ import annotations

import enum

from hicache.domain.errors import LayoutError, shown
from hicache.domain.geometry import AnyGeometry, BufferSpec, Unit


class Layout(enum.Enum):
    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"
    PAGE_HEAD = "page_head"

    @classmethod
    def parse(cls, value: str | Layout) -> Layout:
        if isinstance(value, Layout):
            return value
        try:
            if not isinstance(value, str):  # str() of a deep or huge value would raise
                raise ValueError(value)
            return cls(value.strip().lower())
        except ValueError:
            raise LayoutError(
                f"unknown layout {shown(value)}: expected one of {', '.join(m.value for m in cls)}"
            ) from None

    @property
    def page_objects(self) -> bool:
        """Whether all layers of one page form whole, addressable objects (what L3 needs)."""
        return self is not Layout.LAYER_FIRST


# Storage backends that move whole pages as zero-copy objects: a layer_first host pool scatters a
# page over every layer, so these need a page-first layout.
PAGE_OBJECT_BACKENDS = frozenset({"mooncake", "hf3fs", "nixl"})


def check_layout(
    layout: Layout, geometry: AnyGeometry, *, pool: str, storage_backend: str | None = None
) -> None:
    """Raise LayoutError, saying which and why, if ``layout`` cannot serve this pool."""
    if geometry.unit is Unit.SLOT and layout not in (Layout.PAGE_FIRST, Layout.PAGE_FIRST_DIRECT):
        raise LayoutError(
            f"pool {shown(pool)} holds recurrent state ({geometry.kind}), which needs one contiguous "
            f"object per slot: layout {shown(layout.value)} cannot hold it; use page_first or "
            f"page_first_direct for this pool"
        )
    if layout is Layout.PAGE_HEAD:
        no_heads = [b.name for b in geometry.buffers if not b.head_axis]
        if no_heads:
            raise LayoutError(
                f"pool {shown(pool)} ({geometry.kind}) has buffers {no_heads} without a head axis: "
                f"layout 'page_head' splits heads and cannot hold them; use page_first or "
                f"page_first_direct"
            )
    if storage_backend in PAGE_OBJECT_BACKENDS and layout is Layout.LAYER_FIRST:
        raise LayoutError(
            f"pool {shown(pool)}: storage backend {shown(storage_backend)} moves whole pages as objects, "
            f"which layout 'layer_first' scatters over all layers; use page_first or "
            f"page_first_direct"
        )


def host_buffer_shape(
    layout: Layout, buffer: BufferSpec, *, layers: int, capacity: int, page_size: int
) -> tuple[int, ...]:
    """The host tensor shape of ``buffer`` for a pool of ``layers`` x ``capacity`` units."""
    if capacity % page_size:
        raise LayoutError(f"capacity {capacity} is not a whole number of pages of {page_size}")
    pages = capacity // page_size
    row = buffer.shape
    if layout is Layout.LAYER_FIRST:
        return (layers, capacity, *row)
    if layout is Layout.PAGE_FIRST:
        return (capacity, layers, *row)
    if layout is Layout.PAGE_FIRST_DIRECT:
        return (pages, layers, page_size, *row)
    if not buffer.head_axis:
        raise LayoutError(
            f"buffer {shown(buffer.name)} has no head axis: 'page_head' cannot hold it"
        )
    return (pages, row[0], page_size, layers, *row[1:])
