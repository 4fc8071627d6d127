"""Small working fakes of the engine's ports, shared by the engine tests (no mocks).

- FakeTransfer: host and device pools as in-memory bytes per (pool layer, page); copies them for
  real, counts calls and pages, sleeps a configurable time per call, fails on demand, and can
  hold a call at a gate until the test lets it go.
- InlineStreams: streams that run the work inside ``submit`` (as CUDA issues copies there) and
  complete at once; counts ``after_compute``.
- plans: a dense KV plan and a hybrid plan (KV anchor + K-only indexer sidecar + Mamba state on
  other layers), both small.
- Rig: plan + transfer + streams + allocators + engine, with byte checks and leak checks.
- NoEventStreams: CPU streams whose next new_event() fails once (a driver error).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hicache.adapters.streams.cpu import CpuStreams
from hicache.domain import (
    DType,
    HostGroupPlan,
    HostMemory,
    IndexerGeometry,
    KVGeometry,
    LayerBinding,
    Layout,
    MemoryKind,
    PoolName,
    PoolPlan,
    PoolRole,
    TransferError,
    mamba2_state,
)
from hicache.domain.ports import Direction, Event, PageMap, Streams
from hicache.domain.slots import GroupAllocator
from hicache.engine import TransferEngine

ANON = HostMemory(MemoryKind("anonymous"))
POISON = b"\xde\xad"


class InjectedFault(RuntimeError):
    """What FakeTransfer raises when a fault was armed."""


class Gate:
    """Holds one copy call until ``open()``; ``entered`` tells the test the call is in flight."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self._open = threading.Event()

    def open(self) -> None:
        self._open.set()

    def pass_through(self) -> None:
        self.entered.set()
        if not self._open.wait(10):  # a test that forgets to open must fail, not hang
            raise TimeoutError("gate was never opened")


