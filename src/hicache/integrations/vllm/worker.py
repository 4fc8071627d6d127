"""The worker side's data path: host memory, whole-block copies and store I/O (no vLLM import).

- block_rows, state_rows, choose_copier: re-exported from hicache.integrations.vllm.block_rows
  (vLLM's caches as whole-block byte rows; the copier of the ``copy_backend`` setting).
- The host tier (pages of one block of every attention layer, a hybrid model's states and a
  sliding-window model's window pages) is hicache.integrations.vllm.worker_host.HostTier, on
  hicache's host-memory adapters.
- WorkerTransfers: runs a StepPlan on hicache's copy streams (hicache.adapters.streams: CUDA
  streams, or the CPU worker threads). Synchronous loads are issued layer by layer on the load
  stream, each with an event (``wait_layer`` makes vLLM's compute wait on it); saves are issued
  on the backup stream as vLLM reports each layer computed, ordered after that layer's compute
  (where vLLM's layout puts a block's layers side by side, ``page_rows``, one copy of whole
  pages once the last layer was reported).
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

The jobs, one module each, stacked (each uses the ones below it): worker_state (TransfersState:
the constructor, the host tier's sizes, the reports and ``drain_*``; Step), worker_copies
(DeviceCopies: the layer, state and window-page copies), worker_store (StoreIO: the store
thread, store writes, asynchronous loads, ``wait_pending``), worker_settle (StepSettling:
``poll``, ``wait_saves``, a done step reported and its store writes started); this module
adds vLLM's step hooks (bind, fence, start_step, wait_layer, save_layer, finish_step) and
``wait_idle`` / ``close``.
"""

from __future__ import annotations

from hicache.domain.ports import Direction
from hicache.integrations.vllm.block_rows import block_rows, choose_copier, state_rows
from hicache.integrations.vllm.plan import StepPlan
from hicache.integrations.vllm.worker_parts import CpuOrder
from hicache.integrations.vllm.worker_settle import StepSettling
from hicache.integrations.vllm.worker_state import Step

WHOLE_PAGES = "*pages"  # Step.saves' key of a whole-page save (no layer has this name)


class WorkerTransfers(StepSettling):
    """Host pages and the copies of one worker (one TP rank). See the module docstring."""

    # ---- one step ------------------------------------------------------------------------

    def bind(self, plan: StepPlan) -> None:
        """This step's plan (vLLM binds it before the forward; saves may start at once)."""
        self.poll()
        self.fence()
        self._step = Step(plan)
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

    def wait_layer(self, name: str) -> None:
        """Make vLLM's compute wait for this step's loads of layer ``name`` (CUDA: the current
        stream waits on the load's event, the CPU goes on; CPU: the caller waits)."""
        ev = self._step.loads.get(name)
        if ev is not None:
            ev.wait_current()  # an error is settled with the step

    def save_layer(self, name: str) -> None:
        """vLLM computed layer ``name`` for this step: copy its saved blocks on the copy
        stream, after the compute issued so far. With whole pages (page_rows) the copy of
        every layer's blocks at once is issued when the last layer was reported."""
        step = self._step
        if not step.plan.saves or name not in self.rows:
            return
        pages = self.page_rows
        if pages is not None:
            step.computed.add(name)
            if len(step.computed) < len(self.names) or WHOLE_PAGES in step.saves:
                return
            self.streams.after_compute(Direction.BACKUP, self.order.point())
            step.saves[WHOLE_PAGES] = self.streams.submit(
                Direction.BACKUP, lambda: self._save_pages(pages, step.plan.saves)
            )
        elif name not in step.saves:
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
        self._step = Step(StepPlan())
        self._started = False
        self.poll()

    def wait_idle(self) -> None:
        """Wait for every copy, store write and asynchronous load started so far."""
        self.wait_saves()
        for f in list(self._pending_io):
            f.exception()
        self.poll()

    def pending_transfers(self) -> int:
        """Steps whose copies are not settled yet, and store calls not ended (0 when idle)."""
        return len(self._inflight) + sum(not f.done() for f in list(self._pending_io))

    def close(self) -> None:
        self.wait_idle()
        self._io.shutdown(wait=True)
        self.streams.close()
        self.tier.close()


__all__ = ["WorkerTransfers", "block_rows", "choose_copier", "state_rows"]
