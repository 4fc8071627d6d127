"""The worker side's data path: host memory, whole-block copies and store I/O (no vLLM import).

- block_rows, state_rows, choose_copier: re-exported from hicache.integrations.vllm.block_rows
  (vLLM's caches as whole-block byte rows; the copier of the ``copy_backend`` setting).
- The host tier (pages of one block of every attention layer, a hybrid model's states and a
  sliding-window model's window pages) is hicache.integrations.vllm.worker_host.HostTier, on
  hicache's host-memory adapters.
- WorkerTransfers: runs a StepPlan on hicache's copy streams (hicache.adapters.streams: CUDA
  streams, or the CPU worker threads). Synchronous loads are issued layer by layer on the load
  stream, each with an event (``wait_layer`` makes vLLM's compute wait on it); saves are issued
  on the backup stream as vLLM reports each layer computed, ordered after that layer's compute.
  ``finish_step`` waits for nothing: a step's copies settle later (``poll``: events reported,
  store writes started), and ``fence`` orders the next step's compute and loads after copies
  still in flight, so vLLM may free and reuse the blocks at once. Store writes and
  asynchronous loads (store -> host -> device) run on a store thread; a page stored at another
  tensor parallel size is read through hicache.integrations.vllm.tp_reads.TpReader (the head
  slices this rank needs, assembled in its host slot). ``drain_events`` /
  ``drain_finished`` / ``drain_errors`` give what happened since the last call (the
  scheduler's metadata and vLLM's error hooks).

A failed copy or store call never raises into vLLM's forward pass: its pages are reported
failed (the scheduler drops them) and its device blocks are reported as load errors (vLLM
recomputes them). Every store call is bounded (hicache.engine.bounded): one that overran
``deadline_s + grace_s`` is answered as failed, and the events that end its host slots' pins
(STORE for a write, LOAD for a read) wait until the store call really returned, so the
scheduler never hands a slot the store may still read or write to another page.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar

import attrs
import torch

from hicache.adapters.copy.rows import RowCopier
from hicache.domain import HostMemory
from hicache.domain.ports import Direction, Streams
from hicache.domain.ports import Event as CopyEvent
from hicache.domain.storage import StoreKey, StoreStatus
from hicache.engine.bounded import Answer, BoundedStorage, BoundedTier
from hicache.integrations.vllm.block_rows import block_rows, choose_copier, state_rows
from hicache.integrations.vllm.plan import (
    Event,
    LoadOp,
    Op,
    SaveOp,
    StateLoad,
    StateSave,
    StepPlan,
    is_window,
    store_tier,
)
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.tp_reads import TpReader
from hicache.integrations.vllm.worker_host import HostTier
from hicache.integrations.vllm.worker_parts import (
    CpuOrder,
    CudaOrder,
    Order,
    host_memory_for,
    open_worker_streams,
)

_T = TypeVar("_T")


@attrs.define
class _Step:
    """One step's copies in flight: settled (reported, stored) once every event is done."""

    plan: StepPlan
    saves: dict[str, CopyEvent] = attrs.field(factory=dict)
    state: CopyEvent | None = None
    loads: dict[str, CopyEvent] = attrs.field(factory=dict)
    load_failed: list[BaseException] = attrs.field(factory=list)

    def events(self) -> list[CopyEvent]:
        out = [*self.saves.values(), *self.loads.values()]
        return out + ([self.state] if self.state is not None else [])

    def done(self) -> bool:
        return all(ev.query() for ev in self.events())


