"""Host pools materialised from a host group plan, on the group's one host memory kind.

- materialise_host_group: a HostGroupPlan into a HostGroup (no parameter to choose a memory kind).
- HostGroup: the pools of one model rank, their regions, the group's slot allocator; closes once.
- HostPool: one pool's buffers in its layout (K and V halves for MHA, one buffer for MLA and the
  indexer, one per state tensor), each a zero-copy view of its own host region.
- HostPool.page_objects / page_views: the (address, size) and the tensor views of one page's
  objects, for storage backends that move whole pages (page-first layouts only).

Every buffer gets its own region of exactly its size, so a pinned region's registration chunks
are aligned to that buffer's page rows (one layer for layer_first, one page for the page-first
layouts): no copy and no page object ever spans two registrations.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from types import MappingProxyType

import torch

from hicache.adapters.dtypes import torch_dtype
from hicache.adapters.host_memory import HostRegion, open_region
from hicache.domain import (
    AllocatorMismatchError,
    ConfigError,
    ForeignIndexError,
    HostGroupPlan,
    HostMemory,
    HostMemoryError,
    Layout,
    LayoutError,
    PoolName,
    PoolPlan,
    PoolRole,
)
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue
from hicache.domain.slots import GroupAllocator, PageAllocator


def _close(thing: HostRegion | HostPool) -> Exception | None:
    """Close ``thing``; return (not raise) what closing raised, so every other one closes too."""
    try:
        thing.close()
    except Exception as e:
        return e
    return None


def _row_count(plan: PoolPlan) -> int:
    """How many page rows one buffer of ``plan`` has (its outermost dimension)."""
    return plan.layers if plan.layout is Layout.LAYER_FIRST else plan.pages


class HostPool:
    """One host pool: its buffers (views of its regions) in the pool's layout."""

    def __init__(
        self,
        plan: PoolPlan,
        *,
        regions: Mapping[str, HostRegion],
        buffers: Mapping[str, torch.Tensor],
        allocator: PageAllocator,
    ) -> None:
        # Use materialise_host_group; this only takes ownership of regions it was handed.
        self.plan = plan
        self._regions = dict(regions)
        self._buffers = dict(buffers)
        self._allocator = allocator
        self._closed = False

    # -- what the pool is ---------------------------------------------------------------------

    @property
    def name(self) -> PoolName:
        return self.plan.name

    @property
    def role(self) -> PoolRole:
        return self.plan.role

    @property
    def layout(self) -> Layout:
        return self.plan.layout

    @property
    def page_size(self) -> int:
        return self.plan.page_size

    @property
    def pages(self) -> int:
        return self.plan.pages

    @property
    def capacity(self) -> int:
        return self.plan.capacity

    @property
    def layers(self) -> int:
        return self.plan.layers

    @property
    def nbytes(self) -> int:
        return self.plan.nbytes

    @property
    def allocator(self) -> PageAllocator:
        """This pool's free list of pages (a sidecar shares its anchor's)."""
        return self._allocator

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pinned(self) -> bool:
        """Whether every region of this pool is page-locked (False for an empty pool)."""
        return bool(self._regions) and all(r.pinned for r in self._regions.values())

    @property
    def regions(self) -> Mapping[str, HostRegion]:
        """Buffer name -> its host region (a pool of capacity 0 has none)."""
        self._check_open()
        return MappingProxyType(self._regions)

    @property
    def buffers(self) -> Mapping[str, torch.Tensor]:
        """Buffer name -> its tensor in this pool's layout (``plan.host_buffer_shapes()``)."""
        self._check_open()
        return MappingProxyType(self._buffers)

    def buffer(self, name: str) -> torch.Tensor:
        self._check_open()
        try:
            return self._buffers[name]
        except KeyError:
            raise ConfigError(
                f"pool {self.name.value!r} has no buffer {name!r}: it has {sorted(self._buffers)}"
            ) from None

    # -- page objects for storage -------------------------------------------------------------

    def page_views(self, page: int) -> list[torch.Tensor]:
        """Zero-copy contiguous views of page ``page``'s objects, one per buffer, in buffer order.

        page_first: the page's tokens x all layers; page_first_direct and page_head: the page's
        whole slab. layer_first scatters a page over every layer and has no page objects.
        """
        self._check_open()
        if not self.layout.page_objects:
            raise LayoutError(
                f"pool {self.name.value!r} is laid out {self.layout.value!r}, which scatters a "
                f"page over all layers: it has no page objects; use page_first or "
                f"page_first_direct"
            )
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.pages:
            raise ForeignIndexError(
                f"page {page!r} does not belong to host pool {self.name.value!r} "
                f"(pages 0..{self.pages - 1})"
            )
        views = []
        for buf in self._buffers.values():
            if self.layout is Layout.PAGE_FIRST:
                view = buf[page * self.page_size : (page + 1) * self.page_size]
            else:
                view = buf[page]
            views.append(view)
        return views

    def page_objects(self, page: int) -> list[tuple[int, int]]:
        """(address, size in bytes) of each contiguous object of page ``page``, one per buffer."""
        return [(int(v.data_ptr()), v.numel() * v.element_size()) for v in self.page_views(page)]

    # -- lifetime -------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise HostMemoryError(f"host pool {self.name.value!r} is closed")

    def close(self) -> None:
        """Drop the views and close every region; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._buffers.clear()
        errors = [e for e in map(_close, self._regions.values()) if e is not None]
        self._regions.clear()
        if errors:
            raise HostMemoryError(
                f"closing host pool {self.name.value!r} failed: {errors[0]}"
            ) from errors[0]

    def __repr__(self) -> str:
        head = (
            f"{self.name.value} ({self.plan.geometry.kind}, {self.layout.value}, "
            f"page {self.page_size})"
        )
        if self._closed:
            return f"<HostPool {head}: closed>"
        used = self._allocator.used_count()
        return f"<HostPool {head}: {used}/{self._allocator.pages} pages used>"


class HostGroup:
    """The host pools of one model rank, all on the group's one resolved host memory."""

    def __init__(
        self, plan: HostGroupPlan, pools: Mapping[PoolName, HostPool], allocator: GroupAllocator
    ) -> None:
        # Use materialise_host_group.
        self.plan = plan
        self._pools = dict(pools)
        self.allocator = allocator
        self._closed = False

    @property
    def host_memory(self) -> HostMemory:
        return self.plan.host_memory

    @property
    def pools(self) -> Mapping[PoolName, HostPool]:
        return MappingProxyType(self._pools)

    @property
    def anchor(self) -> HostPool:
        return self._pools[self.plan.anchor.name]

    @property
    def transfer_layers(self) -> int:
        return self.plan.transfer_layers

    @property
    def closed(self) -> bool:
        return self._closed

    def pool(self, name: PoolName | str) -> HostPool:
        key = PoolName.parse(name)
        try:
            return self._pools[key]
        except KeyError:
            raise ConfigError(
                f"no pool {key.value!r} in this host group: it has {[n.value for n in self._pools]}"
            ) from None

    def __iter__(self) -> Iterator[HostPool]:
        return iter(self._pools.values())

    def regions(self) -> list[tuple[PoolName, str, HostRegion]]:
        """(pool, buffer, region) for every region of the group, in group order."""
        return [(p.name, b, r) for p in self._pools.values() for b, r in p.regions.items()]

    def close(self) -> None:
        """Close every pool (and region); idempotent."""
        if self._closed:
            return
        self._closed = True
        errors = [e for e in map(_close, self._pools.values()) if e is not None]
        if errors:
            raise errors[0]

    def __enter__(self) -> HostGroup:
        return self

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ", ".join(repr(p) for p in self._pools.values())
        return f"<HostGroup {self.host_memory}: {state}>"


