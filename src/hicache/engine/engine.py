"""The transfer engine: per-layer loads overlapped with compute, backups, cancellation, statistics.

- TransferEngine: opened with ``async with``; ``prepare_load`` / ``prepare_backup`` (two-phase:
  take slots and pins now, run at ``submit()``), ``load`` / ``backup`` (prepare and submit),
  ``submit`` (one merged submission per kind for everything prepared since the last one),
  ``free_host`` / ``free_device`` (refuse pinned pages), ``statistics``, ``aclose``.

Ownership: the engine allocates device pages for a load and host pages for a backup from the
allocators it is given, unless the caller names them. Until an operation finishes, the engine
owns what it allocated and pins every page it touches (host pins: pages a load reads or a backup
writes; device pins: pages a load writes or a backup reads), so that they cannot be freed or
evicted. On success the allocated pages belong to the caller; on failure or cancellation they
are freed, and pins are always dropped.

Threads: the engine's methods belong to the event loop's thread, except ``LoadHandle.wait_layer``
and ``LayerwiseBackupHandle.layer_computed``, which a forward pass may call from its own thread,
and ``statistics``.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from types import TracebackType
from typing import Any

import anyio
import anyio.abc

from hicache.domain.errors import (
    ConfigError,
    EngineClosedError,
    ForeignIndexError,
    HiCacheError,
    SlotError,
    TransferError,
)
from hicache.domain.pins import PinTable
from hicache.domain.pools import HostGroupPlan, PoolName, PoolRole
from hicache.domain.ports import Direction, PageMap, Streams, Transfer
from hicache.domain.slots import GroupAllocation, GroupAllocator, PageAllocator
from hicache.engine._ops import POLL_MAX_S, POLL_MIN_S, Batch, EventSets, Op, OpKind, wait_until
from hicache.engine.handles import BackupHandle, LayerwiseBackupHandle, LoadHandle
from hicache.engine.logs import get_logger
from hicache.engine.stats import EngineStatistics, OperationState

log = get_logger("hicache.engine")  # structlog if the app configured it, else silent stdlib

PageSet = Mapping[PoolName, Sequence[int]] | Mapping[str, Sequence[int]] | GroupAllocation
PageDict = dict[PoolName, tuple[int, ...]]


class _Life(enum.Enum):
    NEW = "new"
    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


class TransferEngine:
    """Moves pages of one host group to and from one device group, layer by layer.

    Arguments are the group's plan, a copy backend (Transfer), copy streams (Streams) for the
    device, the host and device slot allocators, and optionally the pin tables to share with a
    cache policy (new ones otherwise). ``event_sets`` is how many finished event sets per size
    are kept for reuse (the reference keeps a ring of 3).
    """

    def __init__(
        self,
        *,
        plan: HostGroupPlan,
        transfer: Transfer,
        streams: Streams,
        host_slots: GroupAllocator,
        device_slots: GroupAllocator,
        host_pins: PinTable | None = None,
        device_pins: PinTable | None = None,
        event_sets: int = 3,
        name: str = "engine",
    ) -> None:
        if not isinstance(plan, HostGroupPlan):
            raise ConfigError(f"plan must be a HostGroupPlan, got {type(plan).__name__}")
        if transfer.transfer_layers != plan.transfer_layers:
            raise ConfigError(
                f"the copy backend moves {transfer.transfer_layers} transfer layers but the plan "
                f"has {plan.transfer_layers}: build both from the same host group plan"
            )
        if not isinstance(event_sets, int) or isinstance(event_sets, bool) or event_sets < 1:
            raise ConfigError(f"event_sets must be a positive integer, got {event_sets!r}")
        for label, slots in (("host_slots", host_slots), ("device_slots", device_slots)):
            if not isinstance(slots, GroupAllocator):
                raise ConfigError(f"{label} must be a GroupAllocator, got {type(slots).__name__}")
        self._plan = plan
        self._transfer = transfer
        self._streams = streams
        self._host_slots = host_slots
        self._device_slots = device_slots
        self._host_pins = host_pins if host_pins is not None else PinTable("host pins")
        self._device_pins = device_pins if device_pins is not None else PinTable("device pins")
        # Pages an in-flight operation writes: a load must not read a host page a backup is
        # still writing, and a backup must not read a device page a load is still writing.
        self._host_writes = PinTable("host writes")
        self._device_writes = PinTable("device writes")
        self._name = name
        self._layers = plan.transfer_layers
        self._anchor = plan.anchor.name
        self._owners: tuple[PoolName, ...] = tuple(p.name for p in plan.independent_pools())
        self._sidecars: tuple[PoolName, ...] = tuple(
            p.name for p in plan.pools if p.role is PoolRole.SIDECAR
        )
        self._page_layer_bytes = {
            p.name: p.page_size * p.bytes_per_unit_per_layer for p in plan.pools
        }
        self._layer_pools: tuple[frozenset[PoolName], ...] = tuple(
            frozenset(p.name for p in plan.pools if p.binding.pool_layer(t) is not None)
            for t in range(self._layers)
        )
        self._event_sets = EventSets(streams, event_sets)
        self._life = _Life.NEW
        # anyio primitives need a running event loop: made in __aenter__, so that a composition
        # root can build the engine synchronously.
        self._closed_event: anyio.Event | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._reaper_scope: anyio.CancelScope | None = None
        self._wakeup: anyio.Event | None = None
        self._queued: list[Op] = []
        self._running: list[Batch] = []
        self._inflight: dict[tuple[tuple[PoolName, tuple[int, ...]], ...], Op] = {}
        self._next_op = 1
        self._next_batch = 1
        self._wait_lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(
            (
                "loads",
                "loads_failed",
                "loads_cancelled",
                "loads_joined",
                "backups",
                "backups_failed",
                "backups_cancelled",
                "submissions",
                "bytes_loaded",
                "bytes_backed_up",
                "layer_waits",
            ),
            0,
        )
        self._load_copy_s = 0.0
        self._backup_copy_s = 0.0
        self._waited_s = 0.0

    # ---------------------------------------------------------------------------------------
    # life cycle
    # ---------------------------------------------------------------------------------------
    async def __aenter__(self) -> TransferEngine:
        if self._life is not _Life.NEW:
            raise EngineClosedError(
                f"{self!r} was already opened: an engine is opened once; build a new one"
            )
        self._closed_event = anyio.Event()
        self._reaper_scope = anyio.CancelScope()
        self._wakeup = anyio.Event()
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._life = _Life.OPEN
        tg.start_soon(self._reap, name=f"hicache {self._name} reaper")
        log.info(
            "engine_opened", engine=self._name, device=self._streams.device, layers=self._layers
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tg, self._tg = self._tg, None
        try:
            await self.aclose()
        finally:
            if tg is not None:
                # The reaper has stopped; the body's own exception (if any) propagates as it
                # is instead of inside an exception group.
                await tg.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Close: abort what was never submitted, let submitted copies finish; idempotent.

        Loads and backups that finished before (or finish while) the engine closes stay valid:
        their pages belong to their callers. Layer-wise backups whose layers were not all
        reported are cancelled. Safe to call from several tasks; all return once closed.
        """
        if self._life is _Life.CLOSED:
            await anyio.lowlevel.checkpoint()
            return
        if self._life is _Life.NEW:
            self._life = _Life.CLOSED
            await anyio.lowlevel.checkpoint()
            return
        closed_event = self._closed_event
        if closed_event is None:  # pragma: no cover - set whenever the engine was opened
            raise EngineClosedError(f"{self!r} has no close event")
        if self._life is _Life.CLOSING:
            with anyio.CancelScope(shield=True):
                await closed_event.wait()
            return
        self._life = _Life.CLOSING
        with anyio.CancelScope(shield=True):
            aborted = 0
            # Settle what already finished first, so that a layer-wise backup whose layers were
            # all copied is kept, not cancelled because the reaper had not looked at it yet.
            self._sweep()
            for op in list(self._queued):
                op.closed_by_engine = True
                self._abort_queued(op)
                aborted += 1
            for batch in list(self._running):
                if batch.kind is OpKind.LAYERWISE_BACKUP and not batch.sealed:
                    for op in batch.ops:
                        if not op.state.finished:
                            op.closed_by_engine = True
                            await self._abort(op)
                            aborted += 1
            await wait_until(self._drained)
            if self._reaper_scope is not None:
                self._reaper_scope.cancel()
            self._life = _Life.CLOSED
            closed_event.set()
        log.info("engine_closed", engine=self._name, aborted=aborted, **self._summary())

    def _drained(self) -> bool:
        self._sweep()
        return not self._running

    @property
    def closed(self) -> bool:
        return self._life in (_Life.CLOSING, _Life.CLOSED)

    def _check_open(self, what: str) -> None:
        if self._life is _Life.OPEN:
            return
        if self._life is _Life.NEW:
            raise EngineClosedError(
                f"{self!r} is not open: enter it with 'async with engine:' before {what}"
            )
        raise EngineClosedError(f"{self!r} is closed: cannot {what}")

    # ---------------------------------------------------------------------------------------
    # properties
    # ---------------------------------------------------------------------------------------
    @property
    def plan(self) -> HostGroupPlan:
        return self._plan

    @property
    def transfer_layers(self) -> int:
        return self._layers

    @property
    def device(self) -> str:
        return self._streams.device

    @property
    def host_pins(self) -> PinTable:
        """Host pages in-flight operations use; a cache must not free or evict them."""
        return self._host_pins

    @property
    def device_pins(self) -> PinTable:
        """Device pages in-flight operations use."""
        return self._device_pins

    @property
    def host_slots(self) -> GroupAllocator:
        return self._host_slots

    @property
    def device_slots(self) -> GroupAllocator:
        return self._device_slots

    # ---------------------------------------------------------------------------------------
    # loads
    # ---------------------------------------------------------------------------------------
    def prepare_load(self, host: PageSet, device: PageSet | None = None) -> LoadHandle:
        """Queue a load of ``host`` pages (per slot-owning pool; sidecars follow the anchor).

        Without ``device`` the engine allocates the device pages (``handle.device_pages``); a
        load of exactly the same host pages that is already queued or in flight is joined
        instead (one transfer, ``handle.joined``; the handles share the device pages). With
        ``device`` the pages land there (same pools, same counts; the caller keeps owning
        them). Takes slots and pins now; runs at the next ``submit()``.
        """
        self._check_open("load")
        hp = self._pages(host, "host", self._host_slots)
        self._host_writes.check_unpinned(hp, action="load from")
        key: tuple[tuple[PoolName, tuple[int, ...]], ...] | None = None
        if device is None:
            key = tuple((p, hp[p]) for p in self._owners if p in hp)
            shared = self._inflight.get(key)
            if shared is not None and shared.joinable:
                shared.refs += 1
                self._counts["loads_joined"] += 1
                log.debug("load_joined", engine=self._name, op=shared.id, refs=shared.refs)
                return LoadHandle(self, shared, joined=True)
            counts = {p: len(v) for p, v in hp.items()}
            dp: PageDict = dict(self._device_slots.allocate(counts).pages)
            allocated = True
        else:
            dp = self._pages(device, "device", self._device_slots)
            self._check_pairing(hp, dp)
            self._device_pins.check_unpinned(dp, action="load into")
            allocated = False
        try:
            op = self._new_op(OpKind.LOAD, hp, dp, False, allocated, key)
        except BaseException:
            if allocated:
                self._device_slots.free(dp)
            raise
        self._host_pins.pin(hp)
        self._device_pins.pin(dp)
        self._device_writes.pin(dp)
        self._queued.append(op)
        if key is not None:
            self._inflight[key] = op
        log.debug("load_prepared", engine=self._name, op=op.id, pages=op.pages)
        return LoadHandle(self, op)

    async def load(self, host: PageSet, device: PageSet | None = None) -> LoadHandle:
        """Prepare a load and submit it at once (with anything else prepared)."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        handle = self.prepare_load(host, device)
        self.submit()
        return handle

    # ---------------------------------------------------------------------------------------
    # backups
    # ---------------------------------------------------------------------------------------
    def prepare_backup(
        self, device: PageSet, host: PageSet | None = None, *, layerwise: bool = False
    ) -> BackupHandle:
        """Queue a backup of ``device`` pages (all layers) into host pages.

        Without ``host`` the engine allocates the host pages (``handle.host_pages``, the
        caller's once the backup is done). The copy stream waits for the compute issued so far
        before it reads (``streams.after_compute``). With ``layerwise=True`` the handle is a
        LayerwiseBackupHandle: nothing is copied at ``submit()``; each ``layer_computed(i)``
        copies layer i of every layer-wise backup of the same submission.
        """
        self._check_open("back up")
        dp = self._pages(device, "device", self._device_slots)
        self._device_writes.check_unpinned(dp, action="back up")
        if host is None:
            counts = {p: len(v) for p, v in dp.items()}
            hp: PageDict = dict(self._host_slots.allocate(counts).pages)
            allocated = True
        else:
            hp = self._pages(host, "host", self._host_slots)
            self._check_pairing(dp, hp)
            self._host_pins.check_unpinned(hp, action="back up into")
            allocated = False
        kind = OpKind.LAYERWISE_BACKUP if layerwise else OpKind.BACKUP
        try:
            op = self._new_op(kind, hp, dp, allocated, False, None)
        except BaseException:
            if allocated:
                self._host_slots.free(hp)
            raise
        self._host_pins.pin(hp)
        self._host_writes.pin(hp)
        self._device_pins.pin(dp)
        self._queued.append(op)
        log.debug("backup_prepared", engine=self._name, op=op.id, pages=op.pages, kind=kind.value)
        if layerwise:
            return LayerwiseBackupHandle(self, op)
        return BackupHandle(self, op)

    async def backup(self, device: PageSet, host: PageSet | None = None) -> BackupHandle:
        """Prepare an all-layer backup and submit it at once (with anything else prepared)."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        handle = self.prepare_backup(device, host)
        self.submit()
        return handle

    # ---------------------------------------------------------------------------------------
    # submission
    # ---------------------------------------------------------------------------------------
    def submit(self) -> None:
        """Submit everything prepared since the last call: one merged submission per kind.

        Loads: one copy call and one event per transfer layer for all of them; backups: one
        copy call after the compute; layer-wise backups: one event set whose layers are copied
        as the forward pass reports them. Never blocks; copy failures surface in the handles.
        """
        if self._life is not _Life.OPEN:
            self._check_open("submit")
        self._sweep()
        if not self._queued:
            return
        queued, self._queued = self._queued, []
        try:
            for kind in OpKind:
                ops = [op for op in queued if op.kind is kind]
                if ops:
                    self._launch(kind, ops)
        except BaseException as e:
            # Nothing may be lost: operations that did not reach a copy stream stay queued,
            # with their slots and pins, for a later submit(), a cancel or close() to settle.
            self._queued = [op for op in queued if op.state is OperationState.QUEUED]
            if isinstance(e, Exception) and not isinstance(e, HiCacheError):
                raise TransferError(
                    f"engine {self._name!r}: the copy streams refused a submission "
                    f"({type(e).__name__}: {e}); {len(self._queued)} operation(s) stay queued"
                ) from e
            raise
        if self._wakeup is not None:
            self._wakeup.set()

    def _launch(self, kind: OpKind, ops: list[Op]) -> None:
        steps = 1 if kind is OpKind.BACKUP else self._layers
        call = self._call(kind)
        batch = Batch(
            batch_id=self._next_batch,
            kind=kind,
            ops=ops,
            call=call,
            events=self._event_sets.acquire(steps),
        )
        self._next_batch += 1
        self._counts["submissions"] += 1
        now = time.perf_counter()
        for op in ops:
            op.state = OperationState.RUNNING
            op.t_submitted = now
            if kind is OpKind.LAYERWISE_BACKUP:  # nothing is recorded until layer_computed
                op.batch = batch
        self._running.append(batch)
        log.debug(
            "batch_submitted",
            engine=self._name,
            batch=batch.id,
            kind=kind.value,
            ops=len(ops),
            pages=sum(op.pages for op in ops),
            steps=steps,
        )
        if kind is OpKind.LAYERWISE_BACKUP:
            return
        # A backup reads what compute wrote; a load writes device pages that a request freed
        # a moment ago may still have queued kernels reading. Either way the copy stream
        # first waits for the compute issued so far (a GPU-side wait; nothing on CPU).
        try:
            self._streams.after_compute(kind.direction)
        except Exception as e:
            with batch.lock:
                for op in ops:
                    op.stopped = True
                    op.failed_step = 0
                    op.error = e
        for step in range(steps):
            batch.submit_step(step, self._streams)
        # Only now: a forward pass on another thread that sees the batch must find every
        # step's event recorded (an event not recorded yet reads as finished).
        for op in ops:
            op.batch = batch

    def _call(self, kind: OpKind) -> Any:
        transfer = self._transfer
        if kind is OpKind.LOAD:
            return transfer.load_layer
        if kind is OpKind.LAYERWISE_BACKUP:
            return transfer.backup_layer

        def backup_all(_step: int, maps: Sequence[PageMap]) -> int:
            return transfer.backup(maps)

        return backup_all

    def _submit_layer(self, batch: Batch, layer: int) -> None:
        """A layer-wise backup's layer was computed: copy it (once per submission)."""
        if batch.step_state[layer]:
            return
        self._streams.after_compute(Direction.BACKUP)
        batch.submit_step(layer, self._streams)

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
        self._sweep_if_open()
        dp = self._pages(pages, "device", self._device_slots, allocated=False)
        self._device_pins.check_unpinned(dp, action="free")
        self._device_slots.free(dp)

    def _sweep_if_open(self) -> None:
        if self._life in (_Life.OPEN, _Life.CLOSING):
            self._sweep()

    # ---------------------------------------------------------------------------------------
    # statistics
    # ---------------------------------------------------------------------------------------
    def statistics(self) -> EngineStatistics:
        c = self._counts
        in_flight = sum(
            1 for b in self._running for op in b.ops if op.state is OperationState.RUNNING
        )
        with self._wait_lock:
            waited = self._waited_s
            waits = c["layer_waits"]
        return EngineStatistics(
            loads=c["loads"],
            loads_failed=c["loads_failed"],
            loads_cancelled=c["loads_cancelled"],
            loads_joined=c["loads_joined"],
            backups=c["backups"],
            backups_failed=c["backups_failed"],
            backups_cancelled=c["backups_cancelled"],
            submissions=c["submissions"],
            bytes_loaded=c["bytes_loaded"],
            bytes_backed_up=c["bytes_backed_up"],
            load_copy_s=self._load_copy_s,
            backup_copy_s=self._backup_copy_s,
            exposed_wait_s=waited,
            layer_waits=waits,
            queued=len(self._queued),
            in_flight=in_flight,
            event_sets_created=self._event_sets.created,
            event_sets_reused=self._event_sets.reused,
        )

    def _summary(self) -> dict[str, Any]:
        s = self.statistics()
        return {
            "loads": s.loads,
            "backups": s.backups,
            "bytes_loaded": s.bytes_loaded,
            "bytes_backed_up": s.bytes_backed_up,
            "load_gbps": round(s.load_gbps, 3),
            "exposed_wait_ms": round(s.exposed_wait_s * 1e3, 3),
        }

    def _note_wait(self, seconds: float) -> None:
        with self._wait_lock:
            self._waited_s += seconds
            self._counts["layer_waits"] += 1

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
                else:
                    delay = POLL_MIN_S if delay == 0.0 else min(delay * 2, POLL_MAX_S)
                await anyio.sleep(delay)

    def _sweep(self) -> bool:
        """Settle every operation and batch that finished; True if anything did."""
        progressed = False
        for batch in list(self._running):
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
        return progressed

    async def _wait_op(self, op: Op) -> None:
        if op.state is OperationState.QUEUED and self._life is _Life.OPEN:
            self.submit()

        def finished() -> bool:
            return op.state.finished or self._settle_if_done(op)

        await wait_until(finished)

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

    async def _wait_step(self, op: Op, step: int) -> None:
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

        await wait_until(ready)

    def _settle(self, op: Op) -> None:
        """An operation's steps all finished: record the outcome, drop pins, free on failure."""
        if op.state is not OperationState.RUNNING or op.cancelling:
            return
        failed = op.failed_step is not None
        op.state = OperationState.FAILED if failed else OperationState.DONE
        op.t_finished = time.perf_counter()
        self._forget(op)
        self._release(op, free=failed)
        kind = "loads" if op.kind is OpKind.LOAD else "backups"
        self._counts[f"{kind}_failed" if failed else kind] += 1
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
        batch.finished = True
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
        if all(batch.step_state[i] == 2 for i in range(batch.steps)):
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
    async def _abort(self, op: Op) -> None:
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
                await wait_until(lambda: op.state.finished)
                return
            batch = op.batch
            if batch is None:  # pragma: no cover - a running op always has its batch
                return
            op.cancelling = True
            self._forget(op)
            with batch.lock:
                op.stopped = True
                in_flight = len(op.included)
            await wait_until(lambda: batch.included_done(op))
            failed = op.failed_step is not None
            op.state = OperationState.FAILED if failed else OperationState.CANCELLED
            op.t_finished = time.perf_counter()
            op.cancelling = False
            self._release(op, free=True)
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

    def _abort_queued(self, op: Op) -> None:
        self._queued.remove(op)
        self._forget(op)
        op.state = OperationState.CANCELLED
        op.t_finished = time.perf_counter()
        self._release(op, free=True)
        kind = "loads" if op.kind is OpKind.LOAD else "backups"
        self._counts[f"{kind}_cancelled"] += 1
        log.info(f"{op.kind.value}_cancelled", engine=self._name, op=op.id, steps_copied=0)

    def _forget(self, op: Op) -> None:
        if op.key is not None and self._inflight.get(op.key) is op:
            del self._inflight[op.key]

    def _release(self, op: Op, *, free: bool) -> None:
        """Drop the operation's pins; with ``free``, return the pages it allocated."""
        host_tables = [self._host_pins]
        device_tables = [self._device_pins]
        if op.kind is OpKind.LOAD:
            device_tables.append(self._device_writes)
        else:
            host_tables.append(self._host_writes)
        try:
            for table in host_tables:
                table.unpin(op.host)
            for table in device_tables:
                table.unpin(op.device)
        finally:
            if free and op.allocated_device:
                self._device_slots.free(op.device)
            if free and op.allocated_host:
                self._host_slots.free(op.host)

    def _failure(self, op: Op) -> TransferError:
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

    # ---------------------------------------------------------------------------------------
    # input checks and page maps
    # ---------------------------------------------------------------------------------------
    def _pages(
        self, pages: PageSet, side: str, slots: GroupAllocator, *, allocated: bool = True
    ) -> PageDict:
        """Normalise a page set: slot-owning pools of this plan, valid ids, allocated pages."""
        raw: Mapping[Any, Sequence[int]]
        raw = pages.pages if isinstance(pages, GroupAllocation) else pages
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"{side} pages must be a mapping of pool name to page ids, got {type(raw).__name__}"
            )
        out: PageDict = {}
        for key, ids in raw.items():
            pool = PoolName.parse(key)
            if pool in self._sidecars:
                raise ConfigError(
                    f"pool {pool.value!r} is a sidecar: it follows the anchor's pages; give "
                    f"pages for {self._anchor.value!r} instead"
                )
            if pool not in self._owners:
                raise ConfigError(
                    f"pool {pool.value!r} is not in this group: expected pages for "
                    f"{[p.value for p in self._owners]}"
                )
            if pool in out:
                raise ConfigError(f"pool {pool.value!r} is named twice in the {side} pages")
            allocator = slots.allocator(pool)
            out[pool] = self._check_ids(ids, pool, side, allocator, allocated=allocated)
        if not any(out.values()):
            raise ConfigError(f"no {side} pages given: expected at least one page")
        return {p: out[p] for p in self._owners if out.get(p)}

    @staticmethod
    def _check_ids(
        ids: Iterable[int], pool: PoolName, side: str, allocator: PageAllocator, *, allocated: bool
    ) -> tuple[int, ...]:
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Iterable):
            raise ConfigError(
                f"{side} pages of pool {pool.value!r} must be a sequence of ints, got {ids!r}"
            )
        out = tuple(ids)
        seen: set[int] = set()
        for page in out:
            if type(page) is not int or not 0 <= page < allocator.pages:
                raise ForeignIndexError(
                    f"{side} page {page!r} does not belong to pool {pool.value!r} "
                    f"(ids 0..{allocator.pages - 1})"
                )
            if page in seen:
                raise ConfigError(f"{side} page {page} of pool {pool.value!r} is listed twice")
            seen.add(page)
            if allocated and allocator.is_free(page):
                raise SlotError(
                    f"{side} page {page} of pool {pool.value!r} is free: allocate it before "
                    f"a transfer uses it"
                )
        return out

    @staticmethod
    def _check_pairing(a: PageDict, b: PageDict) -> None:
        for pool in a.keys() | b.keys():
            na, nb = len(a.get(pool, ())), len(b.get(pool, ()))
            if na != nb:
                raise ConfigError(
                    f"pool {pool.value!r}: {na} pages on one side paired with {nb} on the other; "
                    f"host and device pages pair 1:1"
                )

    def _new_op(
        self,
        kind: OpKind,
        host: PageDict,
        device: PageDict,
        allocated_host: bool,
        allocated_device: bool,
        key: tuple[tuple[PoolName, tuple[int, ...]], ...] | None,
    ) -> Op:
        maps = [PageMap(pool, host[pool], device[pool]) for pool in self._owners if pool in host]
        if self._anchor in host:
            anchor_host, anchor_device = host[self._anchor], device[self._anchor]
            maps.extend(PageMap(side, anchor_host, anchor_device) for side in self._sidecars)
        per_layer = [[m for m in maps if m.pool in pools] for pools in self._layer_pools]
        # Bytes per transfer layer from the plan's geometry (what Transfer.layer_bytes reports),
        # without a call into the copy backend per layer.
        sizes = {m.pool: len(m) * self._page_layer_bytes[m.pool] for m in maps}
        layer_bytes = [sum(sizes[m.pool] for m in ms) for ms in per_layer]
        if kind is OpKind.BACKUP:
            steps, step_bytes = [maps], [sum(layer_bytes)]
        else:
            steps, step_bytes = per_layer, layer_bytes
        op = Op(
            op_id=self._next_op,
            kind=kind,
            host=host,
            device=device,
            allocated_host=allocated_host,
            allocated_device=allocated_device,
            steps=steps,
            step_bytes=step_bytes,
            key=key,
        )
        self._next_op += 1
        return op

    def __repr__(self) -> str:
        running = sum(
            1 for b in self._running for op in b.ops if op.state is OperationState.RUNNING
        )
        return (
            f"<TransferEngine {self._name} on {self._streams.device}: {self._life.value}, "
            f"{len(self._queued)} queued, {running} in flight, "
            f"{len(self._host_pins)} host / {len(self._device_pins)} device pages pinned>"
        )


__all__ = ["PageSet", "TransferEngine"]
