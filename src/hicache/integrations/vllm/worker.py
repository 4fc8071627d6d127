"""The worker side's data path: host memory, whole-block copies and store I/O (no vLLM import).

- BlockLayer: one attention layer's registered cache seen as ``(num_blocks, block_bytes)``
  uint8 rows, a view of vLLM's own tensor (no copy): vLLM's CPU and GPU caches put the block
  first and are contiguous, so a block is one row whatever order its token rows have inside.
- HostPages: the worker's host tier, ``(slots, page_bytes)`` uint8; a page is one block of
  every layer, back to back, so it is one contiguous store object.
- WorkerTransfers: runs a StepPlan. Synchronous loads copy layer by layer on a copy thread
  (``wait_layer`` waits for one layer); saves copy layer by layer as vLLM reports each layer
  computed and are all finished by ``finish_step`` (so vLLM may reuse the blocks at once);
  store writes and asynchronous loads (store -> host -> device) run on a store thread.
  ``drain_events`` / ``drain_finished`` / ``drain_errors`` give what happened since the
  last call (the scheduler's metadata and vLLM's error hooks).

A failed copy or store call never raises into vLLM's forward pass: its pages are reported
failed (the scheduler drops them) and its device blocks are reported as load errors (vLLM
recomputes them).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from hicache.domain import DeviceError
from hicache.domain.storage import Store, StoreKey, StoreStatus
from hicache.integrations.vllm.plan import Event, LoadOp, Op, SaveOp, StepPlan
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


class WorkerTransfers:
    """Host pages and the copies of one worker (one TP rank). See the module docstring."""

    def __init__(
        self,
        layers: Sequence[tuple[str, torch.Tensor]],
        *,
        host_bytes: int,
        store: Store | None,
        store_key: Callable[[bytes], StoreKey],
        stats: ConnectorStats,
        rank: int = 0,
    ) -> None:
        self.rank = rank
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
        self.store = store
        self.store_key = store_key
        self.stats = stats
        self._copy = ThreadPoolExecutor(1, thread_name_prefix="hicache-copy")
        self._io = ThreadPoolExecutor(1, thread_name_prefix="hicache-store")
        self._lock = threading.Lock()
        self._events: list[Event] = []
        self._finished: set[str] = set()
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
        if self.rank == 0:  # hits are per request, not per rank
            self.stats.add("hit_tokens_host", plan.hit_tokens_host)
            self.stats.add("hit_tokens_storage", plan.hit_tokens_storage)

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
            slots = torch.tensor([s for op in loads for s in op.slots], dtype=torch.long)
            blocks = torch.tensor([b for op in loads for b in op.blocks], dtype=torch.long)
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
        t0 = time.perf_counter()
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
            stored = [op for op in plan.saves if op.store]
            if stored and self.store is not None:
                self._pending_io.append(self._io.submit(self._store_pages, stored))
        elif plan.saves:
            self.stats.add("save_errors", len(plan.saves))
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

    def _to_device(self, name: str, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        t0 = time.perf_counter()
        off, size = self.offsets[name]
        self.rows[name].index_copy_(
            0, blocks, self.host.narrow(1, off, size).index_select(0, slots)
        )
        self.stats.add("load_s", time.perf_counter() - t0)

    def _save_rows(self, name: str, saves: Sequence[SaveOp]) -> None:
        off, size = self.offsets[name]
        blocks = torch.tensor([op.block for op in saves], dtype=torch.long)
        slots = torch.tensor([op.slot for op in saves], dtype=torch.long)
        self.host.narrow(1, off, size).index_copy_(
            0, slots, self.rows[name].index_select(0, blocks)
        )

    # ---- store I/O (store thread) --------------------------------------------------------

    def _page(self, slot: int) -> list[memoryview]:
        return [memoryview(self.host[slot].numpy()).cast("B")]  # type: ignore[arg-type]

    def _store_pages(self, saves: Sequence[SaveOp]) -> None:
        assert self.store is not None
        t0 = time.perf_counter()
        try:
            statuses = self.store.put(
                [self.store_key(op.key) for op in saves], [self._page(op.slot) for op in saves]
            )
        except Exception as exc:  # a store that raises: its pages are simply not stored
            statuses = [StoreStatus.FATAL] * len(saves)
            self.stats.error("put", type(exc).__name__)
        else:
            for s in statuses:
                if not s.ok:
                    self.stats.error("put", s.value)
        good = sum(1 for s in statuses if s.ok)
        self.stats.add("store_s", time.perf_counter() - t0)
        self.stats.add("store_bytes", good * self.page_bytes)
        self.stats.add("store_errors", len(saves) - good)
        with self._lock:
            self._events.extend(
                Event(Op.STORE, op.key, s.ok, self.page_bytes)
                for op, s in zip(saves, statuses, strict=True)
            )

    def _async_load(self, op: LoadOp) -> None:
        t0 = time.perf_counter()
        reads = [i for i, s in enumerate(op.from_storage) if s]
        status: dict[int, bool] = {}
        if reads:
            try:
                assert self.store is not None
                got = self.store.get(
                    [self.store_key(op.keys[i]) for i in reads],
                    [self._page(op.slots[i]) for i in reads],
                )
                status = {i: s.ok for i, s in zip(reads, got, strict=True)}
                for s in got:
                    if not s.ok:
                        self.stats.error("get", s.value)
            except Exception as exc:
                status = dict.fromkeys(reads, False)
                self.stats.error("get", type(exc).__name__)
        good = 0
        while good < len(op.keys) and status.get(good, True):
            good += 1
        read_ok = sum(1 for ok in status.values() if ok)
        self.stats.add("read_bytes", read_ok * self.page_bytes)
        self.stats.add("read_errors", len(status) - read_ok)
        copied = True
        if good:
            try:
                slots = torch.tensor(op.slots[:good], dtype=torch.long)
                blocks = torch.tensor(op.blocks[:good], dtype=torch.long)
                for name in self.names:
                    off, size = self.offsets[name]
                    rows = self.host.narrow(1, off, size).index_select(0, slots)
                    self.rows[name].index_copy_(0, blocks, rows)
            except Exception as exc:
                good, copied = 0, False
                self.stats.error("load", type(exc).__name__)
        self.stats.add("load_bytes", good * self.page_bytes)
        self.stats.add("load_errors", len(op.keys) - good)
        seconds = time.perf_counter() - t0
        self.stats.add("load_s", seconds)
        self.stats.load(
            pages=good,
            nbytes=good * self.page_bytes,
            seconds=seconds,
            ok=good == len(op.keys),
        )
        events = [Event(Op.READ, op.keys[i], ok, self.page_bytes) for i, ok in status.items()]
        # LOAD ends each slot's pin; it fails only where a copy failed (a page after a failed
        # read is fine on host, just not loaded: the READ events say which pages are broken).
        events += [Event(Op.LOAD, k, copied) for k in op.keys]
        with self._lock:
            self._events.extend(events)
            self._errors.update(op.blocks[good:])
            self._errors.update(op.missing)
            self._finished.add(op.req_id)

    # ---- reports -------------------------------------------------------------------------

    def drain_events(self) -> list[Event]:
        with self._lock:
            out, self._events = self._events, []
        return out

    def drain_finished(self) -> set[str]:
        with self._lock:
            out, self._finished = self._finished, set()
        return out

    def drain_errors(self) -> set[int]:
        with self._lock:
            out, self._errors = self._errors, set()
        return out

    def wait_idle(self) -> None:
        """Wait for every store write and asynchronous load started so far."""
        for f in list(self._pending_io):
            f.exception()

    def close(self) -> None:
        self.wait_idle()
        self._copy.shutdown(wait=True)
        self._io.shutdown(wait=True)
