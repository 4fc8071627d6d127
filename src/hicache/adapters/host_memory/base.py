"""The host memory port that every host memory adapter implements.

- HostRegion: one exact-size host mapping (anonymous, shared or store-owned), optionally pinned,
  viewable as a torch uint8 tensor without a copy; closes idempotently.
"""

from __future__ import annotations

import abc
from types import TracebackType

import torch

from hicache.domain import MemoryKind


class HostRegion(abc.ABC):
    """One exact-size region of host memory. Subclasses: AnonymousRegion, ShmRegion, StoreRegion."""

    kind: MemoryKind
    nbytes: int

    @property
    @abc.abstractmethod
    def address(self) -> int:
        """The virtual address of the first byte (for registration and zero-copy page views)."""

    @property
    @abc.abstractmethod
    def pinned(self) -> bool:
        """Whether the region is page-locked for the GPU's copy engines."""

    @abc.abstractmethod
    def tensor(self) -> torch.Tensor:
        """The whole region as a 1-D torch.uint8 CPU tensor that shares its memory (no copy)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unpin and unmap; idempotent. Tensors viewing the region must not be used afterwards."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool: ...

    def __enter__(self) -> HostRegion:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
