"""Host memory adapters: anonymous, shared (POSIX shm), pinned, store-owned.

- open_region: the one factory from a resolved HostMemory to a HostRegion.
"""

from __future__ import annotations

from hicache.adapters.host_memory.anonymous import AnonymousRegion
from hicache.adapters.host_memory.base import HostRegion
from hicache.domain import HostMemory, HostMemoryError


def open_region(host_memory: HostMemory, nbytes: int, *, device: str = "cpu") -> HostRegion:
    """A region of ``nbytes`` of the group's resolved host memory kind (pinning per its policy)."""
    if host_memory.kind.name == "anonymous":
        return AnonymousRegion.allocate(nbytes)
    raise HostMemoryError(f"host memory kind {host_memory.kind.name!r} is not available yet")


__all__ = ["AnonymousRegion", "HostRegion", "open_region"]
