"""The worker side's state: its layers, host tier, copy streams, store and reports.

TransfersState is the base of hicache.integrations.vllm.worker.WorkerTransfers: the constructor
(vLLM's layers as block rows, the host tier, the copier and the copy streams, the bounded store
and the cross-TP reader, the store thread), the host tier's sizes, and what the worker reports
to the scheduler role (per-page events, finished asynchronous loads, failed hybrid loads,
failed blocks: ``drain_*``; added under one lock, from vLLM's thread and the store thread).
Step: one step's copies in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
import torch

from hicache.adapters.copy.rows import RowCopier
from hicache.domain import HostMemory
from hicache.domain.ports import Event as CopyEvent
from hicache.domain.ports import Streams
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage, BoundedTier
from hicache.integrations.vllm.block_rows import choose_copier, whole_pages
from hicache.integrations.vllm.plan import Event, StepPlan, store_tier
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.tp_reads import TpReader
from hicache.integrations.vllm.worker_host import HostTier
from hicache.integrations.vllm.worker_parts import Order, host_memory_for, open_worker_streams


@attrs.define
class Step:
    """One step's copies in flight: settled (reported, stored) once every event is done."""

    plan: StepPlan
    saves: dict[str, CopyEvent] = attrs.field(factory=dict)
    state: CopyEvent | None = None
    loads: dict[str, CopyEvent] = attrs.field(factory=dict)
    # whole-page saves: the layers vLLM reported computed (the save waits for all of them)
    computed: set[str] = attrs.field(factory=set)
    load_failed: list[BaseException] = attrs.field(factory=list)

    def events(self) -> list[CopyEvent]:
        out = [*self.saves.values(), *self.loads.values()]
        return out + ([self.state] if self.state is not None else [])

    def done(self) -> bool:
        return all(ev.query() for ev in self.events())


class TransfersState:
    """What the worker side's jobs share (see WorkerTransfers)."""

    def __init__(
        self,
        layers: Sequence[tuple[str, torch.Tensor]],
        *,
        host_bytes: int,
        store: BoundedStorage | None,
        store_key: Callable[[bytes], StoreKey],
        stats: ConnectorStats,
        rank: int = 0,
        state_layers: Sequence[tuple[str, int, torch.Tensor]] = (),
        state_host_bytes: int = 0,
        window_layers: Sequence[tuple[str, int, torch.Tensor]] = (),
        window_host_bytes: int = 0,
        copier: RowCopier | None = None,
        host_memory: HostMemory | None = None,
        streams: tuple[Streams, Order] | None = None,
        tp_reads: TpReader | None = None,
    ) -> None:
        self.rank = rank
        self.names = [n for n, _ in layers]
        self.rows = dict(layers)
        first = [t for _, t in layers] + [t for _, _, t in (*state_layers, *window_layers)]
        self.device = first[0].device if first else torch.device("cpu")
        # hybrid: (name, state group position, rows) of every state layer
        self.state_layers = list(state_layers)
        # sliding-window models: (name, sliding group position, rows) of every sliding layer
        self.window_layers = list(window_layers)
        self.tier = HostTier(
            [(n, int(r.shape[1])) for n, r in layers],
            [(n, int(r.shape[1])) for n, _, r in self.state_layers],
            host_bytes=host_bytes,
            state_host_bytes=state_host_bytes,
            window_layers=[(n, int(r.shape[1])) for n, _, r in self.window_layers],
            window_host_bytes=window_host_bytes,
            host_memory=host_memory if host_memory is not None else host_memory_for(self.device),
            device=self.device,
        )
        # every layer's block as one row where vLLM's layout puts a block's layers side by
        # side as the host page does (block_rows.whole_pages); None: one copy per layer
        self.page_rows = whole_pages([self.rows[n] for n in self.names])
        if copier is None:
            copier = choose_copier("auto", first, pinned=self.tier.pinned)
        self.copier = copier
        self.streams, self.order = (
            streams if streams is not None else open_worker_streams(self.device)
        )
        self.store: BoundedTier | None = (
            store_tier(store, lambda page: [store_key(page)]) if store is not None else None
        )
        self.store_key = store_key
        self.tp_reads = tp_reads  # pages stored at another TP size (None: own size only)
        self.stats = stats
        self._io = ThreadPoolExecutor(1, thread_name_prefix="hicache-store")
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._finished: set[str] = set()
        self._failed: set[str] = set()  # hybrid loads that failed: vLLM recomputes the request
        self._errors: set[int] = set()
        self._step = Step(StepPlan())
        self._started = False
        self._inflight: list[Step] = []  # earlier steps whose copies are not settled yet
        self._compute_point: object | None = None  # vLLM's compute up to the last start_step
        self._pending_io: list[Future[None]] = []

    @property
    def slots(self) -> int:
        return self.tier.slots

    @property
    def page_bytes(self) -> int:
        return self.tier.page_bytes

    @property
    def state_bytes(self) -> int:
        return self.tier.state_bytes

    @property
    def host(self) -> torch.Tensor:
        """The host pages, ``(slots, page_bytes)`` uint8."""
        return self.tier.pages

    @property
    def state_host(self) -> torch.Tensor:
        """The host states, ``(state_slots, state_bytes)`` uint8 (hybrid models only)."""
        return self.tier.states

    @property
    def host_pinned(self) -> bool:
        """Whether the host pages are page-locked (on CUDA)."""
        return self.tier.pinned

    def _report_when(self, settled: Future[Any], events: list[Event]) -> None:
        """Report ``events`` once ``settled`` is done (at once when it is already)."""

        def report(_f: Future[Any]) -> None:
            with self._lock:
                self._events.extend(events)

        settled.add_done_callback(report)

    # ---- reports -------------------------------------------------------------------------

    def drain_events(self) -> list[Event]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def drain_finished(self) -> set[str]:
        with self._lock:
            out, self._finished = self._finished, set()
        return out

    def drain_failed(self) -> set[str]:
        """Requests whose hybrid load failed since the last call (also in drain_finished)."""
        with self._lock:
            out, self._failed = self._failed, set()
        return out

    def drain_errors(self) -> set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out