class WorkerTransfers:
    """Host pages and the copies of one worker (one TP rank). See the module docstring."""

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
        self._step = _Step(StepPlan())
        self._started = False
        self._inflight: list[_Step] = []  # earlier steps whose copies are not settled yet
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

    # ---- one step ------------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        """This step's plan (vLLM binds it before the forward; saves may start at once)."""
        self.poll()
        self.fence()
        self._step = _Step(plan)
        self._started = False
        # Hit tokens are counted by the scheduler side (SchedulerSide.build), whose stats vLLM
        # adds to the workers' (vllm/v1/core/sched/scheduler.py): counted here too they doubled.

    def fence(self) -> None:
        """Order what comes next (vLLM's compute, this worker's loads) after every device-to-
        host copy still in flight: vLLM may have given their blocks to other requests (a
        finished or preempted request's blocks are freed at once). On CUDA the streams wait
        on the GPU; on the CPU the caller waits."""
        pending = [ev for st in self._inflight for ev in (*st.saves.values(), st.state) if ev]
        pending = [ev for ev in pending if not ev.query()]
        if pending:
            self.order.fence(self.streams, pending)

    def start_step(self, plan: StepPlan | None = None) -> None:
        """Start the bound plan's loads (binding ``plan`` first when given)."""
        if plan is not None:
            self.bind(plan)
        if self._started:
            return
        self._started = True
        step = self._step
        loads = [op for op in step.plan.loads if op.keys]
        if loads or step.plan.async_loads:
            # vLLM zeroes newly allocated blocks on its current stream before this hook: the
            # loads into them come after (CUDA: the load stream waits on the GPU; CPU: no-op)
            self._compute_point = self.order.point()
        if loads:
            self.streams.after_compute(Direction.LOAD, self._compute_point)
            slots = [s for op in loads for s in op.slots]
            blocks = [b for op in loads for b in op.blocks]
            for name in self.names:
                step.loads[name] = self.streams.submit(
                    Direction.LOAD, self._loader(step, name, slots, blocks)
                )
        for op in step.plan.async_loads:
            self._pending_io.append(self._background(self._async_load, op))

    def _background(self, fn: Callable[[_T], None], arg: _T) -> Future[None]:
        """Run ``fn(arg)`` on the store thread; inline once no thread can start any more.

        At interpreter exit Python's concurrent.futures refuses new work ("cannot schedule new
        futures after interpreter shutdown") before vLLM's exit hook closes the connector; the
        store writes and reads that close() settles then run here, each bounded by the storage
        tier's deadline, so their pins are released and their events reported as usual.
        """
        try:
            return self._io.submit(fn, arg)
        except RuntimeError:
            done: Future[None] = Future()
            try:
                fn(arg)
            except BaseException as e:  # reported through the future, as from the thread
                done.set_exception(e)
            else:
                done.set_result(None)
            return done

    def wait_layer(self, name: str) -> None:
        """Make vLLM's compute wait for this step's loads of layer ``name`` (CUDA: the current
        stream waits on the load's event, the CPU goes on; CPU: the caller waits)."""
        ev = self._step.loads.get(name)
        if ev is not None:
            ev.wait_current()  # an error is settled with the step

    def save_layer(self, name: str) -> None:
        """vLLM computed layer ``name`` for this step: copy its saved blocks on the copy
        stream, after the compute issued so far."""
        step = self._step
        if step.plan.saves and name in self.rows and name not in step.saves:
            self.streams.after_compute(Direction.BACKUP, self.order.point())
            step.saves[name] = self.streams.submit(
                Direction.BACKUP, lambda: self._save_rows(name, step.plan.saves)
            )

    def finish_step(self) -> None:
        """End the step without waiting for its copies: submit what is left (saves of layers
        vLLM did not report, the states), report the loads' errors, and settle the step once
        its copies are done (poll)."""
        step = self._step
        self.start_step()  # vLLM calls start_load_kv after the forward when no load is sync
        for name in self.names:
            self.save_layer(name)
        if step.plan.state_saves:
            self.streams.after_compute(Direction.BACKUP, self.order.point())
            step.state = self.streams.submit(
                Direction.BACKUP, lambda: self._save_states(step.plan.state_saves)
            )
        if step.loads and isinstance(self.order, CpuOrder):
            for ev in step.loads.values():
                ev.wait_current()  # done already: vLLM waited for each layer
        if step.load_failed:  # vLLM recomputes the blocks (an issue failure is known at once)
            with self._lock:
                for op in step.plan.loads:
                    self._errors.update(op.blocks)
        with self._lock:
            for op in step.plan.loads:
                self._errors.update(op.missing)
        if step.plan.saves or step.plan.state_saves or step.plan.loads:
            self._inflight.append(step)
        self._step = _Step(StepPlan())
        self._started = False
        self.poll()

    def poll(self) -> None:
        """Settle every earlier step whose copies are done (never waits)."""
        done = [st for st in self._inflight if st.done()]
        if done:
            self._inflight = [st for st in self._inflight if st not in done]
            for st in done:
                self._settle(st)
        self._pending_io = [f for f in self._pending_io if not f.done()]

    def wait_saves(self) -> None:
        """Wait (on the host) for every copy submitted so far and settle it: tests, shutdown
        and vLLM steps without a forward."""
        for st in list(self._inflight):
            for ev in st.events():
                with contextlib.suppress(Exception):  # a failure is settled (reported) below
                    ev.synchronize()
        self.poll()

    def _settle(self, step: _Step) -> None:
        """Report one step's copies (events, stats) and start its store writes."""
        plan = step.plan
        state_exc = step.state.exception() if step.state is not None else None
        if state_exc is not None:
            self.stats.error("save", type(state_exc).__name__)
        save_excs = [e for ev in step.saves.values() if (e := ev.exception()) is not None]
        failed_save = bool(save_excs)
        for exc in {type(e).__name__ for e in save_excs}:
            self.stats.error("save", exc)
        load_excs = list(step.load_failed)
        load_excs += [e for ev in step.loads.values() if (e := ev.exception()) is not None]
        for exc in {type(e).__name__ for e in load_excs}:
            self.stats.error("load", exc)
        events: list[Event] = []
        save_s = sum(ev.elapsed_s() or 0.0 for ev in step.saves.values())  # copy stream time
        if plan.saves:
            self.stats.add("save_s", save_s)
        for save in plan.saves:
            events.append(Event(Op.SAVE, save.key, not failed_save, self.page_bytes))
            if save.store and (failed_save or self.store is None):
                events.append(Event(Op.STORE, save.key, False))
        if plan.saves:
            self.stats.save(
                pages=0 if failed_save else len(plan.saves),
                nbytes=0 if failed_save else self.page_bytes * len(plan.saves),
                seconds=save_s,
                ok=not failed_save,
            )
        if plan.saves and not failed_save:
            self.stats.add("save_bytes", self.page_bytes * len(plan.saves))
            stored: list[SaveOp | StateSave] = [op for op in plan.saves if op.store]
            if stored and self.store is not None:
                self._pending_io.append(self._background(self._store_pages, stored))
        elif plan.saves:
            self.stats.add("save_errors", len(plan.saves))
        for ss in plan.state_saves:
            events.append(Event(Op.SAVE, ss.key, state_exc is None, self.tier.nbytes(ss.key)))
            if ss.store and (state_exc is not None or self.store is None):
                events.append(Event(Op.STORE, ss.key, False))
        if plan.state_saves and state_exc is None:
            self.stats.add("save_bytes", sum(self.tier.nbytes(ss.key) for ss in plan.state_saves))
            stored_states: list[SaveOp | StateSave] = [op for op in plan.state_saves if op.store]
            if stored_states and self.store is not None:
                self._pending_io.append(self._background(self._store_pages, stored_states))
        elif plan.state_saves:
            self.stats.add("save_errors", len(plan.state_saves))
        ok = not load_excs  # vLLM was told of the failed blocks when the step ended
        n = sum(len(op.keys) for op in plan.loads)
        load_s = sum(ev.elapsed_s() or 0.0 for ev in step.loads.values()) if n else 0.0
        share = load_s / n if n and ok else 0.0  # each page's share (the load policy's figure)
        for op in plan.loads:
            events.extend(Event(Op.LOAD, k, ok, self.page_bytes, share) for k in op.keys)
        if n:
            self.stats.add("load_s", load_s)
            self.stats.add("load_bytes" if ok else "load_errors", self.page_bytes * n if ok else n)
            self.stats.load(
                pages=n if ok else 0,
                nbytes=self.page_bytes * n if ok else 0,
                seconds=load_s,
                ok=ok,
            )
        with self._lock:
            self._events.extend(events)

    # ---- the copies (issued on the copy streams) -----------------------------------------

    def _loader(
        self, step: _Step, name: str, slots: Sequence[int], blocks: Sequence[int]
    ) -> Callable[[], None]:

        def load() -> None:
            try:
                self.copier.copy(self.rows[name], blocks, self.tier.layer(name), slots)
            except BaseException as exc:
                step.load_failed.append(exc)
                raise

        return load

    def _save_rows(self, name: str, saves: Sequence[SaveOp]) -> None:
        self.copier.copy(
            self.tier.layer(name),
            [op.slot for op in saves],
            self.rows[name],
            [op.block for op in saves],
        )

    def _group_layers(self, window: bool) -> list[tuple[torch.Tensor, int, torch.Tensor]]:
        """(host columns, group position, device rows) of every state or sliding layer."""
        if window:
            return [(self.tier.window(n), g, rows) for n, g, rows in self.window_layers]
        return [(self.tier.state(n), g, rows) for n, g, rows in self.state_layers]

    def _save_states(self, saves: Sequence[StateSave]) -> None:
        """States and window pages: one block of each group per save."""
        for window in (False, True):
            mine = [op for op in saves if is_window(op.key) == window]
            if not mine:
                continue
            slots = [op.slot for op in mine]
            for host, group, rows in self._group_layers(window):
                self.copier.copy(host, slots, rows, [op.blocks[group] for op in mine])

    def _to_device_now(self, work: Callable[[], None]) -> None:
        """Host-to-device copies off vLLM's step (store thread): on the load stream, after
        the saves in flight, waited for here."""
        if isinstance(self.order, CudaOrder):
            backup = self.streams.stream(Direction.BACKUP)  # type: ignore[attr-defined]
            self.streams.after_compute(Direction.LOAD, backup)
            if self._compute_point is not None:  # vLLM's zeroing of the blocks
                self.streams.after_compute(Direction.LOAD, self._compute_point)
        else:
            with self._lock:
                inflight = list(self._inflight)
            for st in inflight:
                for ev in (*st.saves.values(), st.state):
                    if ev is not None:
                        ev.wait_current()
        self.streams.submit(Direction.LOAD, work).synchronize()

    def _load_groups(self, loads: Sequence[StateLoad]) -> None:
        """States and window pages into their groups' blocks."""

        def work() -> None:
            for window in (False, True):
                mine = [op for op in loads if is_window(op.key) == window]
                if not mine:
                    continue
                slots = [op.slot for op in mine]
                for host, group, rows in self._group_layers(window):
                    self.copier.copy(rows, [op.blocks[group] for op in mine], host, slots)

        self._to_device_now(work)

    def _copy_pages(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        def work() -> None:
            for name in self.names:
                self.copier.copy(self.rows[name], blocks, self.tier.layer(name), slots)

        self._to_device_now(work)

    # ---- store I/O (store thread) --------------------------------------------------------

    @property
    def host_pinned(self) -> bool:
        """Whether the host pages are page-locked (on CUDA)."""
        return self.tier.pinned

    def _store_pages(self, saves: Sequence[SaveOp | StateSave]) -> None:
        assert self.store is not None
        t0 = time.perf_counter()
        settled: Future[Any] = Future()
        try:
            answer = self.store.write_each(
                [op.key for op in saves], [self.tier.page(op.slot, op.key) for op in saves]
            )
        except Exception as exc:  # e.g. a key the store cannot name: simply not stored
            settled.set_result(None)  # the call ended with its exception
            oks = [False] * len(saves)
            self.stats.error("put", type(exc).__name__)
        else:
            settled = answer.settled
            oks = [s.ok for s in answer.value]
            if not answer.answered:  # timeout, stuck or closed: its pages are not stored
                self.stats.error("put", answer.outcome.value)
            else:
                for s in answer.value:
                    if not s.ok:
                        self.stats.error("put", s.value)
        good = sum(oks)
        store_s = time.perf_counter() - t0
        self.stats.add("store_s", store_s)
        self.stats.add(
            "store_bytes",
            sum(self.tier.nbytes(op.key) for op, ok in zip(saves, oks, strict=True) if ok),
        )
        self.stats.add("store_errors", len(saves) - good)
        # STORE ends the slots' pins: only once the store no longer reads them
        self._report_when(
            settled,
            [
                Event(Op.STORE, op.key, ok, self.tier.nbytes(op.key), store_s / len(saves))
                for op, ok in zip(saves, oks, strict=True)
            ],
        )

    def _report_when(self, settled: Future[Any], events: list[Event]) -> None:
        """Report ``events`` once ``settled`` is done (at once when it is already)."""

        def report(_f: Future[Any]) -> None:
            with self._lock:
                self._events.extend(events)

        settled.add_done_callback(report)

    def _async_load(self, op: LoadOp) -> None:
        t0 = time.perf_counter()
        keys = list(op.keys)
        slots = list(op.slots)
        from_storage = list(op.from_storage)
        writers = list(op.writers) or [0] * len(keys)
        groups = [*op.windows, *([op.state] if op.state is not None else [])]
        for g in groups:  # window pages and the state: read with the pages; copied last
            keys.append(g.key)
            slots.append(g.slot)
            from_storage.append(g.from_storage)
            writers.append(0)
        reads = [i for i, s in enumerate(from_storage) if s]
        status: dict[int, bool] = {}
        settled: Future[Any] | None = None  # done once the store no longer writes the slots
        read_s = 0.0
        if reads:
            assert self.store is not None
            try:
                answer = self._read_each(
                    [keys[i] for i in reads], [slots[i] for i in reads], [writers[i] for i in reads]
                )
            except Exception as exc:  # e.g. a key the store cannot name: the call ended
                status = dict.fromkeys(reads, False)
                self.stats.error("get", type(exc).__name__)
            else:
                settled = answer.settled
                status = {i: s.ok for i, s in zip(reads, answer.value, strict=True)}
                if not answer.answered:  # timeout, stuck or closed: a failed load, recomputed
                    self.stats.error("get", answer.outcome.value)
                else:
                    for s in answer.value:
                        if not s.ok:
                            self.stats.error("get", s.value)
            read_s = time.perf_counter() - t0
        good = 0
        while good < len(op.keys) and status.get(good, True):
            good += 1
        read_ok = sum(self.tier.nbytes(keys[i]) for i, ok in status.items() if ok)
        self.stats.add("read_bytes", read_ok)
        self.stats.add("read_errors", sum(1 for ok in status.values() if not ok))
        groups_ok = all(status.get(i, True) for i in range(len(op.keys), len(keys)))
        # a hybrid plan without a state or a window page is a failed one (``missing``)
        whole = good == len(op.keys) and bool(groups) and groups_ok and not op.missing
        if op.all_or_nothing and not whole:
            good = 0  # a hybrid hit without all of its pages, windows and state is no hit
        copied = True
        t_copy = time.perf_counter()
        try:
            if good:
                self._copy_pages(op.slots[:good], op.blocks[:good])
            if op.all_or_nothing and whole:
                self._load_groups(groups)
        except Exception as exc:
            good, copied, whole = 0, False, False
            self.stats.error("load", type(exc).__name__)
        state_bytes = (
            sum(self.tier.nbytes(g.key) for g in groups) if op.all_or_nothing and whole else 0
        )
        self.stats.add("load_bytes", good * self.page_bytes + state_bytes)
        self.stats.add("load_errors", len(op.keys) - good)
        seconds = time.perf_counter() - t0
        self.stats.add("load_s", seconds)
        self.stats.load(
            pages=good,
            nbytes=good * self.page_bytes + state_bytes,
            seconds=seconds,
            ok=good == len(op.keys) and not (op.all_or_nothing and not whole),
        )
        copy_s = (time.perf_counter() - t_copy) / good if good and copied else 0.0
        read_share = read_s / len(reads) if reads else 0.0
        events = [
            Event(Op.READ, keys[i], ok, self.tier.nbytes(keys[i]), read_share)
            for i, ok in status.items()
        ]
        # LOAD ends each slot's pin; it fails only where a copy failed (a page after a failed
        # read is fine on host, just not loaded: the READ events say which pages are broken).
        # The read slots' LOADs wait until the store call ended (it may still write them).
        late = settled is not None and not settled.done()
        events += [
            Event(Op.LOAD, k, copied, 0, copy_s if i < good else 0.0)
            for i, k in enumerate(keys)
            if not late or i not in status
        ]
        failed = op.all_or_nothing and not whole
        with self._lock:
            self._events.extend(events)
            if op.all_or_nothing:  # vLLM recovers a hybrid load by request, not by block
                if failed:
                    self._failed.add(op.req_id)
            else:
                self._errors.update(op.blocks[good:])
                self._errors.update(op.missing)
            self._finished.add(op.req_id)
        if late:
            assert settled is not None
            self._report_when(settled, [Event(Op.LOAD, keys[i], copied) for i in reads])

    def _read_each(
        self, keys: list[bytes], slots: list[int], writers: list[int]
    ) -> Answer[list[StoreStatus]]:
        """Read pages into host slots: in place, or (stored at another TP size) through
        the TpReader's head slices."""
        assert self.store is not None
        tp = self.tp_reads
        if tp is not None and not all(tp.own(w) for w in writers):
            return tp.read_each(self.store, self.tier, keys, slots, writers)
        pages = [self.tier.page(s, k) for s, k in zip(slots, keys, strict=True)]
        return self.store.read_each(keys, pages)

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

    def wait_pending(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for the first pending store write or asynchronous
        load to end. vLLM runs an engine step with no forward while requests wait for their
        loads and nothing else can run; spinning there keeps the GIL from the store thread (a
        syscall per page hands it back and forth: hundreds of ms for a 127-page read), so
        the connector waits in those steps instead, with the GIL released."""
        pending = [f for f in self._pending_io if not f.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def wait_idle(self) -> None:
        """Wait for every copy, store write and asynchronous load started so far."""
        self.wait_saves()
        for f in list(self._pending_io):
            f.exception()
        self.poll()

    def close(self) -> None:
        self.wait_idle()
        self._io.shutdown(wait=True)
        self.streams.close()
        self.tier.close()


__all__ = ["WorkerTransfers", "block_rows", "choose_copier", "state_rows"]
