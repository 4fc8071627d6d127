"""The worker side's data path: host memory, whole-block copies and store I/O (no vLLM import).

- BlockLayer: one attention layer's registered cache seen as ``(num_blocks, block_bytes)``
  uint8 rows, a view of vLLM's own tensor (no copy): vLLM's CPU and GPU caches put the block
  first and are contiguous, so a block is one row whatever order its token rows have inside.
- state_rows: a hybrid model's state layer (Mamba / Gated DeltaNet: conv and recurrent state in
  one raw page per block, padded to vLLM's common page size) seen as ``(num_blocks,
  state_bytes)`` rows of the bytes the state really uses (a strided view, no copy).
- HostPages: the worker's host tier, ``(slots, page_bytes)`` uint8; a page is one block of
  every attention layer, back to back, so it is one contiguous store object. A hybrid model
  also has state slots, ``(state_slots, state_bytes)``: one state of every state layer, each
  taken from its own group's block at the boundary.
- WorkerTransfers: runs a StepPlan. Synchronous loads copy layer by layer on a copy thread
  (``wait_layer`` waits for one layer); saves copy layer by layer as vLLM reports each layer
  computed and are all finished by ``finish_step`` (so vLLM may reuse the blocks at once);
  store writes and asynchronous loads (store -> host -> device) run on a store thread.
  ``drain_events`` / ``drain_finished`` / ``drain_errors`` give what happened since the
  last call (the scheduler's metadata and vLLM's error hooks).

A failed copy or store call never raises into vLLM's forward pass: its pages are reported
failed (the scheduler drops them) and its device blocks are reported as load errors (vLLM
recomputes them). Every store call is bounded (hicache.engine.bounded): one that overran
``deadline_s + grace_s`` is answered as failed, and the events that end its host slots' pins
(STORE for a write, LOAD for a read) wait until the store call really returned, so the
scheduler never hands a slot the store may still read or write to another page.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch

from hicache.domain import DeviceError
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage, BoundedTier
from hicache.integrations.vllm.plan import (
    Event,
    LoadOp,
    Op,
    SaveOp,
    StateSave,
    StepPlan,
    is_state,
    store_tier,
)
from hicache.integrations.vllm.stats import ConnectorStats


def block_rows(name: str, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``cache`` as ``(num_blocks, block_bytes)`` uint8 rows (a view); DeviceError otherwise."""
    if cache.dim() < 2 or cache.shape[0] != num_blocks or not cache.is_contiguous():
        raise DeviceError(
            f"vLLM cache of layer {name!r}: shape {tuple(cache.shape)}, contiguous="
            f"{cache.is_contiguous()}; expected a contiguous tensor with the {num_blocks} "
            "blocks first (HiCacheConnector copies whole blocks)"
        )
    return cache.view(torch.uint8).view(num_blocks, -1)


