"""The composition root of a working runtime: plan in, host memory + pools + copies + engine out.

- Runtime: the host group, the device group, the copy backend (Transfer), the copy streams, the
  slot allocators and the transfer engine of one host group plan; an async context manager that
  opens the engine and closes everything, in reverse order, exactly once.
- open_runtime: build a Runtime for a device ("cpu", "cuda[:N]", "rocm[:N]"), allocating the
  device pools or wrapping a serving framework's tensors.

This is the only place (with the command line) that names concrete adapters: the host pool
materialiser (which takes the group's one host memory kind from the plan), the device pools,
the copy backends and the streams.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from hicache.adapters.copy import make_transfer
from hicache.adapters.device_pool import DeviceGroup, parse_torch_device
from hicache.adapters.host_pool import HostGroup, materialise_host_group
from hicache.adapters.streams import open_streams
from hicache.domain import ConfigError, HostGroupPlan, PoolName
from hicache.domain.errors import shown
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue
from hicache.domain.limits import MAX_EVENT_SETS
from hicache.domain.pins import PinTable
from hicache.domain.ports import Streams, Transfer
from hicache.domain.slots import GroupAllocator
from hicache.domain.validators import is_int
from hicache.engine import TransferEngine
from hicache.engine._scopes import innermost
from hicache.engine.engine import DEVICE_OWNERSHIP

if TYPE_CHECKING:
    from hicache.bootstrap.hicache_config import HiCacheConfig


class Runtime:
    """Everything one model rank needs to move its cache between host and device.

    ``host_slots`` is the host group's allocator; ``device_slots`` allocates device pages with
    the device pools' real capacities. Use ``async with runtime:`` (or ``open_runtime``); the
    engine is usable inside the block.
    """

    def __init__(
        self,
        *,
        plan: HostGroupPlan,
        host: HostGroup,
        device: DeviceGroup,
        transfer: Transfer,
        streams: Streams,
        device_slots: GroupAllocator,
        engine: TransferEngine,
    ) -> None:
        self.plan = plan
        self.host = host
        self.device = device
        self.transfer = transfer
        self.streams = streams
        self.host_slots = host.allocator
        self.device_slots = device_slots
        self.engine = engine
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    async def __aenter__(self) -> Runtime:
        try:
            await self.engine.__aenter__()
        except BaseException:
            self._close_resources()
            raise
        return self

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
        try:
            await self.engine.__aexit__(exc_type, exc, tb)
        finally:
            self._close_resources()

    async def aclose(self) -> None:
        """Close the engine (draining submitted copies), then streams, device and host.

        The engine is left through ``__aexit__``, so its task group is exited too: an engine
        closed with only ``aclose`` keeps its task group entered in the calling task, and the
        next cancel scope that task exits (another runtime's, a ``move_on_after``) fails with
        "Attempted to exit a cancel scope that isn't the current task's current cancel scope".
        """
        try:
            await self.engine.aclose()
            tg = self.engine._tg
            # Called inside another cancel scope (a move_on_after, a cancelled close), the
            # group is left at the ``async with`` exit instead (hicache.engine._scopes).
            if tg is None or innermost(tg.cancel_scope):
                await self.engine.__aexit__(None, None, None)
        finally:
            self._close_resources()

    def _close_resources(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            close_transfer = getattr(self.transfer, "close", None)
            if callable(close_transfer):
                close_transfer()  # the copy backends' views of host and device memory go first
            self.streams.close()
        finally:
            try:
                self.device.close()
            finally:
                self.host.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else repr(self.engine)
        return f"<Runtime {self.plan.host_memory} -> {self.streams.device}: {state}>"


def _device_slots(plan: HostGroupPlan, device: DeviceGroup) -> GroupAllocator:
    pages = {p.name: device.pool(p.name).pages for p in plan.independent_pools()}
    return GroupAllocator(plan, pages=pages)


def _check_options(huge_pages: object, event_sets: object, device_ownership: object) -> None:
    """The runtime options, checked before anything is mapped (the bounds of runtime.*)."""
    if not isinstance(huge_pages, bool):
        raise ConfigError(f"huge_pages must be True or False, got {shown(huge_pages)}")
    if not is_int(event_sets) or not 1 <= event_sets <= MAX_EVENT_SETS:  # type: ignore[operator]
        raise ConfigError(
            f"event_sets must be an integer in [1, {MAX_EVENT_SETS}], got {shown(event_sets)}"
        )
    if not isinstance(device_ownership, str) or device_ownership not in DEVICE_OWNERSHIP:
        raise ConfigError(
            f"device_ownership must be one of {', '.join(DEVICE_OWNERSHIP)}, got "
            f"{shown(device_ownership)}"
        )


def open_runtime(
    plan: HostGroupPlan,
    *,
    device: str = "cpu",
    device_tensors: Mapping[PoolName | str, Mapping[str, Sequence[Any]]] | None = None,
    device_capacities: Mapping[PoolName | str, int] | None = None,
    backend: str | Mapping[PoolName | str, str] = "auto",
    huge_pages: bool = False,
    event_sets: int = 3,
    host_pins: PinTable | None = None,
    device_pins: PinTable | None = None,
    name: str = "engine",
    device_ownership: str = "engine",
    wrap_transfer: Callable[[Transfer], Transfer] | None = None,
    config: HiCacheConfig | None = None,
) -> Runtime:
    """Materialise ``plan`` and wire an engine over it; enter the result with ``async with``.

    Host memory: the plan's one resolved kind (anonymous, shm, store-owned; pinned per its
    policy for a GPU). Device pools: allocated on ``device`` with the plan's device capacities
    (or ``device_capacities``), or, with ``device_tensors``, a serving framework's existing
    per-layer tensors (checked against the plan). ``backend`` picks the copy backend ("auto":
    the measured default per pool). ``device_ownership``: ``"engine"`` (the engine allocates
    device pages for loads that name none) or ``"framework"`` (the serving framework's allocator
    owns every device page; loads and backups name theirs, see docs/engine.md).
    ``wrap_transfer``: a function that wraps the copy backend (a test or soak tool such as
    ``hicache.bootstrap.faults.FaultyTransfer``). ``config``: a HiCacheConfig whose
    ``runtime.*`` and ``copy.backend`` keys give device, backend, huge_pages, event_sets and
    device_ownership (passing one of those as well, with another value than its default, is a
    ConfigError). Everything built so far is closed again if a step fails.
    """
    if config is not None:
        from hicache.bootstrap.hicache_config import resolve_runtime_options

        given = {
            "device": device,
            "backend": backend,
            "huge_pages": huge_pages,
            "event_sets": event_sets,
            "device_ownership": device_ownership,
        }
        options = resolve_runtime_options(config, given, "open_runtime")
        device, backend = options["device"], options["backend"]
        huge_pages, event_sets = options["huge_pages"], options["event_sets"]
        device_ownership = options["device_ownership"]
    if not isinstance(plan, HostGroupPlan):
        raise ConfigError(f"open_runtime needs a HostGroupPlan, got {type(plan).__name__}")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"the engine's name must be a non-empty string, got {shown(name)}")
    _check_options(huge_pages, event_sets, device_ownership)
    if device_tensors is not None and device_capacities is not None:
        raise ConfigError(
            "device_capacities applies to allocated device pools; wrapped device_tensors "
            "carry their own capacity: give one or the other"
        )
    host = materialise_host_group(plan, device=device, huge_pages=huge_pages)
    dev: DeviceGroup | None = None
    streams: Streams | None = None
    try:
        if device_tensors is not None:
            dev = DeviceGroup.wrap(plan, device_tensors)
            # The host group was pinned (or not) for ``device``: wrapped tensors elsewhere would
            # get pageable host memory for a GPU, or GPU settings for CPU tensors, silently.
            wanted = parse_torch_device(device)
            if dev.device != wanted:
                raise ConfigError(
                    f"device_tensors are on {dev.device}, but device={device!r} ({wanted}): "
                    f"pass the device the framework's tensors live on"
                )
        else:
            dev = DeviceGroup.allocate(plan, device=device, capacities=device_capacities)
        transfer: Transfer = make_transfer(host, dev, backend=backend)
        if wrap_transfer is not None:
            transfer = wrap_transfer(transfer)
        streams = open_streams(str(dev.device))
        device_slots = _device_slots(plan, dev)
        engine = TransferEngine(
            plan=plan,
            transfer=transfer,
            streams=streams,
            host_slots=host.allocator,
            device_slots=device_slots,
            host_pins=host_pins,
            device_pins=device_pins,
            event_sets=event_sets,
            name=name,
            device_ownership=device_ownership,
        )
    except BaseException:
        try:
            if streams is not None:
                streams.close()
            if dev is not None:
                dev.close()
        finally:
            host.close()
        raise
    return Runtime(
        plan=plan,
        host=host,
        device=dev,
        transfer=transfer,
        streams=streams,
        device_slots=device_slots,
        engine=engine,
    )


__all__ = ["Runtime", "open_runtime"]
