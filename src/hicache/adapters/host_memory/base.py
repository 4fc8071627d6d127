"""The host memory port that every host memory adapter implements.

- HostRegion: one exact-size host mapping (anonymous, shared or store-owned), optionally pinned,
  viewable as a torch uint8 tensor without a copy; closes idempotently.
- check_nbytes: the one size check every region constructor applies (a positive int, no bool).
- release_range: give a mapped range's memory back at close even while tensors still view it
  (an inaccessible placeholder mapping replaces it until the last view goes).
"""

from __future__ import annotations

import abc
import ctypes
import mmap
import os
from typing import Any, TypeVar

import torch

from hicache.domain import ConfigError, HostMemoryError, MemoryKind
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue


def check_nbytes(nbytes: object, what: str = "host region size") -> int:
    """``nbytes`` as an int if it is a positive integer, else a ConfigError naming it."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
        raise ConfigError(f"{what} must be a positive integer number of bytes, got {nbytes!r}")
    return nbytes


_PROT_NONE = 0
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_MAP_FAILED = ctypes.c_void_p(-1).value


def _libc_mmap() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = libc.mmap
    fn.restype = ctypes.c_void_p
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    return fn


_mmap_fn = _libc_mmap()


def release_range(address: int, nbytes: int) -> None:
    """Replace ``[address, address + nbytes)`` with an inaccessible, unbacked placeholder.

    The pages of the old mapping (anonymous memory, or a shared segment's pages in this process)
    are given back at once, whoever still holds a tensor viewing them: the Python mmap object
    that owns the range munmaps the placeholder when its last view is gone, and nothing else can
    be mapped there before. A stale view that is still used after close faults (SIGSEGV) instead
    of reading memory of someone else. Call it before dropping the mmap object.
    """
    length = -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE
    flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
    got = _mmap_fn(address, length, _PROT_NONE, flags, -1, 0)
    if got == _MAP_FAILED or got != address:
        err = ctypes.get_errno()
        raise HostMemoryError(
            f"cannot release {length} B of host memory at 0x{address:x}: "
            f"{os.strerror(err)} (errno {err})"
        )


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

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
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
