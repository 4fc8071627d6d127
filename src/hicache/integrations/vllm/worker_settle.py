"""The worker side's settling of a step's copies once they are done.

StepSettling: ``poll`` (never waits) and ``wait_saves`` (waits) settle each earlier step whose
copy events completed: its saves, state saves and loads reported (events, statistics) and its
store writes started on the store thread.
"""

from __future__ import annotations

import contextlib

from hicache.integrations.vllm.plan import Event, Op, SaveOp, StateSave
from hicache.integrations.vllm.worker_state import Step
from hicache.integrations.vllm.worker_store import StoreIO


class StepSettling(StoreIO):
    """WorkerTransfers's settling (module docstring)."""

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

    def _settle(self, step: Step) -> None:
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
