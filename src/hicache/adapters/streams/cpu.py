"""CPU streams: one long-lived worker thread per direction, events on threading primitives.

- CpuEvent: a re-armable completion flag; ``wait_current`` blocks the calling thread until the
  work finished (the CPU has no compute stream to order); errors are kept and re-raised by
  ``synchronize``.
- CpuStreams: the Streams port on the CPU; ``submit`` appends to the direction's queue and
  returns at once, the worker runs the work in submission order.
- CpuStreams.set_idle_hook: the IdleSignal capability: a hook called on the worker's thread
  when it finished work and has nothing queued (the engine's wake-up, instead of polling).
- CpuFence: an ordering point for CPU streams: the forward pass ``signal()``s it once compute
  wrote the pages; copies ordered ``after`` it wait on the copy worker, not on the caller.

Measured on the 2-core development machines (MEASUREMENTS.md in the design notes): a thread
hop costs about 100 us and waking a blocked thread 17-25 us, while checking a finished layer
costs a few microseconds. So there is no thread hop per layer: the worker takes queued work back to back and
a consumer that finds its layer done returns after one flag check, without taking a lock.
The work should release the GIL while it copies (torch's ``copy_`` does).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

from hicache.domain.errors import EngineClosedError, TransferError
from hicache.domain.ports import Direction, Event


class CpuEvent:
    """Completion of one piece of work on a CPU stream; recorded again when reused."""

    __slots__ = ("_cond", "_done", "_end", "_exc", "_start", "_stream")

    def __init__(self) -> None:
        self._done = True  # an idle event counts as finished
        self._exc: BaseException | None = None
        self._cond: threading.Condition | None = None
        self._start = 0.0
        self._end = 0.0
        self._stream = ""

    def _arm(self, cond: threading.Condition, stream: str) -> None:
        self._cond = cond
        self._stream = stream
        self._exc = None
        self._start = self._end = 0.0
        self._done = False

    def query(self) -> bool:
        return self._done

    def wait_current(self) -> None:
        """Block until the work finished (success or failure); never raises the work's error."""
        if self._done:
            return
        cond = self._cond
        if cond is None:  # pragma: no cover - armed events always carry their condition
            return
        with cond:
            while not self._done:
                cond.wait()

    def synchronize(self) -> None:
        self.wait_current()
        if self._exc is not None:
            raise self._exc

    def exception(self) -> BaseException | None:
        return self._exc if self._done else None

    def elapsed_s(self) -> float | None:
        if not self._done or self._cond is None:
            return None
        return self._end - self._start

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        if self._done and self._exc is not None:
            state = f"failed ({type(self._exc).__name__})"
        where = f" on {self._stream}" if self._stream else ""
        return f"<CpuEvent{where}: {state}>"


class CpuFence:
    """An ordering point on the CPU: ``signal()`` from the compute side, ``wait()`` on the copy side."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def signal(self) -> None:
        self._event.set()

    def is_signalled(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._event.wait(timeout)

    def __repr__(self) -> str:
        return f"<CpuFence: {'signalled' if self._event.is_set() else 'pending'}>"


class _Worker:
    """One direction's stream: a queue of (work, event) and the thread that runs them in order."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.cond = threading.Condition()  # guards the queue and every event of this stream
        self.queue: collections.deque[tuple[Callable[[], object], CpuEvent]] = collections.deque()
        self.stopping = False
        self.busy = False
        self.done = 0
        self.idle_hook: Callable[[], None] | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def put(self, work: Callable[[], object], event: CpuEvent) -> None:
        with self.cond:
            if self.stopping:
                raise EngineClosedError(f"stream {self.name!r} is closed: cannot submit more work")
            event._arm(self.cond, self.name)
            self.queue.append((work, event))
            if len(self.queue) == 1 and not self.busy:
                self.cond.notify_all()

    def _run(self) -> None:
        cond = self.cond
        queue = self.queue
        while True:
            with cond:
                while not queue and not self.stopping:
                    cond.wait()
                if not queue:
                    return  # stopping and drained
                work, event = queue.popleft()
                self.busy = True
            exc: BaseException | None = None
            start = time.perf_counter()
            try:
                work()
            except BaseException as e:  # the event carries it to whoever synchronises
                exc = e
            end = time.perf_counter()
            with cond:
                event._exc = exc
                event._start = start
                event._end = end
                event._done = True
                self.busy = False
                self.done += 1
                cond.notify_all()
                hook = None if queue else self.idle_hook
            if hook is not None:
                try:
                    hook()
                except Exception:  # a waiter's hook must not stop the stream; waiters also poll
                    self.idle_hook = None

    def pending(self) -> int:
        with self.cond:
            return len(self.queue) + (1 if self.busy else 0)

    def stop(self) -> None:
        with self.cond:
            self.stopping = True
            self.cond.notify_all()
        if threading.current_thread() is not self.thread:
            self.thread.join()