def materialise_host_group(
    plan: HostGroupPlan, *, device: str = "cpu", huge_pages: bool = False
) -> HostGroup:
    """Map every pool of ``plan`` on the group's host memory (``plan.host_memory``).

    ``device`` is where the pools' bytes will be copied to (it decides pinning under
    ``pinned=auto``); ``huge_pages`` asks for transparent huge pages (anonymous memory only).
    Each buffer gets one region of exactly its size, viewed in its layout without a copy. On
    any failure every region opened so far is closed before the error propagates.
    """
    if not isinstance(plan, HostGroupPlan):
        raise ConfigError(f"expected a HostGroupPlan, got {type(plan).__name__}")
    memory = plan.host_memory
    built: list[tuple[PoolPlan, dict[str, HostRegion], dict[str, torch.Tensor]]] = []
    opened: list[HostRegion] = []
    try:
        for pool in plan.pools:
            regions: dict[str, HostRegion] = {}
            buffers: dict[str, torch.Tensor] = {}
            shapes = pool.host_buffer_shapes()
            for spec in pool.geometry.buffers:
                shape = shapes[spec.name]
                dtype = torch_dtype(spec.dtype)
                nbytes = math.prod(shape) * spec.dtype.itemsize
                if nbytes == 0:
                    buffers[spec.name] = torch.empty(shape, dtype=dtype)
                    continue
                region = open_region(
                    memory,
                    nbytes,
                    device=device,
                    row_bytes=nbytes // _row_count(pool),
                    huge_pages=huge_pages,
                )
                opened.append(region)
                if region.kind != memory.kind:
                    raise AllocatorMismatchError(
                        f"pool {pool.name.value!r} buffer {spec.name!r} got a {region.kind} "
                        f"region, but its group's host memory is {memory.kind}"
                    )
                if region.nbytes < nbytes:
                    raise HostMemoryError(
                        f"pool {pool.name.value!r} buffer {spec.name!r}: region holds "
                        f"{region.nbytes} B, {nbytes} B were asked"
                    )
                flat = region.tensor()[:nbytes]
                buffers[spec.name] = flat.view(dtype).view(shape)
                regions[spec.name] = region
            built.append((pool, regions, buffers))
        allocator = GroupAllocator(plan)
    except BaseException:
        built.clear()
        for region in reversed(opened):
            _close(region)  # the original error is what the caller needs to see
        raise
    pools = {
        pool.name: HostPool(
            pool, regions=regions, buffers=buffers, allocator=allocator.allocator(pool.name)
        )
        for pool, regions, buffers in built
    }
    return HostGroup(plan, pools, allocator)


__all__ = ["HostGroup", "HostPool", "materialise_host_group"]
