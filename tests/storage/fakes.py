"""FakeStore: a small working in-memory Store with faults injected per call (no mocks).

- FakeStore: keeps each key's bytes; honours deadlines, sizes (INVALID), close (FATAL); counts
  calls per operation.
- Fault injection: ``fail(op, status, keys=None, times=1)`` makes the next ``times`` matching
  keys of ``op`` ("exists", "get", "put", "remove") answer ``status`` (exists answers False);
  ``slow(seconds)`` sleeps that long before each key, so a deadline passes mid-batch and the
  rest answer TRANSIENT; ``phantom(key)`` makes ``exists`` say True while ``get`` misses;
  ``raise_on(op, exc)`` makes the next call of ``op`` raise (a broken plug-in);
  ``fail_after(n, status)`` makes the keys after the first n of every get answer ``status``
  (a fault in the middle of a load); ``damage(fn)`` calls ``fn(key, buffer)`` on every page a
  get read OK (bytes damaged after the read, which a checksum cannot see); ``hang`` (an Event):
  while set, exists / get / put wait, ignoring their deadline, until ``release`` is set (at most
  30 s), setting ``entered`` first; a get that hung then writes its bytes, as a late store would.
- HangingStore: a FakeStore named "hanging" that ignores deadlines (the bounded-storage
  tests' store).
- Stalled: any store whose gets wait (ignoring their deadline, at most 30 s) until ``release``
  is set, then delegate: a store that breaks the port's deadline contract.
- fail_after_first / damage_read: the get faults themselves, shared by every faulty store of
  the tests (this one, the vLLM tests' FaultyStore and HarnessStore, which wrap a real
  DirectoryStore): the statuses after the first n turned into one status; a function applied
  to every page a get read OK.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence

from hicache.adapters.storage.delegating import DelegatingStore
from hicache.domain.storage import (
    PageBuffer,
    Store,
    StoreHealth,
    StoreKey,
    StoreStatus,
    buffer_nbytes,
    check_batch,
)


def fail_after_first(
    statuses: Sequence[StoreStatus], n: int, status: StoreStatus
) -> list[StoreStatus]:
    """``statuses`` with every one after the first ``n`` replaced by ``status``."""
    return [s if i < n else status for i, s in enumerate(statuses)]


def damage_read(
    keys: Sequence[StoreKey],
    statuses: Sequence[StoreStatus],
    buffers: Sequence[PageBuffer],
    fn: Callable[[StoreKey, PageBuffer], None],
) -> None:
    """``fn(key, buffer)`` on every page a get read OK (damage after the store's checks)."""
    for key, status, buffer in zip(keys, statuses, buffers, strict=True):
        if status.ok:
            fn(key, buffer)


class _Fault:
    def __init__(self, status: StoreStatus, keys: set[StoreKey] | None, times: int) -> None:
        self.status = status
        self.keys = keys
        self.times = times


class FakeStore:
    """An in-memory Store for tests. Thread-safe; every method follows the port's contract."""

    def __init__(self, *, name: str = "fake", capacity_bytes: int | None = None) -> None:
        self._name = name
        self.capacity_bytes = capacity_bytes
        self.objects: dict[StoreKey, bytes] = {}
        self.calls: Counter[str] = Counter()
        self.registered: list[memoryview] = []
        self.closed = False
        self.unhealthy: str | None = None
        self._lock = threading.Lock()
        self._faults: dict[str, list[_Fault]] = {}
        self._phantoms: set[StoreKey] = set()
        self._delay = 0.0
        self._raise: dict[str, BaseException] = {}
        self._fail_after: tuple[int, StoreStatus] | None = None
        self._damage: Callable[[StoreKey, PageBuffer], None] | None = None
        self.hang = threading.Event()
        self.release = threading.Event()
        self.entered = threading.Event()

    @property
    def name(self) -> str:
        return self._name

    # -- fault injection ----------------------------------------------------------------------

    def fail(
        self,
        op: str,
        status: StoreStatus,
        *,
        keys: Sequence[StoreKey] | None = None,
        times: int = 1,
    ) -> None:
        if op not in ("exists", "get", "put", "remove"):
            raise ValueError(f"unknown op {op!r}")
        with self._lock:
            fault = _Fault(status, None if keys is None else set(keys), times)
            self._faults.setdefault(op, []).append(fault)

    def slow(self, seconds: float) -> None:
        self._delay = seconds

    def phantom(self, key: StoreKey) -> None:
        self._phantoms.add(key)

    def raise_on(self, op: str, exc: BaseException) -> None:
        self._raise[op] = exc

    def fail_after(self, n: int | None, status: StoreStatus = StoreStatus.TRANSIENT) -> None:
        self._fail_after = None if n is None else (n, status)

    def damage(self, fn: Callable[[StoreKey, PageBuffer], None] | None) -> None:
        self._damage = fn

    def _wait(self, deadline: float | None) -> float | None:
        """Hang while ``hang`` is set; a call that hung ignores its deadline."""
        if not self.hang.is_set():
            return deadline
        self.entered.set()
        self.release.wait(30)
        return None

    def _fault(self, op: str, key: StoreKey) -> StoreStatus | None:
        with self._lock:
            for fault in self._faults.get(op, []):
                if fault.times > 0 and (fault.keys is None or key in fault.keys):
                    fault.times -= 1
                    return fault.status
        return None

    def _enter(self, op: str) -> None:
        self.calls[op] += 1
        exc = self._raise.pop(op, None)
        if exc is not None:
            raise exc

    def _late(self, deadline: float | None) -> bool:
        if self._delay:
            time.sleep(self._delay)
        return deadline is not None and time.monotonic() >= deadline

    # -- the port -----------------------------------------------------------------------------

    def register(self, regions: Sequence[memoryview]) -> None:
        self._enter("register")
        self.registered.extend(regions)

    def exists(self, keys: Sequence[StoreKey], *, deadline: float | None = None) -> list[bool]:
        self._enter("exists")
        deadline = self._wait(deadline)
        out = []
        for key in keys:
            if self.closed or self._late(deadline) or self._fault("exists", key) is not None:
                out.append(False)
                continue
            with self._lock:
                out.append(key in self.objects or key in self._phantoms)
        return out

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        statuses = self._batch("get", keys, buffers, self._wait(deadline), self._read)
        if self._fail_after is not None:
            statuses = fail_after_first(statuses, *self._fail_after)
        if self._damage is not None:
            damage_read(keys, statuses, buffers, self._damage)
        return statuses

    def _batch(
        self,
        op: str,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        deadline: float | None,
        one: Callable[[StoreKey, PageBuffer], StoreStatus],
    ) -> list[StoreStatus]:
        """``one`` per page in order, unless closed (FATAL), late (TRANSIENT) or faulted."""
        self._enter(op)
        check_batch(keys, buffers)
        out = []
        for key, buffer in zip(keys, buffers, strict=True):
            if self.closed:
                out.append(StoreStatus.FATAL)
            elif self._late(deadline):
                out.append(StoreStatus.TRANSIENT)
            elif (fault := self._fault(op, key)) is not None:
                out.append(fault)
            else:
                out.append(one(key, buffer))
        return out

    def _read(self, key: StoreKey, buffer: PageBuffer) -> StoreStatus:
        with self._lock:
            data = self.objects.get(key)
        if data is None:
            return StoreStatus.MISS
        if len(data) != buffer_nbytes(buffer):
            return StoreStatus.INVALID
        offset = 0
        for seg in buffer:
            flat = seg.cast("B")
            flat[:] = data[offset : offset + flat.nbytes]
            offset += flat.nbytes
        return StoreStatus.OK

    def put(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        return self._batch("put", keys, buffers, self._wait(deadline), self._write)

    def _write(self, key: StoreKey, buffer: PageBuffer) -> StoreStatus:
        data = b"".join(bytes(seg) for seg in buffer)
        with self._lock:
            used = sum(len(v) for k, v in self.objects.items() if k != key)
            if self.capacity_bytes is not None and used + len(data) > self.capacity_bytes:
                return StoreStatus.FULL
            self.objects[key] = data
        return StoreStatus.OK

    def remove(self, keys: Sequence[StoreKey]) -> list[StoreStatus]:
        self._enter("remove")
        out = []
        for key in keys:
            if self.closed:
                out.append(StoreStatus.FATAL)
            elif (fault := self._fault("remove", key)) is not None:
                out.append(fault)
            else:
                with self._lock:
                    self.objects.pop(key, None)
                out.append(StoreStatus.OK)
        return out

    def health(self) -> StoreHealth:
        if self.closed:
            return StoreHealth(False, "closed")
        if self.unhealthy is not None:
            return StoreHealth(False, self.unhealthy)
        return StoreHealth(True, f"{len(self.objects)} objects")

    def close(self) -> None:
        self.calls["close"] += 1
        self.closed = True


class HangingStore(FakeStore):
    """A FakeStore named "hanging" whose calls hang while ``hang`` is set (see the module) and
    ignore their deadline always (the bounded layer, not the store, keeps time)."""

    def __init__(self) -> None:
        super().__init__(name="hanging")

    def _wait(self, deadline: float | None) -> None:
        super()._wait(deadline)


class Stalled(DelegatingStore):
    """A store whose gets ignore their deadline until ``release`` is set (at most 30 s)."""

    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.release = threading.Event()

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        self.release.wait(30)
        return self.inner.get(keys, buffers, deadline=deadline)