class CpuStreams:
    """The Streams port on the CPU: a worker thread per direction, started on construction."""

    def __init__(self, *, name: str = "hicache") -> None:
        self._name = name
        self._workers = {d: _Worker(f"{name}-{d.value}") for d in Direction}
        self._closed = False
        self._lock = threading.Lock()

    @property
    def device(self) -> str:
        return "cpu"

    @property
    def closed(self) -> bool:
        return self._closed

    def new_event(self) -> CpuEvent:
        return CpuEvent()

    def submit(
        self, direction: Direction, work: Callable[[], object], event: Event | None = None
    ) -> CpuEvent:
        if self._closed:
            raise EngineClosedError(f"{self!r} is closed: cannot submit {direction.value} work")
        if event is None:
            ev = CpuEvent()
        elif not isinstance(event, CpuEvent):
            raise TransferError(
                f"event {event!r} does not belong to CPU streams: expected a CpuEvent from "
                f"new_event() or submit()"
            )
        elif not event.query():
            raise TransferError(
                f"event {event!r} is still in flight: only a finished event can be recorded again"
            )
        else:
            ev = event
        self._workers[direction].put(work, ev)
        return ev

    def after_compute(self, direction: Direction, after: object | None = None) -> None:
        """Order the direction's next work after ``after`` (an object with ``wait()``).

        Without ``after`` there is nothing to order: CPU compute has finished by the time its
        caller gets here. With one, the copy worker waits on it before the work submitted next
        (the caller does not block).
        """
        if direction not in self._workers:  # pragma: no cover - Direction is closed
            raise TransferError(f"unknown direction {direction!r}")
        if after is None:
            return
        wait = getattr(after, "wait", None)
        if not callable(wait):
            raise TransferError(
                f"ordering point {after!r} cannot order CPU streams: expected an object with "
                f"wait() (a CpuFence or threading.Event)"
            )
        if self._closed:
            raise EngineClosedError(f"{self!r} is closed: cannot order {direction.value} work")
        self._workers[direction].put(wait, CpuEvent())

    def set_idle_hook(self, hook: Callable[[], None] | None) -> None:
        """Call ``hook`` on a worker's thread whenever it finished work and has none queued."""
        for worker in self._workers.values():
            with worker.cond:
                worker.idle_hook = hook

    def pending(self, direction: Direction) -> int:
        """Work items queued or running on the direction's stream."""
        return self._workers[direction].pending()

    def close(self) -> None:
        """Stop taking work, let each worker finish what was queued, join them; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for worker in self._workers.values():
            worker.stop()

    def __enter__(self) -> CpuStreams:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._closed:
            return f"<CpuStreams {self._name}: closed>"
        inner = ", ".join(f"{d.value} {w.pending()} pending" for d, w in self._workers.items())
        return f"<CpuStreams {self._name}: {inner}>"
