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
are freed, and pins are always dropped. With ``device_ownership="framework"`` the serving
framework's allocator owns every device page: loads and backups name their device pages (any id
in range; the engine never allocates or frees one) and only pins protect them while in flight.

Modules: this one holds the public face (life cycle, prepare/load/backup); ``_submission``
builds and starts operations (merged submissions, ordering points), ``_settling`` ends them
(settling, waits, cancellation), ``_freeing`` checks the page sets callers pass and frees pages,
``_reporting`` answers ``statistics``, ``_pages`` normalises page sets, ``_ops`` holds operations
and batches; slots, pins and operation states are decided by the domain's
ledger (hicache.domain.ledger), whose actions the engine applies.

Threads: the engine's methods belong to the event loop's thread, except ``LoadHandle.wait_layer``
and ``LayerwiseBackupHandle.layer_computed``, which a forward pass may call from its own thread,
and ``statistics``.
"""

from __future__ import annotations

import socket
import threading

import anyio
import anyio.abc

from hicache.domain.errors import (
    ConfigError,
    EngineClosedError,
    TransferError,
)
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue
from hicache.domain.ledger import Ledger
from hicache.domain.pins import PinTable
from hicache.domain.pools import HostGroupPlan, PoolName, PoolRole
from hicache.domain.ports import IdleSignal, Streams, Transfer
from hicache.domain.slots import GroupAllocator
from hicache.engine._freeing import Freeing
from hicache.engine._ops import Batch, EventSets, Op, OpKind, wait_until
from hicache.engine._pages import PageDict, PageSet
from hicache.engine._reporting import Reporting
from hicache.engine._settling import _Life
from hicache.engine._submission import Submitting
from hicache.engine.handles import BackupHandle, LayerwiseBackupHandle, LoadHandle
from hicache.engine.histogram import LOAD_SECONDS_BUCKETS, WAIT_SECONDS_BUCKETS, Histogram
from hicache.engine.logs import get_logger
from hicache.engine.stats import OperationState

log = get_logger("hicache.engine")  # structlog if the app configured it, else silent stdlib

# Who owns device pages: the engine's allocator ("engine": loads may leave them to the engine)
# or the serving framework ("framework": every load and backup names its device pages).
DEVICE_OWNERSHIP = ("engine", "framework")


class TransferEngine(Freeing, Reporting, Submitting):
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
        device_ownership: str = "engine",
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
        if device_ownership not in DEVICE_OWNERSHIP:
            raise ConfigError(
                f"device_ownership must be one of {list(DEVICE_OWNERSHIP)}, got "
                f"{device_ownership!r}"
            )
        self._framework_device = device_ownership == "framework"
        self._device_ownership = device_ownership
        self._plan = plan
        self._transfer = transfer
        self._streams = streams
        self._host_slots = host_slots
        self._device_slots = device_slots
        for what, pins in (("host_pins", host_pins), ("device_pins", device_pins)):
            if pins is not None and not isinstance(pins, PinTable):
                raise ConfigError(
                    f"{what} must be a PinTable (hicache.domain.pins) or None, got "
                    f"{type(pins).__name__}"
                )
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
        # Per set of pools an operation has: the positions of its page maps each layer carries.
        self._layer_patterns: dict[tuple[PoolName, ...], tuple[tuple[int, ...], ...]] = {}
        self._event_sets = EventSets(streams, event_sets)
        self._life = _Life.NEW
        # anyio primitives need a running event loop: made in __aenter__, so that a composition
        # root can build the engine synchronously.
        self._closed_event: anyio.Event | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._reaper_scope: anyio.CancelScope | None = None
        self._wakeup: anyio.Event | None = None
        # Streams that signal when they ran dry (IdleSignal) wake the reaper through this
        # socket pair (reader, writer); a sweep that settled something sets ``_progress``.
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._progress: anyio.Event | None = None
        self._queued: list[Op] = []
        self._running: list[Batch] = []
        self._inflight: dict[tuple[tuple[PoolName, tuple[int, ...]], ...], Op] = {}
        self._next_op = 1
        self._next_batch = 1
        self._wait_lock = threading.Lock()
        # Slots, pins and operation states: the pure bookkeeping; the engine applies its actions.
        self._ledger = Ledger()
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
        # Observed where the times are already measured (a load's settle, a forward-pass wait);
        # read at scrape time by hicache.metrics.
        self._load_seconds = Histogram(LOAD_SECONDS_BUCKETS)
        self._wait_seconds = Histogram(WAIT_SECONDS_BUCKETS)

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
        self._progress = anyio.Event()
        if isinstance(self._streams, IdleSignal):
            reader, writer = socket.socketpair()
            reader.setblocking(False)
            writer.setblocking(False)
            self._wake = (reader, writer)
            self._streams.set_idle_hook(self._poke)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self._life = _Life.OPEN
        tg.start_soon(self._reap, name=f"hicache {self._name} reaper")
        log.info(
            "engine_opened", engine=self._name, device=self._streams.device, layers=self._layers
        )
        return self

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
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
                            if not op.cancelling:
                                self._ledger.closing(op.id)
                            await self.abort_operation(op)
                            aborted += 1
            await wait_until(self._drained, self._progress_event)
            if self._reaper_scope is not None:
                self._reaper_scope.cancel()
            self._unhook()
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
        """The device allocator: page ranges always; ownership only with ``"engine"``."""
        return self._device_slots

    @property
    def device_ownership(self) -> str:
        """Who owns device pages: ``"engine"`` (its allocator) or ``"framework"``."""
        return self._device_ownership

    # ---------------------------------------------------------------------------------------
    # loads
    # ---------------------------------------------------------------------------------------
    def prepare_load(
        self, host: PageSet, device: PageSet | None = None, *, after: object | None = None
    ) -> LoadHandle:
        """Queue a load of ``host`` pages (per slot-owning pool; sidecars follow the anchor).

        Without ``device`` the engine allocates the device pages (``handle.device_pages``); a
        load of exactly the same host pages that is already queued or in flight is joined
        instead (one transfer, ``handle.joined``; the handles share the device pages). With
        ``device`` the pages land there (same pools, same counts; the caller keeps owning
        them). Takes slots and pins now; runs at the next ``submit()``. ``after``: the
        ordering point the copies wait for (see ``Streams.after_compute``; default: the calling
        thread's current compute stream at submission). A load with an ``after`` is never joined.
        """
        self._check_open("load")
        hp = self._pages(host, "host", self._host_slots)
        self._host_writes.check_unpinned(hp, action="load from")
        key: tuple[tuple[PoolName, tuple[int, ...]], ...] | None = None
        if device is None:
            if self._framework_device:
                raise ConfigError(
                    f"engine {self._name!r} works on device pages the framework owns "
                    f"(device_ownership='framework'): pass the device pages to load into"
                )
            if after is None:  # a load with its own ordering point is never shared
                key = tuple((p, hp[p]) for p in self._owners if p in hp)
                shared = self._inflight.get(key)
                if shared is not None and shared.joinable:
                    shared.refs = self._ledger.joined(shared.id)
                    self._counts["loads_joined"] += 1
                    log.debug("load_joined", engine=self._name, op=shared.id, refs=shared.refs)
                    return LoadHandle(self, shared, joined=True)
            counts = {p: len(v) for p, v in hp.items()}
            dp: PageDict = dict(self._device_slots.allocate(counts).pages)
            allocated = True
        else:
            dp = self._device_pages(device)
            self._check_pairing(hp, dp)
            self._device_pins.check_unpinned(dp, action="load into")
            allocated = False
        try:
            op = self._new_op(OpKind.LOAD, hp, dp, False, allocated, key)
        except BaseException:
            if allocated:
                self._device_slots.free(dp)
            raise
        op.after = after
        self._apply(
            self._ledger.prepared(op.id, load=True, host=hp, device=dp, allocated_device=allocated)
        )
        self._queued.append(op)
        if key is not None:
            self._inflight[key] = op
        log.debug("load_prepared", engine=self._name, op=op.id, pages=op.pages)
        return LoadHandle(self, op)

    async def load(
        self, host: PageSet, device: PageSet | None = None, *, after: object | None = None
    ) -> LoadHandle:
        """Prepare a load and submit it at once (with anything else prepared).

        If the streams refuse the submission, the load is rolled back (slots and pins back)
        and TransferError is raised; nothing of it stays queued.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        handle = self.prepare_load(host, device, after=after)
        self._submit_or_roll_back(handle)
        return handle

    # ---------------------------------------------------------------------------------------
    # backups
    # ---------------------------------------------------------------------------------------
    def prepare_backup(
        self,
        device: PageSet,
        host: PageSet | None = None,
        *,
        layerwise: bool = False,
        after: object | None = None,
    ) -> BackupHandle:
        """Queue a backup of ``device`` pages (all layers) into host pages.

        Without ``host`` the engine allocates the host pages (``handle.host_pages``, the
        caller's once the backup is done). The copy stream waits for compute before it reads:
        ``after`` (a stream or an event the framework recorded; CpuFence on the CPU), or by
        default what the submitting thread's current compute stream issued so far. With ``layerwise=True`` the handle is a
        LayerwiseBackupHandle: nothing is copied at ``submit()``; each ``layer_computed(i)``
        copies layer i of every layer-wise backup of the same submission.
        """
        self._check_open("back up")
        dp = self._device_pages(device)
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
        op.after = after
        self._apply(
            self._ledger.prepared(op.id, load=False, host=hp, device=dp, allocated_host=allocated)
        )
        self._queued.append(op)
        log.debug("backup_prepared", engine=self._name, op=op.id, pages=op.pages, kind=kind.value)
        if layerwise:
            return LayerwiseBackupHandle(self, op)
        return BackupHandle(self, op)

    async def backup(
        self, device: PageSet, host: PageSet | None = None, *, after: object | None = None
    ) -> BackupHandle:
        """Prepare an all-layer backup and submit it at once (with anything else prepared).

        If the streams refuse the submission, the backup is rolled back and TransferError is
        raised, as for ``load``.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        handle = self.prepare_backup(device, host, after=after)
        self._submit_or_roll_back(handle)
        return handle

    def _submit_or_roll_back(self, handle: BackupHandle | LoadHandle) -> None:
        """Submit; if the streams refuse, roll this call's operation back, then raise.

        The caller of ``load()`` / ``backup()`` gets no handle when the submission fails, so it
        could neither wait for nor cancel its operation: the operation is given up here (its
        slots and pins back, or its share of a joined load dropped) before the error is raised.
        Operations queued with ``prepare_*`` stay queued: their callers hold their handles.
        """
        try:
            self.submit()
        except BaseException as e:
            op = handle.operation
            if op.state is not OperationState.QUEUED:
                raise
            if self.drop_handle(op) == 0:
                self._abort_queued(op, log_event="rolled_back")
            if not isinstance(e, Exception):
                raise
            cause = e.__cause__ if isinstance(e, TransferError) and e.__cause__ else e
            raise TransferError(
                f"engine {self._name!r}: the copy streams refused the submission of "
                f"{op.describe()} ({type(cause).__name__}: {cause}); it was rolled back (its "
                f"slots and pins are released, no handle is returned); "
                f"{len(self._queued)} other operation(s) stay queued"
            ) from cause

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