class FakeTransfer:
    """The Transfer port over bytes in memory: ``host[pool][pool_layer][page]`` and ``device``."""

    def __init__(
        self,
        plan: HostGroupPlan,
        *,
        device_pages: Mapping[PoolName, int] | None = None,
        delay_s: float = 0.0,
    ) -> None:
        self.plan = plan
        self.delay_s = delay_s
        self._pools = {p.name: p for p in plan.pools}
        dev = dict(device_pages or {})
        self.host: dict[PoolName, list[list[bytes]]] = {}
        self.device: dict[PoolName, list[list[bytes]]] = {}
        for p in plan.pools:
            owner = plan.anchor.name if p.role is PoolRole.SIDECAR else p.name
            n_dev = dev.get(owner, p.pages)
            self.host[p.name] = [[b""] * p.pages for _ in range(p.layers)]
            self.device[p.name] = [[POISON] * n_dev for _ in range(p.layers)]
        self.calls: list[tuple[str, int | None, tuple[tuple[str, int], ...]]] = []
        self.pages_copied = 0
        self._faults: list[tuple[str, int | None, int]] = []
        self._gates: dict[tuple[str, int | None], Gate] = {}
        self._lock = threading.Lock()

    # -- test controls -------------------------------------------------------------------------
    def fail(self, kind: str, layer: int | None = None, times: int = 1) -> None:
        """Make the next ``times`` calls of ``kind`` ("load", "backup", "backup_layer") fail,
        at ``layer`` only if given."""
        self._faults.append((kind, layer, times))

    def gate(self, kind: str, layer: int | None = None) -> Gate:
        """Hold the next call of ``kind`` (at ``layer``) until the returned gate opens."""
        g = Gate()
        self._gates[(kind, layer)] = g
        return g

    def clear_faults(self) -> None:
        self._faults.clear()

    def calls_of(self, kind: str) -> list[tuple[str, int | None, tuple[tuple[str, int], ...]]]:
        return [c for c in self.calls if c[0] == kind]

    def fill_host(self, pool: PoolName, pages: Sequence[int], tag: str) -> None:
        for layer in range(self._pools[pool].layers):
            for page in pages:
                self.host[pool][layer][page] = f"{tag}/{pool.value}/{layer}/{page}".encode()

    def fill_device(self, pool: PoolName, pages: Sequence[int], tag: str) -> None:
        for layer in range(self._pools[pool].layers):
            for page in pages:
                self.device[pool][layer][page] = f"{tag}/{pool.value}/{layer}/{page}".encode()

    def poison_device(self, pool: PoolName, pages: Sequence[int]) -> None:
        for layer in range(self._pools[pool].layers):
            for page in pages:
                self.device[pool][layer][page] = POISON

    # -- the port ------------------------------------------------------------------------------
    @property
    def transfer_layers(self) -> int:
        return self.plan.transfer_layers

    def _enter(self, kind: str, layer: int | None, maps: Sequence[PageMap]) -> None:
        with self._lock:
            self.calls.append((kind, layer, tuple((m.pool.value, len(m)) for m in maps)))
            gate = self._gates.pop((kind, layer), None) or self._gates.pop((kind, None), None)
            fault = None
            for i, (k, at, _times) in enumerate(self._faults):
                if k == kind and (at is None or at == layer):
                    fault = i
                    break
            if fault is not None:
                k, at, times = self._faults[fault]
                if times <= 1:
                    del self._faults[fault]
                else:
                    self._faults[fault] = (k, at, times - 1)
        if gate is not None:
            gate.pass_through()
        if self.delay_s:
            time.sleep(self.delay_s)
        if fault is not None:
            raise InjectedFault(f"injected {kind} fault at layer {layer}")

    def _copy(self, layer: int, maps: Sequence[PageMap], to_device: bool) -> int:
        moved = 0
        for m in maps:
            pool = self._pools[m.pool]
            pl = pool.binding.pool_layer(layer)
            if pl is None:
                continue
            src = self.host[m.pool][pl] if to_device else self.device[m.pool][pl]
            dst = self.device[m.pool][pl] if to_device else self.host[m.pool][pl]
            for h, d in zip(m.host_pages, m.device_pages, strict=True):
                if to_device:
                    dst[d] = src[h]
                else:
                    dst[h] = src[d]
                self.pages_copied += 1
            moved += self._bytes(m, pool)
        return moved

    @staticmethod
    def _bytes(m: PageMap, pool: PoolPlan) -> int:
        return len(m) * pool.page_size * pool.bytes_per_unit_per_layer

    def load_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        self._enter("load", layer, maps)
        return self._copy(layer, maps, to_device=True)

    def backup(self, maps: Sequence[PageMap]) -> int:
        self._enter("backup", None, maps)
        return sum(self._copy(t, maps, to_device=False) for t in range(self.plan.transfer_layers))

    def backup_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        self._enter("backup_layer", layer, maps)
        return self._copy(layer, maps, to_device=False)

    def layer_bytes(self, layer: int, maps: Sequence[PageMap]) -> int:
        total = 0
        for m in maps:
            pool = self._pools[m.pool]
            if pool.binding.pool_layer(layer) is not None:
                total += self._bytes(m, pool)
        return total


class _DoneEvent:
    """An event that completed inside submit (InlineStreams)."""

    def __init__(self) -> None:
        self.exc: BaseException | None = None
        self.elapsed = 0.0

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        if self.exc is not None:
            raise self.exc

    def wait_current(self) -> None:
        return None

    def exception(self) -> BaseException | None:
        return self.exc

    def elapsed_s(self) -> float | None:
        return self.elapsed


class InlineStreams:
    """Runs work inside submit, like CUDA issuing copies on the caller's thread."""

    def __init__(self) -> None:
        self.after_compute_calls: list[Direction] = []
        self.submitted: list[Direction] = []
        self.closed = False

    @property
    def device(self) -> str:
        return "inline"

    def new_event(self) -> Event:
        return _DoneEvent()

    def submit(
        self, direction: Direction, work: Callable[[], object], event: Event | None = None
    ) -> Event:
        if self.closed:
            raise TransferError("inline streams are closed")
        ev = event if isinstance(event, _DoneEvent) else _DoneEvent()
        ev.exc = None
        start = time.perf_counter()
        try:
            work()
        except BaseException as e:
            ev.exc = e
        ev.elapsed = time.perf_counter() - start
        self.submitted.append(direction)
        return ev

    def after_compute(self, direction: Direction) -> None:
        self.after_compute_calls.append(direction)

    def close(self) -> None:
        self.closed = True


