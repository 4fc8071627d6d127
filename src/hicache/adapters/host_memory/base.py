"""The host memory port that every host memory adapter implements.

- HostRegion: one exact-size host mapping (anonymous, shared or store-owned), optionally pinned,
  viewable as a torch uint8 tensor without a copy; closes idempotently.
- check_nbytes: the one size check every region constructor applies (a positive int, no bool).
"""

from __future__ import annotations

import abc
from types import TracebackType
from typing import TypeVar

import torch

from hicache.domain import ConfigError, HostMemoryError, MemoryKind


def check_nbytes(nbytes: object, what: str = "host region size") -> int:
    """``nbytes`` as an int if it is a positive integer, else a ConfigError naming it."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ConfigError(f"{what} must be a positive integer number of bytes, got {nbytes!r}")
    return nbytes


_Region = TypeVar("_Region", bound="HostRegion")


class HostRegion(abc.ABC):
    """One exact-size region of host memory.

    Subclasses: AnonymousRegion, ShmRegion, StoreRegion, and PinnedRegion (which page-locks any
    of the others). Closing is idempotent; tensors that still view a closed region keep the bytes
    mapped until they are gone, but must not be used for transfers.
    """

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

    @property
    def shm_name(self) -> str | None:
        """The POSIX shared-memory segment name another process attaches to, or None."""
        return None

    def __enter__(self: _Region) -> _Region:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ViewedRegion(HostRegion):
    """A region whose bytes one tensor views: the accessors every unpinned kind shares.

    Subclasses set ``_tensor`` (None once closed), ``_address`` and ``_label`` (how error
    messages name the region) and implement ``close``.
    """

    _tensor: torch.Tensor | None
    _address: int
    _label: str

    @property
    def address(self) -> int:
        if self._tensor is None:
            raise HostMemoryError(f"{self._label} is closed: it has no address")
        return self._address

    @property
    def pinned(self) -> bool:
        return False

    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise HostMemoryError(f"{self._label} is closed")
        return self._tensor

    @property
    def closed(self) -> bool:
        return self._tensor is None