def state_rows(name: str, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A state layer's ``cache`` as ``(num_blocks, used_bytes)`` uint8 rows (a strided view
    skipping each block's padding); DeviceError where a block's bytes are not one run."""
    inner = cache.shape[1:]
    expected, step = [], 1
    for size in reversed(inner):
        expected.append(step)
        step *= size
    dense_inner = all(  # a dimension of size 1 may have any stride
        size == 1 or stride == want
        for size, stride, want in zip(inner, cache.stride()[1:], reversed(expected), strict=True)
    )
    if cache.dim() < 2 or cache.shape[0] != num_blocks or not dense_inner:
        raise DeviceError(
            f"vLLM state cache of layer {name!r}: shape {tuple(cache.shape)}, stride "
            f"{cache.stride()}; expected the {num_blocks} blocks first, each one run of bytes"
        )
    used = step * cache.element_size()
    row = cache.stride(0) * cache.element_size()
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else None
    if raw is None:
        raise DeviceError(
            f"vLLM state cache of layer {name!r} has dtype {cache.dtype}; expected vLLM's raw "
            "byte pages (int8 or uint8)"
        )
    return raw.as_strided((num_blocks, used), (row, 1), raw.storage_offset())


class RowCopier:
    """Copies of whole rows (blocks, pages) between two uint8 row tensors. ``torch``: torch's
    index_select / index_copy_ (any device); ``native``: hicache's C memcpy helper
    (hicache.adapters.copy.native) with the GIL released, CPU tensors only. On vLLM's CPU
    backend the native copy of a 127-block host hit took 0.7 ms where torch's took 4-7 ms from
    the copy thread (docs/vllm.md, copy_backend)."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self._lib = None
        if backend == "native":
            from hicache.adapters.copy.native import load_native

            self._lib = load_native()  # NativeBuildError (a TransferError) names the cause

    def copy(
        self, dst: torch.Tensor, dst_rows: Sequence[int], src: torch.Tensor, src_rows: Sequence[int]
    ) -> None:
        """``dst[dst_rows[i]] = src[src_rows[i]]`` for every i (rows of equal width)."""
        if not dst_rows:
            return
        if self._lib is None:
            index = torch.tensor(list(src_rows), dtype=torch.long)
            target = torch.tensor(list(dst_rows), dtype=torch.long)
            dst.index_copy_(0, target, src.index_select(0, index))
            return
        width = int(dst.shape[1])
        self._lib.copy(
            np.array([dst.data_ptr()], dtype=np.int64),
            np.array([src.data_ptr()], dtype=np.int64),
            np.asarray(dst_rows, dtype=np.int64) * dst.stride(0),
            np.asarray(src_rows, dtype=np.int64) * src.stride(0),
            np.full(len(dst_rows), width, dtype=np.int64),
        )


def choose_copier(backend: str, caches: Sequence[torch.Tensor]) -> RowCopier:
    """The RowCopier the ``copy_backend`` setting asks for; DeviceError for native copies of
    device memory."""
    on_cpu = all(t.device.type == "cpu" for t in caches)
    if backend == "auto":
        backend = "native" if on_cpu else "torch"
    if backend == "native" and not on_cpu:
        raise DeviceError(
            "kv_connector_extra_config 'copy_backend' = 'native' copies CPU memory only; "
            "vLLM's caches are on a device: use 'auto' or 'torch'"
        )
    return RowCopier(backend)


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
        copier: RowCopier | None = None,
    ) -> None:
        self.rank = rank
        self.copier = copier if copier is not None else RowCopier("torch")
        self.names = [n for n, _ in layers]
        self.rows = dict(layers)
        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, rows in layers:
            self.offsets[name] = (off, rows.shape[1])
            off += rows.shape[1]
        self.page_bytes = off
        slots = host_bytes // self.page_bytes
        if slots < 1:
            raise DeviceError(
                f"host_gib gives {host_bytes} bytes, less than one page of {self.page_bytes} "
                "bytes (one block of every layer)"
            )
        self.host = torch.empty((slots, self.page_bytes), dtype=torch.uint8)
        # hybrid: (name, state group position, rows) of every state layer
        self.state_layers = list(state_layers)
        self.state_offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, _, rows in self.state_layers:
            self.state_offsets[name] = (off, rows.shape[1])
            off += rows.shape[1]
        self.state_bytes = off
        state_slots = state_host_bytes // off if off else 0
        if self.state_layers and state_slots < 1:
            raise DeviceError(
                f"host_gib gives {state_host_bytes} bytes for states, less than one state of "
                f"{off} bytes (every state layer)"
            )
        self.state_host = torch.empty((state_slots, max(off, 1)), dtype=torch.uint8)
        self.store: BoundedTier | None = (
            store_tier(store, lambda page: [store_key(page)])
            if store is not None
            else None
        )
        self.store_key = store_key
        self.stats = stats
        self._copy = ThreadPoolExecutor(1, thread_name_prefix="hicache-copy")
        self._io = ThreadPoolExecutor(1, thread_name_prefix="hicache-store")
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._finished: set[str] = set()
        self._failed: set[str] = set()  # hybrid loads that failed: vLLM recomputes the request
        self._errors: set[int] = set()
        self._plan = StepPlan()
        self._started = False
        self._load_futs: dict[str, Future[None]] = {}
        self._save_futs: dict[str, Future[None]] = {}
        self._pending_io: list[Future[None]] = []
        self._t_load = 0.0  # when this step's synchronous loads started
        self._t_save = 0.0  # when this step's first save copy started

    @property
    def slots(self) -> int:
        return int(self.host.shape[0])

    # ---- one step ------------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        """This step's plan (vLLM binds it before the forward; saves may start at once)."""
        self._plan = plan
        self._started = False
        self._load_futs = {}
        self._save_futs = {}
        # Hit tokens are counted by the scheduler side (SchedulerSide.build), whose stats vLLM
        # adds to the workers' (vllm/v1/core/sched/scheduler.py): counted here too they doubled.

    def start_step(self, plan: StepPlan | None = None) -> None:
        """Start the bound plan's loads (binding ``plan`` first when given)."""
        if plan is not None:
            self.bind(plan)
        if self._started:
            return
        self._started = True
        plan = self._plan
        loads = [op for op in plan.loads if op.keys]
        if loads:
            self._t_load = time.perf_counter()
            slots = [s for op in loads for s in op.slots]
            blocks = [b for op in loads for b in op.blocks]
            for name in self.names:
                self._load_futs[name] = self._copy.submit(self._to_device, name, slots, blocks)
        for op in plan.async_loads:
            self._pending_io.append(self._io.submit(self._async_load, op))

    def wait_layer(self, name: str) -> None:
        """Block until this step's synchronous loads of layer ``name`` are in place."""
        fut = self._load_futs.get(name)
        if fut is not None:
            fut.exception()  # waits; an error is settled in finish_step

    def save_layer(self, name: str) -> None:
        """vLLM computed layer ``name`` for this step: copy its saved blocks now."""
        if self._plan.saves and name in self.rows and name not in self._save_futs:
            if not self._save_futs:
                self._t_save = time.perf_counter()
            self._save_futs[name] = self._copy.submit(self._save_rows, name, self._plan.saves)

    def finish_step(self) -> None:
        """Finish this step's saves and loads; report them; start the store writes."""
        plan = self._plan
        self.start_step()  # vLLM calls start_load_kv after the forward when no load is sync
        for name in self.names:
            self.save_layer(name)
        state_fut = (
            self._copy.submit(self._save_states, plan.state_saves) if plan.state_saves else None
        )
        t0 = time.perf_counter()
        state_exc = state_fut.exception() if state_fut is not None else None
        if state_exc is not None:
            self.stats.error("save", type(state_exc).__name__)
        failed_save = any(f.exception() is not None for f in self._save_futs.values())
        failed_load = [f.exception() for f in self._load_futs.values()]
        for exc in {type(e).__name__ for e in failed_load if e is not None}:
            self.stats.error("load", exc)
        for exc in {type(e).__name__ for f in self._save_futs.values() if (e := f.exception())}:
            self.stats.error("save", exc)
        events: list[Event] = []
        if plan.saves:
            self.stats.add("save_s", time.perf_counter() - t0)
        for save in plan.saves:
            events.append(Event(Op.SAVE, save.key, not failed_save, self.page_bytes))
            if save.store and (failed_save or self.store is None):
                events.append(Event(Op.STORE, save.key, False))
        if plan.saves:
            self.stats.save(
                pages=0 if failed_save else len(plan.saves),
                nbytes=0 if failed_save else self.page_bytes * len(plan.saves),
                seconds=time.perf_counter() - self._t_save,
                ok=not failed_save,
            )
        if plan.saves and not failed_save:
            self.stats.add("save_bytes", self.page_bytes * len(plan.saves))
            stored: list[SaveOp | StateSave] = [op for op in plan.saves if op.store]
            if stored and self.store is not None:
                self._pending_io.append(self._io.submit(self._store_pages, stored))
        elif plan.saves:
            self.stats.add("save_errors", len(plan.saves))
        for ss in plan.state_saves:
            events.append(Event(Op.SAVE, ss.key, state_exc is None, self.state_bytes))
            if ss.store and (state_exc is not None or self.store is None):
                events.append(Event(Op.STORE, ss.key, False))
        if plan.state_saves and state_exc is None:
            self.stats.add("save_bytes", self.state_bytes * len(plan.state_saves))
            stored_states: list[SaveOp | StateSave] = [op for op in plan.state_saves if op.store]
            if stored_states and self.store is not None:
                self._pending_io.append(self._io.submit(self._store_pages, stored_states))
        elif plan.state_saves:
            self.stats.add("save_errors", len(plan.state_saves))
        ok = not any(e is not None for e in failed_load)
        errors: set[int] = set()
        for op in plan.loads:
            events.extend(Event(Op.LOAD, k, ok, self.page_bytes) for k in op.keys)
            errors.update(op.missing)
            if not ok:
                errors.update(op.blocks)
        n = sum(len(op.keys) for op in plan.loads)
        if n:
            self.stats.add("load_bytes" if ok else "load_errors", self.page_bytes * n if ok else n)
            self.stats.load(
                pages=n if ok else 0,
                nbytes=self.page_bytes * n if ok else 0,
                seconds=time.perf_counter() - self._t_load,
                ok=ok,
            )
        with self._lock:
            self._events.extend(events)
            self._errors |= errors
        self._plan = StepPlan()
        self._started = False
        self._load_futs = {}
        self._save_futs = {}
        self._pending_io = [f for f in self._pending_io if not f.done()]

    # ---- the copies (copy thread) --------------------------------------------------------

    def _to_device(self, name: str, slots: Sequence[int], blocks: Sequence[int]) -> None:
        t0 = time.perf_counter()
        off, size = self.offsets[name]
        self.copier.copy(self.rows[name], blocks, self.host.narrow(1, off, size), slots)
        self.stats.add("load_s", time.perf_counter() - t0)

    def _save_rows(self, name: str, saves: Sequence[SaveOp]) -> None:
        off, size = self.offsets[name]
        self.copier.copy(
            self.host.narrow(1, off, size),
            [op.slot for op in saves],
            self.rows[name],
            [op.block for op in saves],
        )

    def _save_states(self, saves: Sequence[StateSave]) -> None:
        slots = [op.slot for op in saves]
        for name, group, rows in self.state_layers:
            off, size = self.state_offsets[name]
            blocks = [op.blocks[group] for op in saves]
            self.copier.copy(self.state_host.narrow(1, off, size), slots, rows, blocks)

    def _load_state(self, slot: int, blocks: Sequence[int]) -> None:
        for name, group, rows in self.state_layers:
            off, size = self.state_offsets[name]
            self.copier.copy(rows, [blocks[group]], self.state_host.narrow(1, off, size), [slot])

    # ---- store I/O (store thread) --------------------------------------------------------

    def _page(self, slot: int, key: bytes = b"") -> list[memoryview]:
        host = self.state_host if is_state(key) else self.host
        return [memoryview(host[slot].numpy()).cast("B")]  # type: ignore[arg-type]

    def _nbytes(self, key: bytes) -> int:
        return self.state_bytes if is_state(key) else self.page_bytes

    def _store_pages(self, saves: Sequence[SaveOp | StateSave]) -> None:
        assert self.store is not None
        t0 = time.perf_counter()
        settled: Future[Any] = Future()
        try:
            answer = self.store.write_each(
                [op.key for op in saves], [self._page(op.slot, op.key) for op in saves]
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
        self.stats.add("store_s", time.perf_counter() - t0)
        self.stats.add(
            "store_bytes",
            sum(self._nbytes(op.key) for op, ok in zip(saves, oks, strict=True) if ok),
        )
        self.stats.add("store_errors", len(saves) - good)
        # STORE ends the slots' pins: only once the store no longer reads them
        self._report_when(
            settled,
            [
                Event(Op.STORE, op.key, ok, self._nbytes(op.key))
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
        if op.state is not None:  # read with the pages; copied last
            keys.append(op.state.key)
            slots.append(op.state.slot)
            from_storage.append(op.state.from_storage)
        reads = [i for i, s in enumerate(from_storage) if s]
        status: dict[int, bool] = {}
        settled: Future[Any] | None = None  # done once the store no longer writes the slots
        if reads:
            assert self.store is not None
            try:
                answer = self.store.read_each(
                    [keys[i] for i in reads], [self._page(slots[i], keys[i]) for i in reads]
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
        good = 0
        while good < len(op.keys) and status.get(good, True):
            good += 1
        read_ok = sum(self._nbytes(keys[i]) for i, ok in status.items() if ok)
        self.stats.add("read_bytes", read_ok)
        self.stats.add("read_errors", sum(1 for ok in status.values() if not ok))
        state_ok = op.state is not None and status.get(len(op.keys), True)
        whole = good == len(op.keys) and state_ok and not op.missing
        if op.all_or_nothing and not whole:
            good = 0  # a hybrid hit without all of its pages and its state is no hit
        copied = True
        try:
            if good:
                self._copy_pages(op.slots[:good], op.blocks[:good])
            if op.all_or_nothing and whole and op.state is not None:
                self._load_state(op.state.slot, op.state.blocks)
        except Exception as exc:
            good, copied, whole = 0, False, False
            self.stats.error("load", type(exc).__name__)
        state_bytes = self.state_bytes if op.all_or_nothing and whole else 0
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
        events = [Event(Op.READ, keys[i], ok, self._nbytes(keys[i])) for i, ok in status.items()]
        # LOAD ends each slot's pin; it fails only where a copy failed (a page after a failed
        # read is fine on host, just not loaded: the READ events say which pages are broken).
        # The read slots' LOADs wait until the store call ended (it may still write them).
        late = settled is not None and not settled.done()
        events += [
            Event(Op.LOAD, k, copied) for i, k in enumerate(keys) if not late or i not in status
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

    def _copy_pages(self, slots: Sequence[int], blocks: Sequence[int]) -> None:
        for name in self.names:
            off, size = self.offsets[name]
            self.copier.copy(self.rows[name], blocks, self.host.narrow(1, off, size), slots)

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
        """Wait for every store write and asynchronous load started so far."""
        for f in list(self._pending_io):
            f.exception()

    def close(self) -> None:
        self.wait_idle()
        self._copy.shutdown(wait=True)
        self._io.shutdown(wait=True)
