"""Anonymous host memory: an exact-size private mmap, pre-faulted, viewed as a torch tensor.

- AnonymousRegion: the region; AnonymousRegion.allocate(nbytes) maps and pre-faults it.
"""

from __future__ import annotations

import mmap

import torch

from hicache.adapters.host_memory.base import HostRegion
from hicache.domain import ConfigError, HostMemoryError, MemoryKind


class AnonymousRegion(HostRegion):
    def __init__(self, nbytes: int) -> None:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigError(f"host region size must be a positive integer, got {nbytes!r}")
        try:
            self._mmap: mmap.mmap | None = mmap.mmap(
                -1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
            )
        except OSError as e:
            raise HostMemoryError(f"cannot map {nbytes} B of anonymous memory: {e}") from e
        self.kind = MemoryKind("anonymous")
        self.nbytes = nbytes
        self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._tensor.fill_(0)  # pre-fault every page now, not on the first copy

    @classmethod
    def allocate(cls, nbytes: int) -> AnonymousRegion:
        return cls(nbytes)

    @property
    def address(self) -> int:
        return int(self._tensor.data_ptr())

    @property
    def pinned(self) -> bool:
        return False

    def tensor(self) -> torch.Tensor:
        if self._mmap is None:
            raise HostMemoryError("host region is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def close(self) -> None:
        if self._mmap is None:
            return
        m, self._mmap = self._mmap, None
        del self._tensor
        try:
            m.close()
        except BufferError:
            # Views are still alive somewhere; the mapping goes when the last one does.
            pass
