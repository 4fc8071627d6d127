"""Anonymous host memory: an exact-size private mmap, pre-faulted, viewed as a torch tensor.

- AnonymousRegion: the region; AnonymousRegion.allocate(nbytes, huge_pages=...) maps and
  pre-faults exactly ``nbytes`` (no rounding beyond the last 4 KiB page).
- prefault: fault every page of a mapping in now (MADV_POPULATE_WRITE/READ, else one access per
  page), so that the first copy into the region does not pay 2 us per page.
- MADV_POPULATE_READ / MADV_POPULATE_WRITE / MADV_HUGEPAGE: the Linux madvise values, for
  Pythons whose mmap module lacks the constants (3.11 has no MADV_POPULATE_*).
"""

from __future__ import annotations

import errno
import mmap

import torch

from hicache.adapters.host_memory.base import ViewedRegion, check_nbytes, release_range
from hicache.domain import ConfigError, HostMemoryError, MemoryKind

PAGE_BYTES = mmap.PAGESIZE
MADV_POPULATE_READ: int = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux 5.14+
MADV_POPULATE_WRITE: int = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
MADV_HUGEPAGE: int = getattr(mmap, "MADV_HUGEPAGE", 14)


def prefault(mapping: mmap.mmap, view: torch.Tensor, *, write: bool = True) -> str:
    """Fault in every page of ``mapping`` (``view`` is its uint8 tensor); returns the method used.

    ``write=True`` allocates private pages (for fresh memory whose content does not matter yet);
    ``write=False`` only maps existing pages and never changes a byte (for attaching to shared
    memory that holds data). The kernel call is used where it exists ("populate"); on kernels
    older than 5.14 one byte per page is touched ("touch"). Running out of memory is an error,
    never a fallback: touching pages would get the process killed instead.
    """
    advice = MADV_POPULATE_WRITE if write else MADV_POPULATE_READ
    error = _madvise(mapping, advice)
    while isinstance(error, InterruptedError):
        error = _madvise(mapping, advice)
    if error is None:
        return "populate"
    if error.errno != errno.EINVAL:
        raise HostMemoryError(
            f"cannot pre-fault {len(mapping)} B of host memory: {error.strerror} "
            f"(errno {error.errno}); is there enough free memory?"
        ) from error
    # This kernel has no MADV_POPULATE_* (older than 5.14): touch the pages instead.
    pages = view[::PAGE_BYTES]
    if write:
        pages.fill_(0)
    else:
        pages.sum()  # a read per page maps it without changing a byte
    return "touch"


def _madvise(mapping: mmap.mmap, advice: int) -> OSError | None:
    try:
        mapping.madvise(advice)
    except OSError as e:
        return e
    return None


class AnonymousRegion(ViewedRegion):
    """Private anonymous memory of exactly ``nbytes``, pre-faulted, optionally on huge pages."""

    def __init__(self, nbytes: int, *, huge_pages: bool = False) -> None:
        check_nbytes(nbytes)
        if not isinstance(huge_pages, bool):
            raise ConfigError(f"huge_pages must be True or False, got {huge_pages!r}")
        try:
            mapping = mmap.mmap(
                -1,
                nbytes,
                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as e:
            raise HostMemoryError(
                f"cannot map {nbytes} B of anonymous memory: {e.strerror} (errno {e.errno})"
            ) from e
        try:
            if huge_pages:
                _advise_huge_pages(mapping)
            view = torch.frombuffer(mapping, dtype=torch.uint8)
            self.prefault_method = prefault(mapping, view, write=True)
        except BaseException:
            mapping.close()  # no view escaped: unmapping now is safe
            raise
        self.kind = MemoryKind("anonymous")
        self.nbytes = nbytes
        self.huge_pages = huge_pages
        self._mmap: mmap.mmap | None = mapping
        self._tensor = view
        self._address = int(view.data_ptr())
        self._label = "anonymous host region"

    @classmethod
    def allocate(cls, nbytes: int, *, huge_pages: bool = False) -> AnonymousRegion:
        """Map and pre-fault ``nbytes`` of private memory (transparent huge pages if asked)."""
        return cls(nbytes, huge_pages=huge_pages)

    def close(self) -> None:
        """Give the memory back now, even if tensors still view it (see release_range)."""
        if self._mmap is None:
            return
        release_range(self._address, self.nbytes)
        self._tensor = None
        self._mmap = None  # unmaps the placeholder once no view is left

    def __repr__(self) -> str:
        if self.closed:
            return f"<AnonymousRegion {self.nbytes} B closed>"
        huge = " huge_pages" if self.huge_pages else ""
        return f"<AnonymousRegion {self.nbytes} B at 0x{self._address:x}{huge}>"


def _advise_huge_pages(mapping: mmap.mmap) -> None:
    try:
        mapping.madvise(MADV_HUGEPAGE)
    except OSError as e:
        raise HostMemoryError(
            f"transparent huge pages were asked for but madvise(MADV_HUGEPAGE) failed: "
            f"{e.strerror} (errno {e.errno}); this kernel may lack THP: use huge_pages=False"
        ) from e
