"""The synchronous face: the engine hosted on its own event-loop thread, for synchronous schedulers.

- SyncEngine: opens a TransferEngine on a dedicated event-loop thread (an anyio blocking
  portal); blocking calls (``load``, ``backup``, ``prepare_*`` + ``submit``, ``free_*``,
  ``statistics``, ``close``) and future-returning ones (``load_future``, ``backup_future``:
  concurrent.futures.Future) from any thread.
- SyncLoadHandle / SyncBackupHandle / SyncLayerwiseBackupHandle: the async handles seen from a
  plain thread: ``wait`` blocks, ``wait_future`` returns a Future (cancelling it cancels the
  operation), ``cancel`` blocks until slots and pins are back; ``wait_layer`` /
  ``wait_model_layer`` and ``layer_computed`` run on the calling (forward-pass) thread as in
  the async face.

Every guarantee of the async engine holds because every engine call still runs on the engine's
own loop: loads prepared between two ``submit()`` calls merge into one submission, loads of the
same host pages share one transfer, and cancellation returns slots and pins (see docs/sync.md).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Generator
from concurrent.futures import Future
from typing import Any, TypeVar

import anyio
import anyio.abc
from anyio.from_thread import BlockingPortal, start_blocking_portal

from hicache.domain.errors import ConfigError, EngineClosedError, shown
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue
from hicache.domain.limits import MAX_SECONDS, is_finite_number
from hicache.domain.pools import HostGroupPlan, PoolName
from hicache.engine.engine import PageSet, TransferEngine
from hicache.engine.handles import BackupHandle, LayerwiseBackupHandle, LoadHandle
from hicache.engine.stats import EngineStatistics, OperationState, OperationStatistics

T = TypeVar("T")


class _SyncHandle:
    """A handle of the async engine, driven from a plain thread through the engine's loop."""

    def __init__(self, portal: BlockingPortal, handle: LoadHandle | BackupHandle) -> None:
        self._portal = portal
        self.handle = handle  # the async handle, for code that runs on the engine's loop

    @property
    def id(self) -> int:
        return self.handle.id

    @property
    def joined(self) -> bool:
        return self.handle.joined

    @property
    def state(self) -> OperationState:
        return self.handle.state

    @property
    def host_pages(self) -> dict[PoolName, tuple[int, ...]]:
        return self.handle.host_pages

    @property
    def device_pages(self) -> dict[PoolName, tuple[int, ...]]:
        return self.handle.device_pages

    def done(self) -> bool:
        return self.handle.done()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the operation finished; TransferError if it failed or was cancelled.

        With ``timeout``, TimeoutError after that many seconds: the wait is then cancelled,
        which cancels the operation (as a cancelled async wait does).
        """
        if timeout is not None and (
            not is_finite_number(timeout) or not 0 <= timeout <= MAX_SECONDS
        ):
            # A NaN time-out would expire at once and cancel the operation, and one past a thread
            # wait's range would raise OverflowError once the wait started: refused instead.
            raise ConfigError(
                f"wait: timeout must be None or a finite number of seconds in [0, "
                f"{MAX_SECONDS:g}], got {shown(timeout)}"
            )
        future = self.wait_future()
        try:
            future.result(timeout)
        except TimeoutError:
            future.cancel()
            self.cancel()
            raise

    def wait_future(self) -> Future[None]:
        """A Future of the whole operation; cancelling it cancels the operation."""
        return self._portal.start_task_soon(self.handle.wait)

    def cancel(self) -> None:
        """Give the operation up; returns once its slots and pins are back (idempotent)."""
        self._portal.call(self.handle.cancel)

    def statistics(self) -> OperationStatistics:
        return self._portal.call(self.handle.statistics)

    def __enter__(self) -> _SyncHandle:
        return self

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
        if exc is None:
            self.wait()
        else:
            self.cancel()

    def __repr__(self) -> str:
        return f"<Sync{self.handle!r}>"


class SyncLoadHandle(_SyncHandle):
    """A load seen from a plain thread; per-layer waits run on the forward-pass thread."""

    def __init__(self, portal: BlockingPortal, handle: LoadHandle) -> None:
        super().__init__(portal, handle)
        self._load = handle

    def wait_layer(self, layer: int) -> None:
        self._load.wait_layer(layer)

    def wait_model_layer(self, model_layer: int) -> None:
        self._load.wait_model_layer(model_layer)


class SyncBackupHandle(_SyncHandle):
    """An all-layer backup seen from a plain thread."""


class SyncLayerwiseBackupHandle(SyncBackupHandle):
    """A layer-wise backup; ``layer_computed`` runs on the forward-pass thread."""

    def __init__(self, portal: BlockingPortal, handle: LayerwiseBackupHandle) -> None:
        super().__init__(portal, handle)
        self._layerwise = handle

    def layer_computed(self, layer: int, *, after: object | None = None) -> None:
        self._layerwise.layer_computed(layer, after=after)

    def model_layer_computed(self, model_layer: int, *, after: object | None = None) -> None:
        self._layerwise.model_layer_computed(model_layer, after=after)


class SyncEngine:
    """A TransferEngine on its own event-loop thread, called from synchronous code.

    ``SyncEngine(engine)`` opens it (the engine must be new); ``close()`` (or leaving the
    ``with`` block) closes the engine, then stops the loop thread. ``backend`` is the anyio
    backend of the loop ("asyncio" or "trio").
    """

    def __init__(self, engine: TransferEngine, *, backend: str = "asyncio") -> None:
        self._engine = engine
        self._portal_cm: contextlib.AbstractContextManager[BlockingPortal] = start_blocking_portal(
            backend, name=f"hicache {engine!r} loop"
        )
        self._portal = self._portal_cm.__enter__()
        self._closed = False
        self._stop: anyio.Event | None = None
        # Faces opened on this loop (SyncCache.close): closed first by close(), or the loop
        # would wait for their long-lived tasks forever.
        self._closers: list[Callable[[], None]] = []
        try:
            # The engine's task group lives in one long-lived task of the loop (a task group is
            # entered and left by the same task).
            self._host, _ = self._portal.start_task(self._serve, name="hicache sync host")
        except BaseException:
            self._portal_cm.__exit__(None, None, None)
            self._closed = True
            raise

    async def _serve(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        self._stop = anyio.Event()
        async with self._engine:
            task_status.started()
            await self._stop.wait()

    # -- what the async engine tells --------------------------------------------------------
    @property
    def engine(self) -> TransferEngine:
        """The async engine (its methods belong to the loop thread: use ``call`` from others)."""
        return self._engine

    @property
    def plan(self) -> HostGroupPlan:
        return self._engine.plan

    @property
    def closed(self) -> bool:
        return self._closed

    def call(self, func: Callable[..., T], *args: Any) -> T:
        """Run ``func(*args)`` (sync or async) on the engine's loop thread and return its result."""
        if self._closed:
            raise EngineClosedError(f"{self!r} is closed")
        return self._portal.call(func, *args)

    # -- loads and backups ---------------------------------------------------------------------
    def prepare_load(
        self, host: PageSet, device: PageSet | None = None, *, after: object | None = None
    ) -> SyncLoadHandle:
        """Queue a load; it runs at the next ``submit()``, merged with the others prepared."""
        handle = self.call(lambda: self._engine.prepare_load(host, device, after=after))
        return SyncLoadHandle(self._portal, handle)

    def prepare_backup(
        self,
        device: PageSet,
        host: PageSet | None = None,
        *,
        layerwise: bool = False,
        after: object | None = None,
    ) -> SyncBackupHandle:
        handle = self.call(
            lambda: self._engine.prepare_backup(device, host, layerwise=layerwise, after=after)
        )
        if isinstance(handle, LayerwiseBackupHandle):
            return SyncLayerwiseBackupHandle(self._portal, handle)
        return SyncBackupHandle(self._portal, handle)

    def submit(self) -> None:
        """One merged submission per kind for everything prepared since the last call."""
        self.call(self._engine.submit)

    def load(
        self, host: PageSet, device: PageSet | None = None, *, after: object | None = None
    ) -> SyncLoadHandle:
        """Prepare and submit a load (blocks for the submission, not for the copies)."""
        return self.load_future(host, device, after=after).result()

    def load_future(
        self, host: PageSet, device: PageSet | None = None, *, after: object | None = None
    ) -> Future[SyncLoadHandle]:
        """``load`` without blocking: a Future of the handle."""

        async def run() -> SyncLoadHandle:
            return SyncLoadHandle(self._portal, await self._engine.load(host, device, after=after))

        return self._start(run)

    def backup(
        self, device: PageSet, host: PageSet | None = None, *, after: object | None = None
    ) -> SyncBackupHandle:
        """Prepare and submit an all-layer backup (blocks for the submission only)."""
        return self.backup_future(device, host, after=after).result()

    def backup_future(
        self, device: PageSet, host: PageSet | None = None, *, after: object | None = None
    ) -> Future[SyncBackupHandle]:
        async def run() -> SyncBackupHandle:
            handle = await self._engine.backup(device, host, after=after)
            return SyncBackupHandle(self._portal, handle)

        return self._start(run)

    def _start(self, run: Callable[[], Any]) -> Future[Any]:
        if self._closed:
            raise EngineClosedError(f"{self!r} is closed")
        return self._portal.start_task_soon(run)

    # -- pages and statistics ------------------------------------------------------------------
    def free_host(self, pages: PageSet) -> None:
        self.call(self._engine.free_host, pages)

    def free_device(self, pages: PageSet) -> None:
        self.call(self._engine.free_device, pages)

    def statistics(self) -> EngineStatistics:
        return self.call(self._engine.statistics)

    # -- life cycle ----------------------------------------------------------------------------
    def _on_close(self, close: Callable[[], None]) -> None:
        """Have ``close()`` call ``close`` first (a face opened on this loop; same package)."""
        if self._closed:
            raise EngineClosedError(f"{self!r} is closed: open the face on an open SyncEngine")
        self._closers.append(close)

    def _forget(self, close: Callable[[], None]) -> None:
        with contextlib.suppress(ValueError):
            self._closers.remove(close)

    def close(self) -> None:
        """Close the faces still open on it (a SyncCache: its background writes finish), the
        engine (as ``aclose``), then stop the loop thread; idempotent."""
        if self._closed:
            return
        try:
            for close in reversed(list(self._closers)):
                close()
        finally:
            self._close_engine()

    def _close_engine(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._portal.call(self._engine.aclose)
            stop = self._stop
            if stop is not None:
                self._portal.call(stop.set)
            self._host.result()
        finally:
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> SyncEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<SyncEngine {'closed' if self._closed else repr(self._engine)}>"


@contextlib.contextmanager
def open_sync(engine: TransferEngine, *, backend: str = "asyncio") -> Generator[SyncEngine]:
    """``with open_sync(engine) as sync:`` the engine on its own loop thread, closed at exit."""
    sync = SyncEngine(engine, backend=backend)
    try:
        yield sync
    finally:
        sync.close()


__all__ = [
    "SyncBackupHandle",
    "SyncEngine",
    "SyncLayerwiseBackupHandle",
    "SyncLoadHandle",
    "open_sync",
]
