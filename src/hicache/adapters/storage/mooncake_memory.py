"""Host memory owned by a Mooncake store: what "store:mooncake" regions are made of.

- MooncakeMemoryProvider: the StoreMemoryProvider of one MooncakeStore: it maps anonymous host
  memory, registers it with the store's transfer engine (zero-copy for TCP and RDMA) and
  unregisters and unmaps it when hicache hands it back.
- provide_host_memory: register a store's provider under "mooncake", so that every pool of a
  group whose settings resolve to store:mooncake gets registered memory through open_region;
  returns a callable that withdraws it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Protocol

from hicache.adapters.host_memory import (
    AnonymousRegion,
    StoreBuffer,
    register_store_provider,
    store_provider,
    unregister_store_provider,
)
from hicache.domain import HostMemoryError

STORE = "mooncake"


class _Registering(Protocol):
    """The slice of MooncakeStore the provider needs."""

    def register(self, regions: list[memoryview]) -> None: ...
    def unregister(self, address: int) -> None: ...


class MooncakeMemoryProvider:
    """Lends hicache anonymous host memory that one Mooncake store has registered."""

    def __init__(self, store: _Registering) -> None:
        self._store = store
        self._lock = threading.Lock()
        self._lent: dict[int, AnonymousRegion] = {}

    @property
    def lent(self) -> int:
        """How many buffers hicache holds now."""
        with self._lock:
            return len(self._lent)

    def allocate(self, nbytes: int) -> StoreBuffer:
        region = AnonymousRegion.allocate(nbytes)
        try:
            self._store.register([region_view(region)])
        except BaseException:
            region.close()
            raise
        with self._lock:
            self._lent[region.address] = region
        return region

    def release(self, buffer: StoreBuffer) -> None:
        with self._lock:
            region = self._lent.pop(buffer.address, None)
        if region is None:
            raise HostMemoryError(
                f"the Mooncake store was handed back a buffer at 0x{buffer.address:x} that it "
                "did not lend"
            )
        try:
            self._store.unregister(region.address)
        finally:
            region.close()


def region_view(region: AnonymousRegion) -> memoryview:
    """A writable memoryview of a region's bytes (no copy)."""
    view: memoryview = region.tensor().numpy().data
    return view


def provide_host_memory(store: _Registering) -> Callable[[], None]:
    """Serve host memory of kind store:mooncake from ``store``; returns the withdrawal.

    ConfigError when another Mooncake store already serves it. Regions already lent stay
    valid after the withdrawal and are unregistered when they are closed.
    """
    provider = MooncakeMemoryProvider(store)
    register_store_provider(STORE, provider)

    def withdraw() -> None:
        try:
            current = store_provider(STORE)
        except HostMemoryError:
            return
        if current is provider:
            unregister_store_provider(STORE)

    return withdraw
