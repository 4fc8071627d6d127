"""CUDA streams (ROCm through the same torch.cuda API): one copy stream per direction.

- CudaEvent: a pair of timing events around the work; ``wait_current`` makes the caller's current
  stream wait on it on the GPU (the CPU does not block); re-recorded when reused.
- CudaStreams: the Streams port on a GPU. ``submit`` runs the work on the calling thread under
  ``torch.cuda.stream(copy_stream)`` (the work issues asynchronous copies), then records the
  event; ``after_compute`` makes a copy stream wait on the compute stream, so that a backup reads
  what compute wrote.

Host buffers must be page-locked for the copies to be asynchronous; that is the host memory
adapters' job, checked when the group is materialised, not here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from hicache.domain.errors import DeviceError, EngineClosedError, TransferError
from hicache.domain.ports import Direction, Event


class CudaEvent:
    """Completion of one piece of work on a CUDA copy stream."""

    __slots__ = ("_device", "_end", "_exc", "_recorded", "_start")

    def __init__(self, device: torch.device) -> None:
        self._device = device
        # torch creates the CUDA events lazily, on their first record; an unrecorded event
        # queries as complete, which is what an idle event must do.
        self._start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        self._exc: BaseException | None = None
        self._recorded = False

    def query(self) -> bool:
        return bool(self._end.query())  # type: ignore[no-untyped-call]

    def synchronize(self) -> None:
        self._end.synchronize()
        if self._exc is not None:
            raise self._exc

    def wait_current(self) -> None:
        """Make the current stream of the event's device wait on the GPU; the CPU goes on."""
        if self._recorded:
            torch.cuda.current_stream(self._device).wait_event(self._end)

    def exception(self) -> BaseException | None:
        return self._exc if self.query() else None

    def elapsed_s(self) -> float | None:
        if not self._recorded or not self.query():
            return None
        return float(self._start.elapsed_time(self._end)) / 1e3

    def __repr__(self) -> str:
        if not self._recorded:
            return f"<CudaEvent {self._device}: idle>"
        state = "done" if self.query() else "pending"
        if self._exc is not None:
            state = f"failed ({type(self._exc).__name__})"
        return f"<CudaEvent {self._device}: {state}>"


def _check_device(device: str | int | torch.device) -> torch.device:
    if not torch.cuda.is_available():
        raise DeviceError(
            f"CUDA streams need a CUDA or ROCm device, but torch {torch.__version__} sees none; "
            f"use CpuStreams on a machine without a GPU"
        )
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise DeviceError(f"device {str(dev)!r} is not a CUDA device: expected 'cuda' or 'cuda:N'")
    index = torch.cuda.current_device() if dev.index is None else int(dev.index)
    if index >= torch.cuda.device_count():
        raise DeviceError(
            f"device {str(dev)!r} does not exist: this machine has {torch.cuda.device_count()} GPU(s)"
        )
    return torch.device("cuda", index)


class CudaStreams:
    """The Streams port on a GPU: a dedicated stream per direction on one device."""

    def __init__(self, device: str | int | torch.device = "cuda", *, priority: int = 0) -> None:
        self._device = _check_device(device)
        self._streams = {
            d: torch.cuda.Stream(device=self._device, priority=priority)  # type: ignore[no-untyped-call]
            for d in Direction
        }
        self._closed = False
        self._lock = threading.Lock()
        self._submitted = dict.fromkeys(Direction, 0)

    @property
    def device(self) -> str:
        return str(self._device)

    @property
    def closed(self) -> bool:
        return self._closed

    def stream(self, direction: Direction) -> torch.cuda.Stream:
        return self._streams[direction]

    def new_event(self) -> CudaEvent:
        return CudaEvent(self._device)

    def submit(
        self, direction: Direction, work: Callable[[], object], event: Event | None = None
    ) -> CudaEvent:
        if self._closed:
            raise EngineClosedError(f"{self!r} is closed: cannot submit {direction.value} work")
        if event is None:
            ev = CudaEvent(self._device)
        elif not isinstance(event, CudaEvent):
            raise TransferError(
                f"event {event!r} does not belong to CUDA streams: expected a CudaEvent from "
                f"new_event() or submit()"
            )
        elif not event.query():
            raise TransferError(
                f"event {event!r} is still in flight: only a finished event can be recorded again"
            )
        else:
            ev = event
        stream = self._streams[direction]
        ev._exc = None
        ev._start.record(stream)
        try:
            with torch.cuda.stream(stream):
                work()
        except BaseException as e:  # the event carries it, as on the CPU streams
            ev._exc = e
        ev._end.record(stream)
        ev._recorded = True
        self._submitted[direction] += 1
        return ev

    def after_compute(self, direction: Direction, after: object | None = None) -> None:
        """The direction's stream waits (on the GPU) for compute; the CPU goes on.

        ``after=None``: what the calling thread's current stream has issued so far. A
        ``torch.cuda.Stream``: what that stream has issued so far (an overlap scheduler's
        forward stream, whatever thread calls). A ``torch.cuda.Event``: the work the framework
        recorded it after.
        """
        copy = self._streams[direction]
        if after is None:
            copy.wait_stream(torch.cuda.current_stream(self._device))
        elif isinstance(after, torch.cuda.Event):
            copy.wait_event(after)
        elif isinstance(after, torch.cuda.Stream):
            copy.wait_stream(after)
        else:
            raise TransferError(
                f"ordering point {after!r} cannot order CUDA streams: expected a "
                f"torch.cuda.Stream or torch.cuda.Event"
            )

    def close(self) -> None:
        """Wait for both copy streams to drain; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for stream in self._streams.values():
            stream.synchronize()

    def __enter__(self) -> CudaStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"<CudaStreams {self._device}: closed>"
        inner = ", ".join(f"{d.value} {n} submitted" for d, n in self._submitted.items())
        return f"<CudaStreams {self._device}: {inner}>"
