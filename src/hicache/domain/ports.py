"""Ports: the faces that adapters implement and the engine drives (typing.Protocol, torch-free).

- Direction: LOAD (host to device) or BACKUP (device to host).
- PageMap: host page ids and device page ids of one pool, paired 1:1, for one copy.
- Transfer: moves pages of one host group to and from one device group (per layer or all layers).
- Event: completion of work submitted to a copy stream (query, synchronize, make compute wait,
  how long the work took); an event that finished can be recorded again (reused).
- Streams: dedicated copy streams per direction that run submitted work in order; hands out idle
  events and re-records finished ones; ``after_compute`` orders a copy stream after compute
  (what the caller's thread issued so far, or an explicit ordering point).
- IdleSignal: an optional capability of Streams: call a hook from the stream's thread each time
  a stream finished its work and has nothing queued (so a waiter need not poll).
- OrderingPoint: what a load or backup is ordered after, in the adapter's own terms (a CUDA
  stream or event; on the CPU an object with ``wait()``, e.g. a CpuFence).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import attrs

from hicache.domain.errors import ConfigError
from hicache.domain.pools import PoolName

# What a copy is ordered after; its concrete types belong to the streams adapter: a
# torch.cuda.Stream or torch.cuda.Event for CUDA streams, an object with ``wait()`` (a
# threading.Event, hicache.adapters.streams.cpu.CpuFence) for CPU streams.
OrderingPoint = object


class Direction(enum.Enum):
    LOAD = "load"  # host to device
    BACKUP = "backup"  # device to host


def _ids(value: Sequence[int]) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


@attrs.frozen
class PageMap:
    """Host pages and device pages of one pool, paired 1:1 (``host_pages[i] <-> device_pages[i]``)."""

    pool: PoolName
    host_pages: tuple[int, ...] = attrs.field(converter=_ids)
    device_pages: tuple[int, ...] = attrs.field(converter=_ids)

    def __attrs_post_init__(self) -> None:
        if len(self.host_pages) != len(self.device_pages):
            raise ConfigError(
                f"pool {self.pool.value!r}: {len(self.host_pages)} host pages paired with "
                f"{len(self.device_pages)} device pages"
            )

    def __len__(self) -> int:
        return len(self.host_pages)


@runtime_checkable
class Transfer(Protocol):
    """Copies between one host group and one device group.

    Implementations issue the copies on the caller's current stream (CUDA) or perform them
    (CPU) and return the number of bytes moved. Failures raise TransferError.
    """

    @property
    def transfer_layers(self) -> int: ...

    def load_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        """Host to device: transfer layer ``layer`` of every pool that has it."""
        ...

    def backup(self, maps: Sequence[PageMap]) -> int:
        """Device to host: all layers of the given pages."""
        ...

    def backup_layer(self, layer: int, maps: Sequence[PageMap]) -> int:
        """Device to host: transfer layer ``layer`` only (layer-wise backup during prefill)."""
        ...

    def layer_bytes(self, layer: int, maps: Sequence[PageMap]) -> int:
        """Bytes that load_layer(layer, maps) moves, computed without copying."""
        ...


@runtime_checkable
class Event(Protocol):
    """Completion of work submitted to a copy stream."""

    def query(self) -> bool:
        """True once the work finished (successfully or not); never blocks."""
        ...

    def synchronize(self) -> None:
        """Block the calling thread until the work finished; raise its error if it failed."""
        ...

    def wait_current(self) -> None:
        """Order the consumer after this work: a GPU-side stream wait on CUDA, a block on CPU."""
        ...

    def exception(self) -> BaseException | None:
        """The error the work raised, once finished; None if it succeeded or is still running."""
        ...

    def elapsed_s(self) -> float | None:
        """Seconds the work occupied its stream, once finished; None while running or unknown."""
        ...


@runtime_checkable
class Streams(Protocol):
    """One dedicated copy stream per direction; work on one stream runs in submission order."""

    @property
    def device(self) -> str: ...

    def submit(
        self, direction: Direction, work: Callable[[], object], event: Event | None = None
    ) -> Event:
        """Run ``work`` on the direction's stream (it issues copies); return its completion event.

        ``event``, when given, is an event of these streams that has finished (``query()`` is
        True); it is recorded again for this work and returned, instead of a new one. An error
        that ``work`` raises is kept in the event, not raised here.
        """
        ...

    def new_event(self) -> Event:
        """An idle event (``query()`` is True, nothing recorded) to reuse with ``submit``."""
        ...

    def after_compute(self, direction: Direction, after: OrderingPoint | None = None) -> None:
        """Make the direction's stream wait for compute before the work submitted next.

        ``after=None`` (the default): what the calling thread's current compute stream has
        issued so far (CUDA; nothing to order on the CPU). Otherwise ``after`` is the ordering
        point: a stream or an event the framework recorded (CUDA), an object with ``wait()``
        (CPU). The wait happens on the copy stream; the caller never blocks.
        """
        ...

    def close(self) -> None: ...


@runtime_checkable
class IdleSignal(Protocol):
    """Optional Streams capability: a hook called when a stream ran dry.

    ``hook`` (or None to remove it) is called on the stream's own thread right after a piece
    of work finished (its event already reads as finished) and nothing else is queued on that
    stream. It must be cheap and must not raise. Streams whose completion can only be polled
    (CUDA events) do not offer it; the engine then polls with a short backoff.
    """

    def set_idle_hook(self, hook: Callable[[], None] | None) -> None: ...
