"""What ``HiCache.match`` returns and what ``HiCache.load`` returns.

- CacheMatch: the agreed hit of one request (device, host and storage pages at a boundary every
  pool and every TP rank can restore), holding pins on the pages it will use until it is
  released (``release()``, ``with match:`` / ``async with match:``). A match the caller drops
  without releasing is released by the face at its next call (a weakref finalizer queues it).
- CacheLoad: a load of the host part of a hit into device pages; per-layer waits
  (``wait_layer`` / ``wait_model_layer`` / ``wait_layer_ready``) as the engine's LoadHandle;
  ``wait()`` returns once the pages are registered on the device tier (or raises
  TransferError, after the slots and pins are back); ``cancel()``.
- MatchPins: the pins a match holds (keys per tier), shared with the face's finalizer queue.
- MatchOwner: what a CacheMatch asks of the face that made it (its load pools, device
  placements, the release of its pins).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio
import attrs

from hicache.cache.work import pool_counts
from hicache.domain.errors import CacheStateError, TransferError
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue
from hicache.domain.pools import PoolName
from hicache.domain.tiers import Tier
from hicache.engine.handles import LoadHandle
from hicache.engine.stats import OperationState


class MatchOwner(Protocol):
    """What a CacheMatch asks of the face that made it."""

    def load_pools(self, match: CacheMatch) -> list[frozenset[PoolName]]: ...

    def device_placements(self, match: CacheMatch) -> list[dict[PoolName, int]]: ...

    def release_pins(self, pins: MatchPins) -> None: ...


@attrs.define
class MatchPins:
    """Keys a match pinned, per tier (DEVICE, HOST); ``released`` once given back."""

    device: list[bytes] = attrs.field(factory=list)
    host: list[bytes] = attrs.field(factory=list)
    released: bool = False
    loading: bool = False


class CacheMatch:
    """The hit of one request. Pages counts are cumulative: device <= host <= storage.

    ``device_pages``: already on the device; ``host_pages``: restorable by ``load`` (device or
    host); ``storage_pages``: also counting what a prefetch may bring from storage (a hint).
    ``sources[i]`` says where page i of the host hit comes from (DEVICE or HOST: a page partly
    on the device is HOST, its load copies only the pools missing there) and
    ``needed[i]`` which slot-owning pools page i must restore (hybrid groups: the anchor on every
    page, a window pool on the window's pages, a state pool at the last page only).
    """

    def __init__(
        self,
        cache: MatchOwner,
        *,
        keys: Sequence[bytes],
        tokens: int,
        page_size: int,
        device_pages: int,
        host_pages: int,
        storage_pages: int,
        sources: Sequence[Tier],
        needed: Sequence[frozenset[PoolName]],
        pins: MatchPins,
        on_drop: Callable[[MatchPins], None],
    ) -> None:
        self._cache = cache
        self.keys = tuple(keys)
        self.tokens = tokens
        self.page_size = page_size
        self.device_pages = device_pages
        self.host_pages = host_pages
        self.storage_pages = storage_pages
        self.sources = tuple(sources)
        self.needed = tuple(needed)
        self._pins = pins
        self._load: CacheLoad | None = None
        self._calling = False  # a ``load`` call of this match is running (before its CacheLoad)
        weakref.finalize(self, on_drop, pins)

    @property
    def device_tokens(self) -> int:
        return self.device_pages * self.page_size

    @property
    def host_tokens(self) -> int:
        return self.host_pages * self.page_size

    @property
    def storage_tokens(self) -> int:
        return self.storage_pages * self.page_size

    @property
    def pins(self) -> MatchPins:
        return self._pins

    @property
    def released(self) -> bool:
        return self._pins.released

    @property
    def loaded(self) -> bool:
        """Whether every page of the host hit is on the device (nothing to load, or loaded)."""
        return all(s is Tier.DEVICE for s in self.sources)

    def load_counts(self) -> dict[PoolName, int]:
        """Device pages per pool that ``load`` needs (for framework-owned device pages)."""
        return pool_counts(self._cache.load_pools(self))

    def placements(self) -> list[dict[PoolName, int]]:
        """Device page ids of the hit's pages, per page, for the pools each page restores.

        Complete once the match is loaded (``loaded``); before, pages still on host are absent.
        """
        return self._cache.device_placements(self)

    def release(self) -> None:
        """Give the match's pins back (idempotent). A load in flight keeps its own pins and
        settles on its own; its pages are then unpinned."""
        self._cache.release_pins(self._pins)

    def set_sources(self, sources: Sequence[Tier]) -> None:
        self.sources = tuple(sources)

    @property
    def loading(self) -> bool:
        """Whether a load of this match is running (its call, or its copy not settled yet)."""
        return self._calling or (self._load is not None and not self._load.finished)

    def attach(self, load: CacheLoad) -> None:
        if self._load is not None and not self._load.finished:
            raise CacheStateError("this match is being loaded already")
        self._load = load

    def __enter__(self) -> CacheMatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    async def __aenter__(self) -> CacheMatch:
        return self

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
        if exc is not None and self._load is not None and not self._load.finished:
            with anyio.CancelScope(shield=True):
                await self._load.cancel()
        self.release()

    def __repr__(self) -> str:
        state = "released" if self.released else "pinned"
        return (
            f"<CacheMatch {self.tokens} tokens: device {self.device_tokens}, host "
            f"{self.host_tokens}, storage {self.storage_tokens} ({state})>"
        )


class CacheLoad:
    """A load of a match's host pages; ``handle`` is None when nothing had to be copied."""

    def __init__(
        self, match: CacheMatch, handle: LoadHandle | None, *, starting: bool = False
    ) -> None:
        self.match = match
        self.handle = handle
        self._settled = anyio.Event()
        self._error: BaseException | None = None
        # ``starting``: registered before the engine's copy is issued (the face sets ``handle``
        # then), so that another request's load waits for it instead of preparing it twice.
        if handle is None and not starting:
            self._settled.set()

    # -- the face settles it ------------------------------------------------------------------
    def settle(self, error: BaseException | None) -> None:
        self._error = error
        self._settled.set()

    async def settled(self) -> None:
        """Wait until the face finished with this load (registered or rolled back)."""
        await self._settled.wait()

    @property
    def finished(self) -> bool:
        return self._settled.is_set()

    @property
    def ok(self) -> bool:
        return self._settled.is_set() and self._error is None

    @property
    def state(self) -> OperationState:
        if self.handle is None:
            return OperationState.DONE
        return self.handle.state

    # -- per layer ------------------------------------------------------------------------------
    def wait_layer(self, layer: int) -> None:
        """Before the forward pass reads transfer layer ``layer`` (any thread)."""
        if self.handle is not None:
            self.handle.wait_layer(layer)

    def wait_model_layer(self, model_layer: int) -> None:
        if self.handle is not None:
            self.handle.wait_model_layer(model_layer)

    async def wait_layer_ready(self, layer: int) -> None:
        if self.handle is not None:
            await self.handle.wait_layer_ready(layer)
        else:
            await anyio.lowlevel.checkpoint()

    # -- whole load -----------------------------------------------------------------------------
    async def wait(self) -> None:
        """Wait until the pages are on the device and registered; TransferError if it failed."""
        if self.handle is not None:
            # A failure is reported below, once the face has cleaned up.
            with contextlib.suppress(TransferError):
                await self.handle.wait()
        with anyio.CancelScope(shield=self.handle is not None and self.handle.done()):
            await self._settled.wait()
        if self._error is not None:
            if isinstance(self._error, TransferError):
                raise self._error
            raise TransferError(f"the load of {self.match!r} did not finish: {self._error!r}")

    async def cancel(self) -> None:
        """Give the load up; slots and pins come back; the match keeps its other pins."""
        if self.handle is not None:
            await self.handle.cancel()
        with anyio.CancelScope(shield=True):
            await self._settled.wait()

    async def __aenter__(self) -> CacheLoad:
        return self

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
        if exc is None:
            await self.wait()
        else:
            with anyio.CancelScope(shield=True):
                await self.cancel()

    def __repr__(self) -> str:
        return f"<CacheLoad {self.state.value} of {self.match!r}>"
