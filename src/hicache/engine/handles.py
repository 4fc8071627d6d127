"""Handles the engine returns for each load and backup.

- LoadHandle: the forward pass calls ``wait_layer(i)`` before it reads layer i (synchronous: a
  GPU-side stream wait on CUDA, a block on CPU); async code awaits ``wait_layer_ready(i)`` or
  ``wait()``; ``cancel()`` gives the load up.
- BackupHandle: ``wait()`` until the backed-up pages are on the host; ``cancel()``.
- LayerwiseBackupHandle: a backup during prefill; ``layer_computed(i)`` after compute wrote
  layer i submits that layer's copy (once for every backup merged into the same submission).

Every handle is an async context manager: leaving the block normally waits for the operation;
leaving it with an exception (cancellation included) cancels it under a shielded scope and
re-raises. A cancelled wait cancels the operation in the same way. Handles sharing one load
(concurrent loads of the same pages) are independent: the load stops only when the last one
gives up.
"""

from __future__ import annotations

import time
from typing import Protocol

import anyio

from hicache.domain.errors import ConfigError, EngineClosedError, TransferError
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue
from hicache.domain.pools import HostGroupPlan, PoolName
from hicache.engine._ops import Batch, Op, OpKind, wait_until
from hicache.engine.stats import OperationState, OperationStatistics


class OperationOwner(Protocol):
    """The engine's internal interface that handles use (and nothing private of it)."""

    @property
    def transfer_layers(self) -> int: ...

    @property
    def plan(self) -> HostGroupPlan: ...

    async def wait_operation(self, op: Op) -> None: ...

    async def wait_step(self, op: Op, step: int) -> None: ...

    async def abort_operation(self, op: Op) -> None: ...

    def drop_handle(self, op: Op) -> int: ...

    def submit_layer(self, batch: Batch, layer: int, after: object | None = None) -> None: ...

    def note_wait(self, seconds: float) -> None: ...

    def failure_of(self, op: Op) -> TransferError: ...


