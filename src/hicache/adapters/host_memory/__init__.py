"""Host memory adapters: anonymous, shared (POSIX shm), pinned, store-owned.

- open_region: the one factory from a group's resolved HostMemory (kind + pinning) to a region.
- should_pin: the pinning decision of open_region (on: must pin; off: never; auto: on a GPU).
- AnonymousRegion / ShmRegion / StoreRegion: the kinds; PinnedRegion page-locks any of them.
- list_segments / gc_segments / SegmentInfo: the shm segments under /dev/shm and their cleanup.
- register_store_provider / unregister_store_provider / StoreMemoryProvider: the store port.
"""

from __future__ import annotations

from hicache.adapters.devices import parse_device_name
from hicache.adapters.host_memory.anonymous import AnonymousRegion
from hicache.adapters.host_memory.base import HostRegion, check_nbytes
from hicache.adapters.host_memory.pinned import (
    MAX_CHUNK_BYTES,
    HostRegistrar,
    PinnedRegion,
    TorchCudaRegistrar,
    gpu_available,
    require_gpu,
)
from hicache.adapters.host_memory.shm import (
    SegmentInfo,
    ShmRegion,
    gc_segments,
    list_segments,
    remove_owned_segments,
)
from hicache.adapters.host_memory.store import (
    StoreBuffer,
    StoreMemoryProvider,
    StoreRegion,
    register_store_provider,
    store_provider,
    unregister_store_provider,
)
from hicache.domain import ConfigError, HostMemory, Pinning
from hicache.domain.errors import shown
from hicache.domain.host_memory import ANONYMOUS, SHM


def parse_device(device: str) -> tuple[bool, int | None]:
    """``device`` ("cpu", "cuda", "cuda:1", "rocm:0") as (is a GPU, device index or None)."""
    kind, index = parse_device_name(device)
    return kind != "cpu", index


def should_pin(pinning: Pinning, device: str) -> bool:
    """Whether open_region pins for ``device``; raises PinnedMemoryError for on without a GPU."""
    is_gpu, _ = parse_device(device)
    if pinning is Pinning.OFF:
        return False
    if pinning is Pinning.ON:
        require_gpu()
        return True
    return is_gpu and gpu_available()


def open_region(
    host_memory: HostMemory,
    nbytes: int,
    *,
    device: str = "cpu",
    row_bytes: int = 1,
    huge_pages: bool = False,
) -> HostRegion:
    """A region of exactly ``nbytes`` of the group's host memory kind, pinned per its policy.

    ``device`` is where the region's bytes will be copied to and from; ``row_bytes`` is the
    size of one page row (pinned chunks never split one); ``huge_pages`` asks for transparent
    huge pages (anonymous memory only). Nothing stays mapped or registered when this raises.
    """
    check_nbytes(nbytes)
    check_nbytes(row_bytes, "row_bytes (the bytes of one page row, the registration alignment)")
    if not isinstance(huge_pages, bool):
        raise ConfigError(f"huge_pages must be True or False, got {shown(huge_pages)}")
    kind = host_memory.kind
    if huge_pages and kind.name != ANONYMOUS:
        raise ConfigError(
            f"huge_pages applies to anonymous host memory only, not to {kind}: shm huge pages "
            "depend on the tmpfs mount (huge=), and a store owns its memory"
        )
    # Decide on pinning and reach the driver before mapping anything.
    _, index = parse_device(device)
    registrar = TorchCudaRegistrar(index) if should_pin(host_memory.pinned, device) else None
    region: HostRegion
    if kind.name == ANONYMOUS:
        region = AnonymousRegion.allocate(nbytes, huge_pages=huge_pages)
    elif kind.name == SHM:
        region = ShmRegion.create(nbytes)
    else:
        store = kind.store
        if store is None:  # MemoryKind admits nothing else; kept for a clear message
            raise ConfigError(f"host memory kind {kind} has no adapter")
        region = StoreRegion.allocate(store, nbytes)
    if registrar is None:
        return region
    try:
        return PinnedRegion.wrap(region, row_bytes=row_bytes, registrar=registrar)
    except BaseException:
        region.close()
        raise


__all__ = [
    "MAX_CHUNK_BYTES",
    "AnonymousRegion",
    "HostRegion",
    "HostRegistrar",
    "PinnedRegion",
    "SegmentInfo",
    "ShmRegion",
    "StoreBuffer",
    "StoreMemoryProvider",
    "StoreRegion",
    "TorchCudaRegistrar",
    "gc_segments",
    "gpu_available",
    "list_segments",
    "open_region",
    "parse_device",
    "register_store_provider",
    "remove_owned_segments",
    "should_pin",
    "store_provider",
    "unregister_store_provider",
]