# -- plans -------------------------------------------------------------------------------------
KV = KVGeometry(kv_heads=1, head_dim=8, dtype=DType.BF16)
INDEXER = IndexerGeometry(heads=1, head_dim=8, dtype=DType.BF16)
STATE = mamba2_state(heads=1, head_dim=4, state_size=2, n_groups=1, conv_kernel=2)


def dense_plan(layers: int = 4, *, pages: int = 8, page_size: int = 4) -> HostGroupPlan:
    return HostGroupPlan(
        host_memory=ANON,
        pools=[
            PoolPlan(
                name=PoolName.KV,
                role=PoolRole.ANCHOR,
                geometry=KV,
                binding=LayerBinding.contiguous(list(range(layers))),
                layout=Layout.PAGE_FIRST,
                page_size=page_size,
                capacity=pages * page_size,
                device_capacity=pages * page_size,
            )
        ],
    )


def hybrid_plan(*, pages: int = 8, page_size: int = 4, slots: int = 4) -> HostGroupPlan:
    """6 transfer layers: attention (KV + indexer sidecar) on 0, 3; Mamba state on 1, 2, 4, 5."""
    attn = [0, 3]
    state = [1, 2, 4, 5]
    return HostGroupPlan(
        host_memory=ANON,
        pools=[
            PoolPlan(
                name=PoolName.KV,
                role=PoolRole.ANCHOR,
                geometry=KV,
                binding=LayerBinding.contiguous(attn),
                layout=Layout.PAGE_FIRST,
                page_size=page_size,
                capacity=pages * page_size,
                device_capacity=pages * page_size,
            ),
            PoolPlan(
                name=PoolName.INDEXER,
                role=PoolRole.SIDECAR,
                geometry=INDEXER,
                binding=LayerBinding.contiguous(attn),
                layout=Layout.PAGE_FIRST,
                page_size=page_size,
                capacity=pages * page_size,
                device_capacity=pages * page_size,
            ),
            PoolPlan(
                name=PoolName.MAMBA,
                role=PoolRole.INDEPENDENT,
                geometry=STATE,
                binding=LayerBinding.contiguous(state),
                layout=Layout.PAGE_FIRST,
                page_size=1,
                capacity=slots,
                device_capacity=slots,
            ),
        ],
    )


def device_pages_of(plan: HostGroupPlan) -> dict[PoolName, int]:
    return {
        p.name: (p.device_capacity or p.capacity) // p.page_size for p in plan.independent_pools()
    }


