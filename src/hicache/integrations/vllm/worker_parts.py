"""The engine pieces the vLLM worker's data path is made of (hicache's adapters, no vLLM import).

- host_memory_for(device): the worker's host memory: anonymous, pinned on CUDA (Pinning.ON: a
  page-locking failure is a PinnedMemoryError naming the cause, never pageable memory).
- HostRows: ``(rows, row_bytes)`` uint8 host rows on a host memory region (open_region); close().
- Order: where copies meet vLLM's compute: ``point()`` an ordering point after what the compute
  stream has issued so far (CUDA: an event recorded on the current stream; CPU: None, compute has
  finished when vLLM calls the worker), ``fence(streams, events)`` makes compute and later
  loads wait for copies still in flight (CUDA: stream waits on the GPU; CPU: the caller waits).
- open_worker_streams(device): the copy streams (hicache.adapters.streams) and their Order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from hicache.adapters.host_memory import HostRegion, open_region
from hicache.adapters.streams import CpuStreams
from hicache.domain import DeviceError, HostMemory, MemoryKind, Pinning
from hicache.domain.host_memory import ANONYMOUS
from hicache.domain.ports import Direction, Event, Streams


def host_memory_for(device: torch.device, kind: str = ANONYMOUS) -> HostMemory:
    """Host memory for rows copied to ``device``: pinned (must pin) on CUDA, unpinned on CPU."""
    pinning = Pinning.ON if device.type == "cuda" else Pinning.OFF
    return HostMemory(kind=MemoryKind(kind), pinned=pinning)


class HostRows:
    """``rows`` host rows of ``row_bytes`` each on one region of ``host_memory``."""

    def __init__(
        self, rows: int, row_bytes: int, *, host_memory: HostMemory, device: torch.device
    ) -> None:
        if rows < 1 or row_bytes < 1:
            raise DeviceError(
                f"host rows: {rows} rows of {row_bytes} bytes; expected at least one byte row"
            )
        self.region: HostRegion = open_region(
            host_memory, rows * row_bytes, device=str(device), row_bytes=row_bytes
        )
        self.tensor = self.region.tensor().view(rows, row_bytes)
        self.pinned = self.region.pinned

    def close(self) -> None:
        self.region.close()

    def __repr__(self) -> str:
        return f"<HostRows {tuple(self.tensor.shape)} on {self.region}>"


class Order(Protocol):
    def point(self) -> object | None: ...

    def fence(self, streams: Streams, events: Sequence[Event]) -> None: ...


class CpuOrder:
    """CPU: vLLM's compute is synchronous, so a save needs no ordering point; a fence waits."""

    def point(self) -> object | None:
        return None

    def fence(self, streams: Streams, events: Sequence[Event]) -> None:
        for ev in events:
            ev.wait_current()


class CudaOrder:
    """CUDA: events on vLLM's current (compute) stream; waits happen on the GPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def point(self) -> object | None:
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def fence(self, streams: Streams, events: Sequence[Event]) -> None:
        if not events:
            return
        for ev in events:
            ev.wait_current()  # the compute stream waits for the copy (GPU side)
        backup = streams.stream(Direction.BACKUP)  # type: ignore[attr-defined]
        streams.after_compute(Direction.LOAD, backup)


def open_worker_streams(device: torch.device) -> tuple[Streams, Order]:
    """Copy streams for ``device`` and the Order that ties them to vLLM's compute."""
    if device.type == "cuda":
        from hicache.adapters.streams.cuda import CudaStreams

        return CudaStreams(device), CudaOrder(device)
    return CpuStreams(name="hicache-vllm"), CpuOrder()


__all__ = ["CpuOrder", "CudaOrder", "HostRows", "Order", "host_memory_for", "open_worker_streams"]
