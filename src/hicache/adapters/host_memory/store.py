"""Store-owned host memory: the port through which a storage adapter hands over memory it owns.

- StoreBuffer: what a store hands over: an address, a size and a uint8 CPU tensor viewing it
  (a HostRegion satisfies it).
- StoreMemoryProvider: a storage adapter (Mooncake, in a later issue) that allocates host
  memory it keeps owning (e.g. registered for zero-copy RDMA) and takes it back on release.
- register_store_provider / unregister_store_provider / store_provider: the registry, keyed by
  store name ("mooncake" serves the host memory kind "store:mooncake").
- StoreRegion: the HostRegion over one buffer a store handed over; close() gives it back.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch

from hicache.adapters.host_memory.base import ViewedRegion, check_nbytes
from hicache.domain import ConfigError, HiCacheError, HostMemoryError, MemoryKind
from hicache.domain.host_memory import STORE_PREFIX


class StoreBuffer(Protocol):
    """Host memory a store owns: ``tensor()`` is a 1-D uint8 CPU tensor at ``address``."""

    @property
    def address(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    def tensor(self) -> torch.Tensor: ...


class StoreMemoryProvider(Protocol):
    """A storage adapter that lends hicache host memory and keeps owning it."""

    def allocate(self, nbytes: int) -> StoreBuffer:
        """At least ``nbytes`` of host memory; the store keeps ownership."""
        ...

    def release(self, buffer: StoreBuffer) -> None:
        """Take back a buffer that ``allocate`` handed over; hicache no longer uses it."""
        ...


class _Registry:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._providers: dict[str, StoreMemoryProvider] = {}

    def register(self, store: str, provider: StoreMemoryProvider) -> None:
        _store_kind(store)
        with self._lock:
            current = self._providers.get(store)
            if current is not None and current is not provider:
                raise ConfigError(
                    f"store {store!r} already has a host memory provider ({current!r}); "
                    "unregister it first"
                )
            self._providers[store] = provider

    def unregister(self, store: str) -> bool:
        with self._lock:
            return self._providers.pop(store, None) is not None

    def get(self, store: str) -> StoreMemoryProvider:
        with self._lock:
            provider = self._providers.get(store)
            known = sorted(self._providers)
        if provider is None:
            raise HostMemoryError(
                f"host memory of kind store:{store} was asked for but no provider is registered "
                f"for store {store!r} (registered: {', '.join(known) or 'none'}): open the "
                f"{store} store adapter first (it calls "
                "hicache.adapters.host_memory.register_store_provider), or choose the "
                "anonymous or shm allocator"
            )
        return provider


_registry = _Registry()


def _store_kind(store: object) -> MemoryKind:
    if not isinstance(store, str) or not store:
        raise ConfigError(f"store name must be a non-empty string, got {store!r}")
    return MemoryKind(STORE_PREFIX + store)  # rejects stores that own no host memory


def register_store_provider(store: str, provider: StoreMemoryProvider) -> None:
    """Let ``provider`` serve host memory of kind ``store:<store>`` (e.g. "mooncake")."""
    _registry.register(store, provider)


def unregister_store_provider(store: str) -> bool:
    """Forget the provider of ``store``; whether one was registered. Open regions stay valid."""
    return _registry.unregister(store)


def store_provider(store: str) -> StoreMemoryProvider:
    """The provider registered for ``store``, or a HostMemoryError saying what to do."""
    return _registry.get(store)


class StoreRegion(ViewedRegion):
    """Exactly ``nbytes`` of a buffer a store handed over; close() hands it back."""

    def __init__(
        self, store: str, provider: StoreMemoryProvider, buffer: StoreBuffer, view: torch.Tensor
    ) -> None:
        # Use StoreRegion.allocate; this only takes ownership of a checked buffer.
        self.kind = _store_kind(store)
        self.store = store
        self.nbytes = int(view.numel())
        self._provider = provider
        self._buffer: StoreBuffer | None = buffer
        self._tensor = view
        self._address = int(view.data_ptr())
        self._label = f"store:{store} host region"

    @classmethod
    def allocate(cls, store: str, nbytes: int) -> StoreRegion:
        """Ask the provider registered for ``store`` for ``nbytes`` of host memory."""
        _store_kind(store)
        check_nbytes(nbytes)
        provider = store_provider(store)
        try:
            buffer = provider.allocate(nbytes)
        except HiCacheError:
            raise
        except Exception as e:
            raise HostMemoryError(
                f"store {store!r} could not hand over {nbytes} B of host memory: {e}"
            ) from e
        try:
            view = _checked_view(store, buffer, nbytes)
        except BaseException:
            provider.release(buffer)
            raise
        return cls(store, provider, buffer, view)

    @property
    def closed(self) -> bool:
        return self._buffer is None

    def close(self) -> None:
        """Hand the buffer back to its store. Idempotent."""
        if self._buffer is None:
            return
        buffer, self._buffer, self._tensor = self._buffer, None, None
        try:
            self._provider.release(buffer)
        except HiCacheError:
            raise
        except Exception as e:
            raise HostMemoryError(
                f"store {self.store!r} failed to take back {self.nbytes} B of host memory: {e}"
            ) from e

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"at 0x{self._address:x}"
        return f"<StoreRegion store:{self.store} {self.nbytes} B {state}>"


def _checked_view(store: str, buffer: StoreBuffer, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of the buffer's tensor, after checking it is what the port says."""
    t = buffer.tensor()
    problems = []
    if buffer.nbytes < nbytes:
        problems.append(f"it holds {buffer.nbytes} B, fewer than the {nbytes} B asked for")
    if t.dtype != torch.uint8 or t.dim() != 1 or t.device.type != "cpu" or not t.is_contiguous():
        problems.append(
            f"its tensor is {t.dtype} {tuple(t.shape)} on {t.device}, expected a contiguous "
            "1-D torch.uint8 CPU tensor"
        )
    elif t.numel() < nbytes:
        problems.append(f"its tensor has {t.numel()} elements, fewer than {nbytes}")
    if int(t.data_ptr()) != int(buffer.address):
        problems.append(
            f"its tensor starts at 0x{int(t.data_ptr()):x}, not at its address "
            f"0x{int(buffer.address):x}"
        )
    if problems:
        raise HostMemoryError(
            f"store {store!r} handed over an unusable host buffer: {'; '.join(problems)}"
        )
    return t[:nbytes]