class Rig:
    """Everything an engine test needs, built from a plan."""

    def __init__(
        self,
        plan: HostGroupPlan | None = None,
        *,
        delay_s: float = 0.0,
        streams: Streams | None = None,
        event_sets: int = 3,
    ) -> None:
        self.plan = plan if plan is not None else dense_plan()
        dev = device_pages_of(self.plan)
        self.transfer = FakeTransfer(self.plan, device_pages=dev, delay_s=delay_s)
        self.streams: Streams = streams if streams is not None else CpuStreams(name="test")
        self.host_slots = GroupAllocator(self.plan)
        self.device_slots = GroupAllocator(self.plan, pages=dev)
        self.engine = TransferEngine(
            plan=self.plan,
            transfer=self.transfer,
            streams=self.streams,
            host_slots=self.host_slots,
            device_slots=self.device_slots,
            event_sets=event_sets,
        )

    @property
    def layers(self) -> int:
        return self.plan.transfer_layers

    def owners(self) -> list[PoolName]:
        return [p.name for p in self.plan.independent_pools()]

    def sidecars(self) -> list[PoolName]:
        return [p.name for p in self.plan.pools if p.role is PoolRole.SIDECAR]

    def host_prefix(self, tag: str, counts: Mapping[PoolName, int]) -> dict[PoolName, list[int]]:
        """Allocate host pages, fill them with tagged bytes (sidecars too), return them."""
        pages = {p: list(v) for p, v in self.host_slots.allocate(counts).pages.items()}
        for pool, ids in pages.items():
            self.transfer.fill_host(pool, ids, tag)
            if pool is self.plan.anchor.name:
                for side in self.sidecars():
                    self.transfer.fill_host(side, ids, tag)
        return pages

    def layer_ok(
        self,
        layer: int,
        host: Mapping[PoolName, Sequence[int]],
        device: Mapping[PoolName, Sequence[int]],
    ) -> bool:
        """Whether every pool that has ``layer`` holds the host bytes on the device."""
        for pool in self.plan.pools:
            owner = self.plan.anchor.name if pool.role is PoolRole.SIDECAR else pool.name
            pl = pool.binding.pool_layer(layer)
            if pl is None or owner not in host:
                continue
            for h, d in zip(host[owner], device[owner], strict=True):
                if self.transfer.device[pool.name][pl][d] != self.transfer.host[pool.name][pl][h]:
                    return False
        return True

    def backed_up(
        self,
        device: Mapping[PoolName, Sequence[int]],
        host: Mapping[PoolName, Sequence[int]],
        layers: Sequence[int] | None = None,
    ) -> bool:
        for layer in layers if layers is not None else range(self.layers):
            for pool in self.plan.pools:
                owner = self.plan.anchor.name if pool.role is PoolRole.SIDECAR else pool.name
                pl = pool.binding.pool_layer(layer)
                if pl is None or owner not in device:
                    continue
                for d, h in zip(device[owner], host[owner], strict=True):
                    if (
                        self.transfer.host[pool.name][pl][h]
                        != self.transfer.device[pool.name][pl][d]
                    ):
                        return False
        return True

    def poison(self, device: Mapping[PoolName, Sequence[int]]) -> None:
        for pool, ids in device.items():
            self.transfer.poison_device(pool, ids)
            if pool is self.plan.anchor.name:
                for side in self.sidecars():
                    self.transfer.poison_device(side, ids)

    def assert_no_leaks(
        self,
        *,
        host_used: Mapping[PoolName, int] | None = None,
        device_used: Mapping[PoolName, int] | None = None,
    ) -> None:
        """Pins empty and each allocator at the expected use (default: nothing used)."""
        assert len(self.engine.host_pins) == 0, self.engine.host_pins.snapshot()
        assert len(self.engine.device_pins) == 0, self.engine.device_pins.snapshot()
        for name, free in self.host_slots.free_counts().items():
            total = self.host_slots.allocator(name).pages
            assert total - free == (host_used or {}).get(name, 0), (name, total, free)
        for name, free in self.device_slots.free_counts().items():
            total = self.device_slots.allocator(name).pages
            assert total - free == (device_used or {}).get(name, 0), (name, total, free)

    def close_streams(self) -> None:
        self.streams.close()


class GatedTransfer:
    """Wraps a real Transfer; holds one call (kind, layer) at a gate, delegates the rest."""

    def __init__(self, inner: Any, kind: str, layer: int | None = None) -> None:
        self.inner = inner
        self.kind = kind
        self.layer = layer
        self.gate = Gate()
        self._armed = True

    def _maybe_hold(self, kind: str, layer: int | None) -> None:
        if self._armed and kind == self.kind and (self.layer is None or layer == self.layer):
            self._armed = False
            self.gate.pass_through()

    @property
    def transfer_layers(self) -> int:
        return int(self.inner.transfer_layers)

    def load_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        self._maybe_hold("load", layer)
        return int(self.inner.load_layer(layer, maps))

    def backup(self, maps: Sequence[PageMap]) -> int:
        self._maybe_hold("backup", None)
        return int(self.inner.backup(maps))

    def backup_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        self._maybe_hold("backup_layer", layer)
        return int(self.inner.backup_layer(layer, maps))

    def layer_bytes(self, layer: int, maps: Sequence[PageMap]) -> int:
        return int(self.inner.layer_bytes(layer, maps))


class NoEventStreams(CpuStreams):
    """CPU streams whose next new_event() fails once, as a driver error would."""

    def __init__(self) -> None:
        super().__init__(name="no-event")
        self.fail_next = False

    def new_event(self):  # type: ignore[no-untyped-def]
        if self.fail_next:
            self.fail_next = False
            raise InjectedFault("no event could be created")
        return super().new_event()
