"""The engine's inner bookkeeping (private): operations, merged submissions, event sets, polling.

- OpKind: load, backup (all layers), layer-wise backup; each with its direction.
- Op: one load or backup: its pages, its per-step page maps, its state, the handles sharing it.
- Batch: the operations of one scheduling step merged into one submission: one event per step
  (per transfer layer, or one for an all-layer backup); ``run_step`` is the work the copy stream
  runs, computing which operations still take part at the moment it starts.
- EventSets: event sets handed out per submission and reused only after every event finished.
- wait_until: an async wait that polls a condition between checkpoints with a short backoff,
  ended early by a wake-up event when one is given.

Threads: ``run_step`` runs on the copy stream's thread (the CPU worker) or on the submitting
thread (CUDA); everything it shares with the event loop is guarded by the batch's lock.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence

import anyio

from hicache.domain.pools import PoolName
from hicache.domain.ports import Direction, Event, PageMap, Streams
from hicache.engine.stats import OperationState

# Poll backoff for async waits: first a bare checkpoint, then 50 us doubling up to 1 ms.
POLL_MIN_S = 50e-6
POLL_MAX_S = 1e-3

PageDict = dict[PoolName, tuple[int, ...]]


class OpKind(enum.Enum):
    LOAD = "load"
    BACKUP = "backup"
    LAYERWISE_BACKUP = "layerwise_backup"

    @property
    def direction(self) -> Direction:
        return Direction.LOAD if self is OpKind.LOAD else Direction.BACKUP

    @property
    def noun(self) -> str:
        return {"load": "load", "backup": "backup", "layerwise_backup": "layer-wise backup"}[
            self.value
        ]


async def wait_until(
    done: Callable[[], bool], wake: Callable[[], anyio.Event | None] | None = None
) -> None:
    """Return once ``done()`` is true; checkpoints at least once; never blocks the loop.

    Between checks it sleeps with a backoff; ``wake()``, if given, is the event that ends such
    a sleep early (the engine sets it when a sweep settled something).
    """
    delay = 0.0
    await anyio.lowlevel.checkpoint()
    while not done():
        event = wake() if wake is not None and delay > 0.0 else None
        if event is None:
            await anyio.sleep(delay)
        else:
            with anyio.move_on_after(delay):
                await event.wait()
        delay = POLL_MIN_S if delay == 0.0 else min(delay * 2, POLL_MAX_S)


class Op:
    """One load or backup; shared by the handles that joined it (``refs``)."""

    def __init__(
        self,
        *,
        op_id: int,
        kind: OpKind,
        host: PageDict,
        device: PageDict,
        allocated_host: bool,
        allocated_device: bool,
        steps: list[list[PageMap]],
        step_bytes: list[int],
        key: tuple[tuple[PoolName, tuple[int, ...]], ...] | None,
    ) -> None:
        self.id = op_id
        self.kind = kind
        self.host = host
        self.device = device
        self.allocated_host = allocated_host
        self.allocated_device = allocated_device
        self.steps = steps
        self.step_bytes = step_bytes
        self.step_ids = tuple(i for i, maps in enumerate(steps) if maps)
        self.key = key
        self.after: object | None = None  # the ordering point the copies wait for (None: default)
        self.pages = sum(len(v) for v in host.values())
        self.state = OperationState.QUEUED
        self.refs = 1
        self.batch: Batch | None = None
        self.cancelling = False
        self.closed_by_engine = False
        # Shared with the copy stream's thread; guarded by batch.lock once submitted.
        self.stopped = False
        self.included: list[int] = []
        self.failed_step: int | None = None
        self.error: BaseException | None = None
        self.bytes_done = 0
        # Frozen when its batch ends: the batch's events then go back to the pool for reuse.
        self.final_copy_s: float | None = None
        self.t_prepared = time.perf_counter()
        self.t_submitted = 0.0
        self.t_finished = 0.0

    @property
    def joinable(self) -> bool:
        return (
            self.state in (OperationState.QUEUED, OperationState.RUNNING)
            and not self.stopped
            and not self.cancelling
        )

    def copy_s(self) -> float:
        if self.final_copy_s is not None:
            return self.final_copy_s
        batch = self.batch
        if batch is None:
            return 0.0
        total = 0.0
        for i in list(self.included):
            elapsed = batch.events[i].elapsed_s() if batch.step_state[i] == 2 else None
            if elapsed is not None:
                total += elapsed
        return total

    def describe(self) -> str:
        pools = ", ".join(
            f"{p.value}: {len(v)} page{'' if len(v) == 1 else 's'}" for p, v in self.host.items()
        )
        return f"{self.kind.noun} #{self.id} ({pools})"

    def __repr__(self) -> str:
        return f"<Op {self.describe()}: {self.state.value}>"


class Batch:
    """The operations of one submission and the events of its steps."""

    def __init__(
        self,
        *,
        batch_id: int,
        kind: OpKind,
        ops: list[Op],
        call: Callable[[int, Sequence[PageMap]], int],
        events: list[Event],
    ) -> None:
        self.id = batch_id
        self.kind = kind
        self.ops = ops
        self.call = call
        self.events = events
        self.steps = len(events)
        self.lock = threading.Lock()
        # 0 not submitted, 1 being submitted, 2 submitted (its event reflects the work).
        self.step_state = [0] * self.steps
        self.step_moved = [0] * self.steps  # bytes the copy backend reported, per step
        self.submitted = 0
        self.sealed = False  # no further step will be submitted (layer-wise batches)
        self.finished = False
        # Forward-pass threads inside ``wait_layer`` on one of the events (guarded by lock): a
        # finished batch gives its events back for reuse only when none is waiting on them,
        # else a waiter could end up waiting on another submission's work.
        self.waiters = 0
        self.t_submitted = time.perf_counter()
        # One page map per pool for the whole submission (the copy backend takes one map per
        # pool per call, and keeps per-map state across the layers of one batch).
        self._merged = merge_maps(ops, steps=self.steps)

    # -- runs on the copy stream -------------------------------------------------------------
    def run_step(self, step: int) -> int:
        with self.lock:
            carried = [op for op in self.ops if op.steps[step]]
            live = [op for op in carried if not op.stopped]
            for op in live:
                op.included.append(step)
        if not live:
            return 0
        if len(live) == len(carried):
            maps = self._merged[step]
        elif len(live) == 1:
            maps = live[0].steps[step]
        else:
            maps = _merge([op.steps[step] for op in live])
        try:
            moved = self.call(step, maps)
        except BaseException as e:
            with self.lock:
                for op in live:
                    op.stopped = True
                    if op.failed_step is None:
                        op.failed_step = step
                        op.error = e
            raise
        with self.lock:
            for op in live:
                op.bytes_done += op.step_bytes[step]
            self.step_moved[step] = int(moved) if isinstance(moved, int) else 0
        return moved

    # -- runs on the submitting thread ---------------------------------------------------------
    def submit_step(self, step: int, streams: Streams) -> bool:
        """Submit one step once; False if it was already submitted or the batch is sealed.

        A sealed batch's events may already serve another submission: never record them again.
        """
        with self.lock:
            if self.step_state[step] or self.sealed:
                return False
            self.step_state[step] = 1
        work = _StepWork(self, step)
        try:
            self.events[step] = streams.submit(self.kind.direction, work, self.events[step])
        except BaseException as e:
            # The step never reached the stream: its operations cannot complete.
            with self.lock:
                for op in self.ops:
                    if not op.stopped and op.steps[step]:
                        op.stopped = True
                        op.failed_step = step
                        op.error = e
            self.events[step] = streams.new_event()
        with self.lock:
            self.step_state[step] = 2
            self.submitted += 1
            if self.submitted == self.steps:
                self.sealed = True
        return True

    # -- forward-pass threads ---------------------------------------------------------------
    def wait_step(self, step: int) -> None:
        """Block (CPU) or order the current stream (CUDA) after ``step``; never on a reused event.

        The batch's events go back to the pool when it finishes: the waiter registers under the
        lock first, so that they are not handed to another submission while it waits on one.
        """
        with self.lock:
            if self.finished:
                return
            self.waiters += 1
            event = self.events[step]
        try:
            event.wait_current()
        finally:
            with self.lock:
                self.waiters -= 1

    def finish(self) -> bool:
        """Mark the batch finished; True if its events may be reused (nobody waits on them)."""
        with self.lock:
            self.finished = True
            return self.waiters == 0 and all(s == 2 for s in self.step_state)

    # -- questions the event loop asks ----------------------------------------------------------
    def op_done(self, op: Op) -> bool:
        """Whether every step that carries (or carried) ``op`` finished."""
        # Every step recorded and its last one not finished: no, in O(1), without the lock or
        # a pass over its steps (the common answer while it runs).
        if (
            not op.stopped
            and self.submitted == self.steps
            and op.step_ids
            and not self.events[op.step_ids[-1]].query()
        ):
            return False
        with self.lock:
            stopped = op.stopped
            included = list(op.included)
            states = [self.step_state[i] for i in op.step_ids]
            # A step that took ``op`` in but is still being submitted (its copies issued on
            # another thread, its event not recorded yet) is not finished whatever its event says.
            pending = any(self.step_state[i] != 2 for i in included)
        if stopped:
            return not pending and all(self.events[i].query() for i in reversed(included))
        if any(s != 2 for s in states):
            return False
        return all(self.events[i].query() for i in reversed(op.step_ids))

    def included_done(self, op: Op) -> bool:
        """Whether the steps that already took ``op`` in finished (after ``op`` was stopped)."""
        if self.finished:
            return True
        with self.lock:
            included = list(op.included)
            if any(self.step_state[i] != 2 for i in included):
                return False  # being submitted: its event does not reflect the work yet
        return all(self.events[i].query() for i in reversed(included))

    def done(self) -> bool:
        """Whether the batch will run nothing more: sealed and every submitted step finished."""
        if self.finished:
            return True
        if self.tail_pending():
            return False
        with self.lock:
            if not self.sealed:
                return False
            submitted = [i for i in range(self.steps) if self.step_state[i] == 2]
            if any(s == 1 for s in self.step_state):
                return False
        return all(self.events[i].query() for i in reversed(submitted))

    def tail_pending(self) -> bool:
        """Whether every step is recorded and the last one has not finished (O(1), no lock).

        The direction's stream runs work in submission order, so for a load or all-layer
        backup batch (every step recorded at submission) this also says that no batch of the
        same kind submitted after it has finished a step: the sweep stops there.
        """
        return self.submitted == self.steps and not self.events[-1].query()

    def copy_s(self) -> float:
        total = 0.0
        for i in range(self.steps):
            if self.step_state[i] == 2:
                elapsed = self.events[i].elapsed_s()
                if elapsed is not None:
                    total += elapsed
        return total

    def moved(self) -> int:
        with self.lock:
            return sum(self.step_moved)

    def __repr__(self) -> str:
        return (
            f"<Batch {self.kind.noun} #{self.id}: {len(self.ops)} ops, "
            f"{self.submitted}/{self.steps} steps submitted, "
            f"{'finished' if self.finished else 'running'}>"
        )


def _merge(per_op: Sequence[Sequence[PageMap]]) -> list[PageMap]:
    """One PageMap per pool: the pages of every operation, in operation order."""
    if len(per_op) == 1:
        return list(per_op[0])
    host: dict[PoolName, list[int]] = {}
    device: dict[PoolName, list[int]] = {}
    for maps in per_op:
        for m in maps:
            host.setdefault(m.pool, []).extend(m.host_pages)
            device.setdefault(m.pool, []).extend(m.device_pages)
    return [PageMap(pool, host[pool], device[pool]) for pool in host]


def merge_maps(ops: Sequence[Op], *, steps: int) -> list[list[PageMap]]:
    """Per step, the merged maps of every operation carried at that step.

    A pool's merged map is built once and shared by every step that has the pool.
    """
    if len(ops) == 1:
        return [list(s) for s in ops[0].steps]
    per_op = [list({m.pool: m for step in op.steps for m in step}.values()) for op in ops]
    whole = {m.pool: m for m in _merge(per_op)}
    out: list[list[PageMap]] = []
    for step in range(steps):
        pools: list[PoolName] = []
        for op in ops:
            for m in op.steps[step]:
                if m.pool not in pools:
                    pools.append(m.pool)
        out.append([whole[p] for p in pools])
    return out


class _StepWork:
    """The callable a stream runs for one step (a named object reads better in tracebacks)."""

    __slots__ = ("batch", "step")

    def __init__(self, batch: Batch, step: int) -> None:
        self.batch = batch
        self.step = step

    def __call__(self) -> int:
        return self.batch.run_step(self.step)

    def __repr__(self) -> str:
        return f"<step {self.step} of {self.batch!r}>"


class EventSets:
    """Sets of events, one set per submission, reused (oldest first) only once all finished."""

    def __init__(self, streams: Streams, depth: int) -> None:
        self._streams = streams
        self._depth = depth
        self._free: dict[int, list[list[Event]]] = {}
        self.created = 0
        self.reused = 0

    def acquire(self, size: int) -> list[Event]:
        free = self._free.get(size)
        while free:
            candidate = free.pop(0)
            if all(ev.query() for ev in candidate):
                self.reused += 1
                return candidate
            # Not finished (cannot happen with the engine's release rule): never reuse it.
        self.created += 1
        return [self._streams.new_event() for _ in range(size)]

    def release(self, events: list[Event]) -> None:
        free = self._free.setdefault(len(events), [])
        if len(free) < self._depth:
            free.append(events)

    def __repr__(self) -> str:
        idle = sum(len(v) for v in self._free.values())
        return f"<EventSets: {self.created} created, {self.reused} reuses, {idle} idle>"
