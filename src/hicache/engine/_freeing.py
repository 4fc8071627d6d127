"""Page sets in and out of the engine (private): checking what callers pass, giving pages back.

- Freeing: the part of TransferEngine that normalises the page sets a caller passes (slot-owning
  pools of the plan, valid ids, allocated pages, host and device paired) and frees host or
  device pages on request, refusing pinned ones (``free_host`` / ``free_device``).
"""

from __future__ import annotations

from hicache.domain.errors import ConfigError
from hicache.domain.pools import PoolName
from hicache.domain.slots import GroupAllocator
from hicache.engine._pages import PageDict, PageSet, check_pairing, normalise_pages
from hicache.engine._settling import Settling, _Life


class Freeing(Settling):
    """Page checks and frees; TransferEngine sets the state declared here and in Settling."""

    _framework_device: bool
    _owners: tuple[PoolName, ...]
    _sidecars: tuple[PoolName, ...]
    _anchor: PoolName

    # ---------------------------------------------------------------------------------------
    # freeing pages
    # ---------------------------------------------------------------------------------------
    def free_host(self, pages: PageSet) -> None:
        """Return host pages to their allocator; raises PinnedPageError for pinned pages."""
        self._sweep_if_open()
        hp = self._pages(pages, "host", self._host_slots, allocated=False)
        self._host_pins.check_unpinned(hp, action="free")
        self._host_slots.free(hp)

    def free_device(self, pages: PageSet) -> None:
        """Return device pages to their allocator; raises PinnedPageError for pinned pages."""
        if self._framework_device:
            raise ConfigError(
                f"engine {self._name!r} does not own device pages (device_ownership="
                f"'framework'): the framework's allocator frees them"
            )
        self._sweep_if_open()
        dp = self._pages(pages, "device", self._device_slots, allocated=False)
        self._device_pins.check_unpinned(dp, action="free")
        self._device_slots.free(dp)

    def _sweep_if_open(self) -> None:
        if self._life in (_Life.OPEN, _Life.CLOSING):
            self._sweep()

    # ---------------------------------------------------------------------------------------
    # input checks and page maps
    # ---------------------------------------------------------------------------------------
    def _pages(
        self, pages: PageSet, side: str, slots: GroupAllocator, *, allocated: bool = True
    ) -> PageDict:
        """Normalise a page set: slot-owning pools of this plan, valid ids, allocated pages."""
        return normalise_pages(
            pages,
            side,
            slots,
            owners=self._owners,
            sidecars=self._sidecars,
            anchor=self._anchor,
            allocated=allocated,
        )

    def _device_pages(self, pages: PageSet) -> PageDict:
        """Device pages: allocated in the engine's allocator, or any in range if the framework's."""
        return self._pages(
            pages, "device", self._device_slots, allocated=not self._framework_device
        )

    _check_pairing = staticmethod(check_pairing)