class _Handle:
    """What every handle shares: identity, state, waiting, cancelling, statistics."""

    def __init__(self, engine: OperationOwner, op: Op, *, joined: bool = False) -> None:
        self._engine = engine
        self._op = op
        self._joined = joined
        self._detached = False
        self._cancelled = False
        self._waited_s = 0.0
        self._waits = 0

    # -- identity ------------------------------------------------------------------------------
    @property
    def operation(self) -> Op:
        """The engine's record of the operation (internal: shared by joined handles)."""
        return self._op

    @property
    def id(self) -> int:
        """The operation's id (handles that share one load share it)."""
        return self._op.id

    @property
    def joined(self) -> bool:
        """Whether this handle joined a load of the same pages that was already in flight."""
        return self._joined

    @property
    def layers(self) -> int:
        return self._engine.transfer_layers

    @property
    def host_pages(self) -> dict[PoolName, tuple[int, ...]]:
        """Host pages per slot-owning pool (sidecars use the anchor's)."""
        return dict(self._op.host)

    @property
    def device_pages(self) -> dict[PoolName, tuple[int, ...]]:
        """Device pages per slot-owning pool (sidecars use the anchor's)."""
        return dict(self._op.device)

    @property
    def state(self) -> OperationState:
        if self._cancelled:
            return OperationState.CANCELLED
        return self._op.state

    def done(self) -> bool:
        """Whether the operation finished (done, failed or cancelled); never blocks."""
        return self.state.finished

    # -- waiting -------------------------------------------------------------------------------
    async def wait(self) -> None:
        """Wait until the whole operation finished; raise TransferError if it failed.

        If the operation is still queued, this submits the engine's pending step first. A
        cancelled wait cancels the operation (shielded) and re-raises.
        """
        start = time.perf_counter()
        try:
            await self._engine.wait_operation(self._op)
        except BaseException:
            await self._cancel_shielded()
            raise
        finally:
            self._note_wait(time.perf_counter() - start)
        self._raise_if_unusable(None)

    async def cancel(self) -> None:
        """Give the operation up; idempotent; a no-op once it finished successfully.

        When this is the last handle of the operation, no further step takes its pages, the
        copies already in flight are waited for, and its slots and pins are returned, all
        under a shielded scope.
        """
        op = self._op
        if self._detached:  # a second call returns once the first one's cleanup is done
            await wait_until(lambda: not op.cancelling)
            return
        self._detached = True
        if op.state is not OperationState.DONE:
            self._cancelled = True
        if self._engine.drop_handle(op) == 0:
            await self._engine.abort_operation(op)
        else:
            await anyio.lowlevel.checkpoint()

    async def _cancel_shielded(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.cancel()

    def statistics(self) -> OperationStatistics:
        op = self._op
        return OperationStatistics(
            op=op.id,
            kind=op.kind.value,
            state=self.state,
            pages=op.pages,
            layers=len(op.step_ids) if op.kind is not OpKind.BACKUP else self.layers,
            bytes=op.bytes_done,
            copy_s=op.copy_s(),
            waited_s=self._waited_s,
            waits=self._waits,
            joined=self._joined,
        )

    # -- helpers -------------------------------------------------------------------------------
    def _transfer_layer(self, model_layer: int) -> int:
        """The transfer layer of ``model_layer`` (the forward pass's numbering)."""
        plan = self._engine.plan
        layer = plan.transfer_layer_of(model_layer)
        if layer is None:
            raise ConfigError(
                f"model layer {model_layer!r} holds no cache in this group: the cached model "
                f"layers are {list(plan.cached_model_layers)}"
            )
        return layer

    def _note_wait(self, seconds: float) -> None:
        self._waited_s += seconds
        self._waits += 1
        if self._op.kind is OpKind.LOAD:  # exposed time is what a forward pass waits for
            self._engine.note_wait(seconds)

    def _raise_if_unusable(self, layer: int | None) -> None:
        """Raise the error that explains why (this layer of) the operation is not there."""
        op = self._op
        if self._cancelled:
            raise TransferError(
                f"{op.describe()} was cancelled through this handle: its pages are not (all) "
                f"in place"
            )
        failed = op.failed_step
        if failed is not None and (layer is None or op.kind is OpKind.BACKUP or failed <= layer):
            raise self._engine.failure_of(op)
        if op.state is OperationState.CANCELLED:
            if op.closed_by_engine and op.batch is None:
                raise EngineClosedError(
                    f"{op.describe()} was never submitted: the engine closed first"
                )
            if op.closed_by_engine:
                raise EngineClosedError(
                    f"{op.describe()} was cancelled: the engine closed before the forward pass "
                    f"reported all its layers"
                )
            raise TransferError(f"{op.describe()} was cancelled")

    def _unavailable(self, layer: int | None) -> Exception:
        """The error for a wait on an operation that is not submitted or was given up."""
        op = self._op
        if op.batch is None and not self._cancelled and op.state is OperationState.QUEUED:
            return TransferError(
                f"{op.describe()} is prepared but not submitted: call engine.submit() (or "
                f"await the handle) before the forward pass waits on its layers"
            )
        try:
            self._raise_if_unusable(layer)
        except Exception as e:
            return e
        return TransferError(f"{op.describe()} is {op.state.value}: layer {layer} is not in place")

    async def __aenter__(self) -> _Handle:
        return self

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
        if exc is None:
            await self.wait()
        else:
            await self._cancel_shielded()

    def __repr__(self) -> str:
        op = self._op
        kind = type(self).__name__
        done = sum(1 for i in op.included if op.batch is not None and op.batch.events[i].query())
        extra = " joined" if self._joined else ""
        return (
            f"<{kind} #{op.id}{extra}: {self.state.value}, {op.pages} pages, "
            f"{done}/{len(op.step_ids)} steps copied>"
        )


class LoadHandle(_Handle):
    """A load of host pages into device pages, layer by layer."""

    def wait_layer(self, layer: int) -> None:
        """Order the caller after layer ``layer``'s copy; call before reading layer ``layer``.

        Synchronous: on CUDA the current stream waits on the layer's event (the CPU does not
        block); on CPU the calling thread blocks until the layer is in place. Raises
        TransferError if the load failed at or before this layer or was cancelled.
        """
        op = self._op
        batch = op.batch
        if batch is None or self._cancelled or op.state is OperationState.CANCELLED:
            raise self._unavailable(layer)
        if type(layer) is not int or not 0 <= layer < batch.steps:
            raise ConfigError(
                f"layer {layer!r} is out of range: expected a transfer layer 0..{self.layers - 1}"
            )
        if batch.finished:
            self._note_wait(0.0)
        else:
            start = time.perf_counter()
            batch.wait_step(layer)
            self._note_wait(time.perf_counter() - start)
        if op.failed_step is not None:
            self._raise_if_unusable(layer)

    def wait_model_layer(self, model_layer: int) -> None:
        """``wait_layer`` by model layer id (``plan.transfer_layer_of``); ConfigError if the
        model layer holds no cache in this group."""
        self.wait_layer(self._transfer_layer(model_layer))

    async def wait_model_layer_ready(self, model_layer: int) -> None:
        """``wait_layer_ready`` by model layer id."""
        await self.wait_layer_ready(self._transfer_layer(model_layer))

    async def wait_layer_ready(self, layer: int) -> None:
        """Wait (without blocking the event loop) until layer ``layer`` is in place.

        A cancelled wait cancels the load (shielded) and re-raises.
        """
        if type(layer) is not int or not 0 <= layer < self.layers:
            raise ConfigError(
                f"layer {layer!r} is out of range: expected a transfer layer 0..{self.layers - 1}"
            )
        start = time.perf_counter()
        try:
            await self._engine.wait_step(self._op, layer)
        except BaseException:
            await self._cancel_shielded()
            raise
        finally:
            self._note_wait(time.perf_counter() - start)
        self._raise_if_unusable(layer)

    async def __aenter__(self) -> LoadHandle:
        return self


class BackupHandle(_Handle):
    """A backup of device pages (all layers) into host pages."""

    async def __aenter__(self) -> BackupHandle:
        return self


class LayerwiseBackupHandle(BackupHandle):
    """A backup during prefill: layer i is copied right after its compute."""

    def layer_computed(self, layer: int, *, after: object | None = None) -> None:
        """Compute wrote layer ``layer``: submit its copy (after the compute, on the copy stream).

        ``after``: the ordering point for this layer (a stream or an event recorded after the
        layer's compute; CpuFence on the CPU); default: the backup's own, or the calling
        thread's current compute stream.

        Every backup merged into the same submission is copied by the first call for a layer;
        later calls for that layer do nothing. Never blocks.
        """
        if type(layer) is not int or not 0 <= layer < self.layers:
            raise ConfigError(
                f"layer {layer!r} is out of range: expected a transfer layer 0..{self.layers - 1}"
            )
        op = self._op
        if op.batch is None or self._cancelled or op.state is OperationState.CANCELLED:
            raise self._unavailable(layer)
        self._engine.submit_layer(op.batch, layer, after)

    def model_layer_computed(self, model_layer: int, *, after: object | None = None) -> None:
        """``layer_computed`` by model layer id (``plan.transfer_layer_of``)."""
        self.layer_computed(self._transfer_layer(model_layer), after=after)

    async def __aenter__(self) -> LayerwiseBackupHandle:
        return self
