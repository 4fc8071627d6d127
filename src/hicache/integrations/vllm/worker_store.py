"""The worker side's store I/O, on its store thread.

StoreIO: the store thread (``_background``; inline once Python refuses new thread-pool work at
exit), a step's store writes (``_store_pages``), the asynchronous loads (``_async_load``: store
reads into host slots, in place or through the cross-TP reader, then host -> vLLM's blocks; a
hybrid load all or nothing) and ``wait_pending``. Every store call is bounded; the events that
end a slot's pin (STORE, LOAD) wait until the store call really returned.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any, TypeVar

from hicache.domain.storage import StoreStatus
from hicache.engine.bounded import Answer
from hicache.integrations.vllm.plan import Event, LoadOp, Op, SaveOp, StateSave
from hicache.integrations.vllm.worker_copies import DeviceCopies

_T = TypeVar("_T")


class StoreIO(DeviceCopies):
    """WorkerTransfers's store I/O (module docstring)."""

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

    def wait_pending(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for the first pending store write or asynchronous
        load to end. vLLM runs an engine step with no forward while requests wait for their
        loads and nothing else can run; spinning there keeps the GIL from the store thread (a
        syscall per page hands it back and forth: hundreds of ms for a 127-page read), so
        the connector waits in those steps instead, with the GIL released."""
        pending = [f for f in self._pending_io if not f.done()]
        if pending:
            wait(pending, timeout=timeout, return_when=FIRST_COMPLETED)
