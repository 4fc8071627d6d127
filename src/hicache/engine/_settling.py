"""How the engine's operations end (private): settling, waiting and cancelling, on the event loop.

- Settling: the part of TransferEngine that settles what finished (the reaper's sweep, the
  outcome of each operation and batch, their log events), waits for operations and steps
  without blocking the loop, and cancels (stop, wait for the copies in flight, release). Every
  slot and pin change goes through the ledger's actions (hicache.domain.ledger).
- _Life: the engine's life cycle (new, open, closing, closed).
"""

from __future__ import annotations

import contextlib
import enum
import socket
import time
from collections.abc import Sequence

import anyio

from hicache.domain.errors import TransferError
from hicache.domain.ledger import Action, Free, Ledger, Pin, PinTableKind, Side, Unpin
from hicache.domain.pins import PinTable
from hicache.domain.pools import PoolName
from hicache.domain.ports import IdleSignal, Streams
from hicache.domain.slots import GroupAllocator
from hicache.engine._ops import POLL_MAX_S, POLL_MIN_S, Batch, EventSets, Op, OpKind, wait_until
from hicache.engine.histogram import Histogram
from hicache.engine.logs import get_logger
from hicache.engine.stats import OperationState

log = get_logger("hicache.engine")


class _Life(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class Settling:
    """Settling, waiting and cancelling; TransferEngine sets the state declared here."""

    _name: str
    _life: _Life
    _counts: dict[str, int]
    _load_seconds: Histogram
    _ledger: Ledger
    _running: list[Batch]
    _queued: list[Op]
    _inflight: dict[tuple[tuple[PoolName, tuple[int, ...]], ...], Op]
    _wakeup: anyio.Event | None
    _wake: tuple[socket.socket, socket.socket] | None
    _progress: anyio.Event | None
    _reaper_scope: anyio.CancelScope | None
    _streams: Streams
    _layers: int
    _event_sets: EventSets
    _host_pins: PinTable
    _device_pins: PinTable
    _host_writes: PinTable
    _device_writes: PinTable
    _host_slots: GroupAllocator
    _device_slots: GroupAllocator
    _load_copy_s: float
    _backup_copy_s: float

    def submit(self) -> None:  # pragma: no cover - TransferEngine.submit
        raise NotImplementedError

    # ---------------------------------------------------------------------------------------
    # waiting and finishing (event loop side)
    # ---------------------------------------------------------------------------------------
    async def _reap(self) -> None:
        """Settle finished operations promptly, so pins drop even if nobody waits."""
        scope = self._reaper_scope
        if scope is None:  # pragma: no cover - made before the reaper starts
            return
        with scope:
            delay = 0.0
            while True:
                if not self._running:
                    wakeup = self._wakeup = anyio.Event()
                    await wakeup.wait()
                    delay = 0.0
                    continue
                if self._sweep():
                    delay = 0.0
                    self._progressed()
                else:
                    delay = POLL_MIN_S if delay == 0.0 else min(delay * 2, POLL_MAX_S)
                await self._nap(delay)

    def _poke(self) -> None:
        """The streams ran dry (called on a stream's thread): wake the reaper. Never raises."""
        wake = self._wake
        if wake is None:
            return
        # Full (a wake-up is pending anyway) or closed (the engine closed): nothing to do.
        with contextlib.suppress(OSError):
            wake[1].send(b"\0")

    def _unhook(self) -> None:
        """Stop the streams' wake-ups and close the socket pair (at close)."""
        wake, self._wake = self._wake, None
        if wake is None:
            return
        if isinstance(self._streams, IdleSignal):
            self._streams.set_idle_hook(None)
        for sock in wake:
            sock.close()

    async def _nap(self, delay: float) -> None:
        """Sleep ``delay`` between sweeps, or less if the streams signal that they ran dry."""
        wake = self._wake
        if wake is None or delay == 0.0:
            await anyio.sleep(delay)
            return
        with anyio.move_on_after(delay):
            await anyio.wait_readable(wake[0])
        with contextlib.suppress(OSError):  # BlockingIOError once drained
            while wake[0].recv(4096):
                pass

    def _progressed(self) -> None:
        """A sweep settled something: end the backoff sleep of every task waiting in the engine."""
        event = self._progress
        if event is not None:
            self._progress = anyio.Event()
            event.set()

    def _progress_event(self) -> anyio.Event | None:
        return self._progress

    def _sweep(self) -> bool:
        """Settle every operation and batch that finished; True if anything did.

        Loads and all-layer backups record every step at submission and each direction's
        stream runs in submission order: past the first batch of a kind whose last step is
        still running, no later batch of that kind can have finished, so they are not looked
        at (the sweep costs O(batches finished), not O(batches in flight)). Layer-wise backup
        batches record their steps as layers are computed: always looked at.
        """
        progressed = False
        blocked: set[OpKind] = set()
        for batch in list(self._running):
            kind = batch.kind
            if kind in blocked:
                continue
            for op in batch.ops:
                if op.state is OperationState.RUNNING and not op.cancelling and batch.op_done(op):
                    self._settle(op)
                    progressed = True
            if (
                not batch.sealed
                and batch.kind is OpKind.LAYERWISE_BACKUP
                and all(op.state.finished for op in batch.ops)
            ):
                with batch.lock:
                    batch.sealed = True
            if batch.done() and not any(op.cancelling for op in batch.ops):
                self._finish_batch(batch)
                progressed = True
            elif kind is not OpKind.LAYERWISE_BACKUP and batch.tail_pending():
                blocked.add(kind)
        return progressed

    async def wait_operation(self, op: Op) -> None:
        if op.state is OperationState.QUEUED and self._life is _Life.OPEN:
            self.submit()

        def finished() -> bool:
            return op.state.finished or self._settle_if_done(op)

        await wait_until(finished, self._progress_event)

    def _settle_if_done(self, op: Op) -> bool:
        """Settle ``op`` (and its batch, if that ended too) once its steps finished."""
        batch = op.batch
        if op.state is not OperationState.RUNNING or batch is None or op.cancelling:
            return False
        if not batch.op_done(op):
            return False
        self._settle(op)
        if batch.done() and not any(o.cancelling for o in batch.ops):
            self._finish_batch(batch)  # totals and the batch's log event, now
        return True

    async def wait_step(self, op: Op, step: int) -> None:
        if op.state is OperationState.QUEUED and self._life is _Life.OPEN:
            self.submit()

        def ready() -> bool:
            if op.state.finished:
                return True
            batch = op.batch
            if batch is None:
                return False
            if batch.finished:
                return True
            if op.failed_step is not None and op.failed_step <= step:
                # It will raise: settle first, so that its slots and pins are back by then.
                return self._settle_if_done(op)
            return batch.step_state[step] == 2 and batch.events[step].query()

        await wait_until(ready, self._progress_event)

    def _settle(self, op: Op) -> None:
        """An operation's steps all finished: record the outcome, drop pins, free on failure."""
        if op.state is not OperationState.RUNNING or op.cancelling:
            return
        failed = op.failed_step is not None
        actions = self._ledger.finished(op.id, failed=failed)
        op.state = OperationState.FAILED if failed else OperationState.DONE
        op.t_finished = time.perf_counter()
        self._forget(op)
        self._apply(actions)
        kind = "loads" if op.kind is OpKind.LOAD else "backups"
        self._counts[f"{kind}_failed" if failed else kind] += 1
        if op.kind is OpKind.LOAD and not failed:
            self._load_seconds.observe(op.t_finished - op.t_prepared)
        if failed:
            log.warning(
                f"{op.kind.value}_failed",
                engine=self._name,
                op=op.id,
                step=op.failed_step,
                error=repr(op.error),
            )

    def _finish_batch(self, batch: Batch) -> None:
        if batch.finished:
            return
        for op in batch.ops:
            if op.state is OperationState.RUNNING and not op.cancelling:
                self._settle(op)
        reusable = batch.finish()
        self._running.remove(batch)
        copy_s = batch.copy_s()
        moved = batch.moved()
        if batch.kind is OpKind.LOAD:
            self._load_copy_s += copy_s
            self._counts["bytes_loaded"] += moved
        else:
            self._backup_copy_s += copy_s
            self._counts["bytes_backed_up"] += moved
        for op in batch.ops:
            op.final_copy_s = op.copy_s()  # before the events serve another submission
        if reusable:
            self._event_sets.release(batch.events)
        outcome = {s.value: 0 for s in OperationState if s.finished}
        for op in batch.ops:
            outcome[op.state.value] = outcome.get(op.state.value, 0) + 1
        wall = time.perf_counter() - batch.t_submitted
        log.info(
            f"{batch.kind.value}_batch",
            engine=self._name,
            batch=batch.id,
            ops=len(batch.ops),
            pages=sum(op.pages for op in batch.ops),
            steps=batch.submitted,
            bytes=moved,
            copy_ms=round(copy_s * 1e3, 3),
            wall_ms=round(wall * 1e3, 3),
            gbps=round(moved / copy_s / 1e9, 3) if copy_s > 0 else 0.0,
            **outcome,
        )
        if batch.kind is OpKind.BACKUP:
            return
        for step in range(batch.steps):
            if batch.step_state[step] != 2 or not batch.step_moved[step]:
                continue
            elapsed = batch.events[step].elapsed_s()
            log.debug(
                f"{batch.kind.value}_layer",
                engine=self._name,
                batch=batch.id,
                layer=step,
                bytes=batch.step_moved[step],
                copy_us=round(elapsed * 1e6, 1) if elapsed is not None else None,
            )

    # ---------------------------------------------------------------------------------------
    # cancellation
    # ---------------------------------------------------------------------------------------
    async def abort_operation(self, op: Op) -> None:
        """Give an operation up (its last handle left): stop, wait in-flight copies, release."""
        with anyio.CancelScope(shield=True):
            if op.state is OperationState.QUEUED:
                self._abort_queued(op)
                await anyio.lowlevel.checkpoint()
                return
            if op.state is not OperationState.RUNNING:
                await anyio.lowlevel.checkpoint()
                return
            if op.cancelling:  # another task is aborting it: wait for that to finish
                await wait_until(lambda: op.state.finished, self._progress_event)
                return
            batch = op.batch
            if batch is None:  # pragma: no cover - a running op always has its batch
                return
            op.cancelling = True
            self._forget(op)
            with batch.lock:
                op.stopped = True
                in_flight = len(op.included)
            await wait_until(lambda: batch.included_done(op), self._progress_event)
            failed = op.failed_step is not None
            actions = self._ledger.stopped(op.id, failed=failed)
            op.state = OperationState.FAILED if failed else OperationState.CANCELLED
            op.t_finished = time.perf_counter()
            op.cancelling = False
            self._apply(actions)
            kind = "loads" if op.kind is OpKind.LOAD else "backups"
            self._counts[f"{kind}_failed" if failed else f"{kind}_cancelled"] += 1
            log.info(
                f"{op.kind.value}_cancelled",
                engine=self._name,
                op=op.id,
                steps_copied=in_flight,
                steps=len(op.step_ids),
            )
            self._sweep()

    def _abort_queued(self, op: Op, *, log_event: str = "cancelled") -> None:
        self._queued.remove(op)
        self._forget(op)
        actions = self._ledger.cancelled_queued(op.id)
        op.state = OperationState.CANCELLED
        op.t_finished = time.perf_counter()
        self._apply(actions)
        kind = "loads" if op.kind is OpKind.LOAD else "backups"
        self._counts[f"{kind}_cancelled"] += 1
        log.info(f"{op.kind.value}_{log_event}", engine=self._name, op=op.id, steps_copied=0)

    def _forget(self, op: Op) -> None:
        if op.key is not None and self._inflight.get(op.key) is op:
            del self._inflight[op.key]

    def _apply(self, actions: Sequence[Action]) -> None:
        """Apply the ledger's actions: pins, then unpins, then frees (frees even if one fails)."""
        tables = {
            PinTableKind.HOST: self._host_pins,
            PinTableKind.DEVICE: self._device_pins,
            PinTableKind.HOST_WRITES: self._host_writes,
            PinTableKind.DEVICE_WRITES: self._device_writes,
        }
        try:
            for action in actions:
                if isinstance(action, Pin):
                    tables[action.table].pin(action.pages)
                elif isinstance(action, Unpin):
                    tables[action.table].unpin(action.pages)
        finally:
            for action in actions:
                if isinstance(action, Free):
                    slots = self._host_slots if action.side is Side.HOST else self._device_slots
                    slots.free(action.pages)

    def drop_handle(self, op: Op) -> int:
        """A handle gave ``op`` up; how many handles still hold it (0: abort it)."""
        if op.state.finished:
            op.refs = max(op.refs - 1, 0)
            return op.refs
        op.refs = self._ledger.handle_dropped(op.id)
        return op.refs

    def failure_of(self, op: Op) -> TransferError:
        """The TransferError, with context, for an operation that failed."""
        step = op.failed_step
        where = (
            "all layers" if op.kind is OpKind.BACKUP else f"transfer layer {step} of {self._layers}"
        )
        batch = op.batch
        merged = (
            f", merged with {len(batch.ops) - 1} other(s)" if batch and len(batch.ops) > 1 else ""
        )
        cause = op.error
        err = TransferError(
            f"{op.describe()} failed at {where} on {self._streams.device}{merged}: "
            f"{type(cause).__name__}: {cause}"
        )
        err.__cause__ = cause
        return err
