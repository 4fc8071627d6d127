"""The storage tier from plain threads, every call bounded: a hung store is a miss, not a hang.

- BoundedSettings: ``deadline_s`` (what one call may take) and ``grace_s`` (how much longer a
  caller waits for a store that ignores its deadline); seconds in (0, MAX_SECONDS].
- BoundedStorage(store, settings): one store, an event loop on a daemon thread of its own (an
  anyio blocking portal) and the stuck-call state; ``tier(...)`` builds a BoundedTier over it,
  ``statistics()``, ``stuck``, ``close()`` (bounded too; closes the store).
- BoundedTier: a StorageTier's exists / exists_each / read / read_each / write / write_each
  from any thread, with page keys and host page buffers (memoryviews); each returns an Answer.
- Answer: ``(value, outcome, settled)``: the tier's answer (Outcome.ANSWERED) or the
  caller's default (TIMEOUT, STUCK, CLOSED); ``settled`` is a Future done once the store call
  behind it really ended, i.e. once its host buffers are the caller's again.

A call waits at most ``deadline_s + grace_s`` (the tier passes ``now + deadline_s`` on to the
store). A call that overran is answered with the default and left running on its thread (the
tier never abandons a thread call); until it returns, every further call of this
BoundedStorage is refused at once (Outcome.STUCK), so callers never queue behind a hung store.
``close()`` returns within ``deadline_s + grace_s`` whatever a store call is doing; a call
still running then keeps the store open until it returns, and never holds up interpreter exit
(every thread here is a daemon thread).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import itertools
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, NamedTuple, TypeVar

import anyio
import attrs
from anyio.from_thread import BlockingPortal

from hicache.domain.errors import ConfigError
from hicache.domain.limits import bounded_seconds
from hicache.domain.pools import PoolName
from hicache.domain.storage import PageBuffer, Store, StoreKey, StoreStatus
from hicache.engine.logs import get_logger
from hicache.engine.storage_settings import StorageTierSettings
from hicache.engine.storage_tier import StorageTier

log = get_logger("hicache.storage")

T = TypeVar("T")


class Outcome(enum.Enum):
    ANSWERED = "answered"  # the tier answered within deadline_s + grace_s
    TIMEOUT = "timeout"  # overran deadline_s + grace_s: answered with the default
    STUCK = "stuck"  # refused: an earlier call is still running past its bound
    CLOSED = "closed"  # refused: close() was called


class Answer(NamedTuple, Generic[T]):
    value: T
    outcome: Outcome
    settled: concurrent.futures.Future[None]  # done once the store call ended

    @property
    def answered(self) -> bool:
        return self.outcome is Outcome.ANSWERED


def _seconds(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    bounded_seconds(value, attr.name, positive=True)


@attrs.frozen(kw_only=True)
class BoundedSettings:
    """How long a call may take (``deadline_s``) and how much longer its caller waits for a
    store that ignores its deadline (``grace_s``)."""

    deadline_s: float = attrs.field(default=10.0, validator=_seconds)
    grace_s: float = attrs.field(default=2.0, validator=_seconds)

    @property
    def bound_s(self) -> float:
        """The longest a caller waits: ``deadline_s + grace_s``."""
        return self.deadline_s + self.grace_s


@attrs.frozen(kw_only=True)
class BoundedStatistics:
    """What a BoundedStorage did since it was built (a snapshot)."""

    calls: int  # calls handed to the tier
    timed_out_calls: int  # of those, the ones that overran deadline_s + grace_s
    late_returns: int  # overran calls that have returned since
    stuck_calls: int  # overran calls still running now
    refused_while_stuck: int  # calls refused because an overran call was still running
    refused_closed: int  # calls after close()


class _CallBuffers:
    """The HostPageBuffers of the tiers: each call registers its page buffers under fresh ids."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._buffers: dict[int, PageBuffer] = {}

    def add(self, buffers: Sequence[PageBuffer]) -> list[int]:
        with self._lock:
            ids = [next(self._ids) for _ in buffers]
            self._buffers.update(zip(ids, buffers, strict=True))
        return ids

    def drop(self, ids: Sequence[int]) -> None:
        with self._lock:
            for i in ids:
                self._buffers.pop(i, None)

    def buffer(self, pool: PoolName, page: int) -> PageBuffer:
        with self._lock:
            return self._buffers[page]

    def __len__(self) -> int:
        with self._lock:
            return len(self._buffers)


def _done() -> concurrent.futures.Future[None]:
    f: concurrent.futures.Future[None] = concurrent.futures.Future()
    f.set_result(None)
    return f


class BoundedStorage:
    """One store's StorageTiers driven from plain threads, every call bounded (module
    docstring). Thread-safe."""

    def __init__(self, store: Store, settings: BoundedSettings | None = None) -> None:
        self.store = store
        self.settings = settings if settings is not None else BoundedSettings()
        self.buffers = _CallBuffers()
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(
            ("calls", "timed_out_calls", "late_returns", "refused_while_stuck", "refused_closed"),
            0,
        )
        self._stuck = 0
        self._refusal_logged = False
        self._closed = False
        self._loop_done = False
        self._close_store_late = False
        ready: concurrent.futures.Future[BlockingPortal] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._serve, args=(ready,), name="hicache-bounded-storage", daemon=True
        )
        self._thread.start()
        self._portal = ready.result()

    # -- the loop thread ---------------------------------------------------------------------

    def _serve(self, ready: concurrent.futures.Future[BlockingPortal]) -> None:
        async def serve() -> None:
            async with BlockingPortal() as portal:
                ready.set_result(portal)
                await portal.sleep_until_stopped()

        try:
            anyio.run(serve)
        except BaseException as exc:  # the loop could not start: the constructor raises it
            if not ready.done():
                ready.set_exception(exc)
            else:
                log.error("bounded storage loop failed", error=repr(exc))
        finally:
            with self._lock:
                self._loop_done = True
                late = self._close_store_late
            if late:  # close() returned before a stuck call did: close the store now
                self._close_store()

    # -- tiers -------------------------------------------------------------------------------

    def tier(
        self,
        namespaces: Mapping[PoolName, str],
        pools: Sequence[PoolName],
        settings: StorageTierSettings | None = None,
        *,
        keys: Callable[[bytes], Sequence[StoreKey]] | None = None,
    ) -> BoundedTier:
        """A StorageTier over this store (see StorageTier for the arguments; its host pages are
        the buffers each call hands over) and the bounded face of it. ``settings`` defaults
        to StorageTierSettings with ``call_deadline_s`` = ``deadline_s``."""
        if settings is None:
            settings = StorageTierSettings(call_deadline_s=self.settings.deadline_s)
        tier = StorageTier(self.store, self.buffers, namespaces, pools, settings, keys=keys)
        return BoundedTier(self, tier)

    # -- one bounded call --------------------------------------------------------------------

    def deadline(self) -> float:
        """The deadline a call started now passes to the tier (time.monotonic())."""
        return time.monotonic() + self.settings.deadline_s

    def call(
        self,
        op: str,
        default: T,
        fn: Callable[[], Awaitable[T]],
        ids: Sequence[int] = (),
    ) -> Answer[T]:
        """Run ``fn()`` on the loop and wait at most ``deadline_s + grace_s`` for it; the
        buffers registered under ``ids`` are dropped once it ended. An exception ``fn`` raises
        (bad input) is raised here."""
        with self._lock:
            refused = Outcome.CLOSED if self._closed else Outcome.STUCK if self._stuck else None
            if refused is Outcome.CLOSED:
                self._counts["refused_closed"] += 1
            elif refused is Outcome.STUCK:
                self._counts["refused_while_stuck"] += 1
                first, self._refusal_logged = not self._refusal_logged, True
            else:
                self._counts["calls"] += 1
        if refused is not None:
            self.buffers.drop(ids)
            if refused is Outcome.STUCK and first:
                log.warning(
                    "store calls refused while a call is stuck past its deadline",
                    store=self.store.name,
                    op=op,
                )
            return Answer(default, refused, _done())

        async def run() -> T:
            try:
                return await fn()
            finally:
                self.buffers.drop(ids)

        try:
            future = self._portal.start_task_soon(run)
        except RuntimeError:  # the loop stopped (closed meanwhile)
            self.buffers.drop(ids)
            return Answer(default, Outcome.CLOSED, _done())
        try:
            value = future.result(timeout=self.settings.bound_s)
        except concurrent.futures.TimeoutError:
            return self._overran(op, default, future)
        except concurrent.futures.CancelledError:  # close() cancelled it before it ran
            return Answer(default, Outcome.CLOSED, _done())
        return Answer(value, Outcome.ANSWERED, _done())

    def _overran(self, op: str, default: T, future: concurrent.futures.Future[Any]) -> Answer[T]:
        settled: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._lock:
            self._stuck += 1
            self._counts["timed_out_calls"] += 1
        log.warning(
            "store call overran its deadline: answered as a failure",
            store=self.store.name,
            op=op,
            waited_s=self.settings.bound_s,
        )

        def unstick(_f: concurrent.futures.Future[Any]) -> None:
            with self._lock:
                self._stuck -= 1
                self._counts["late_returns"] += 1
                if not self._stuck:
                    self._refusal_logged = False
            log.info("stuck store call returned", store=self.store.name, op=op)
            settled.set_result(None)

        future.add_done_callback(unstick)
        return Answer(default, Outcome.TIMEOUT, settled)

    # -- state -------------------------------------------------------------------------------

    @property
    def stuck(self) -> int:
        """Calls that overran their bound and are still running."""
        with self._lock:
            return self._stuck

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> BoundedStatistics:
        with self._lock:
            return BoundedStatistics(stuck_calls=self._stuck, **self._counts)

    def close(self) -> None:
        """Refuse further calls, stop the loop (cancelling calls not started yet) and close the
        store; returns within ``deadline_s + grace_s``. A store call still running then is left
        to finish on its daemon thread, and the store is closed when it returns. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # stop() only flags the loop and cancels: it returns at once (RuntimeError: the loop
        # is gone already)
        with contextlib.suppress(RuntimeError):
            self._portal.call(self._portal.stop, True)
        self._thread.join(self.settings.bound_s)
        with self._lock:
            now = self._loop_done
            self._close_store_late = not now
        if now:
            self._close_store()
        else:
            log.warning(
                "closed with a store call still running: the store closes when it returns",
                store=self.store.name,
                stuck=self._stuck,
            )

    def _close_store(self) -> None:
        try:
            self.store.close()
        except Exception as exc:
            log.error("store.close() raised", store=self.store.name, error=repr(exc))

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._stuck} stuck"
        return f"<BoundedStorage {self.store.name}: {state}>"


Buffers = Sequence[PageBuffer] | Mapping[PoolName, Sequence[PageBuffer]]


class BoundedTier:
    """A StorageTier's calls from any thread, each bounded by its BoundedStorage. Values when a
    call is not answered: exists 0, exists_each / read / write all False, read_each /
    write_each all TRANSIENT."""

    def __init__(self, storage: BoundedStorage, tier: StorageTier) -> None:
        self.storage = storage
        self.tier = tier

    def exists(self, page_keys: Sequence[bytes]) -> Answer[int]:
        """How many leading pages the store probably holds (StorageTier.exists)."""
        deadline = self.storage.deadline()
        return self.storage.call(
            "exists", 0, lambda: self.tier.exists(page_keys, deadline=deadline)
        )

    def exists_each(self, page_keys: Sequence[bytes]) -> Answer[list[bool]]:
        """Per page, whether the store probably holds it (StorageTier.exists_each)."""
        deadline = self.storage.deadline()
        return self.storage.call(
            "exists",
            [False] * len(page_keys),
            lambda: self.tier.exists_each(page_keys, deadline=deadline),
        )

    def read(self, page_keys: Sequence[bytes], buffers: Buffers) -> Answer[list[bool]]:
        """Each page's store objects into its buffers; the leading run read OK
        (StorageTier.read). ``buffers``: one PageBuffer per page, or per pool a sequence of
        them. Until ``settled`` is done the store may still write into them."""
        return self._move("get", False, page_keys, buffers, self.tier.read)

    def read_each(self, page_keys: Sequence[bytes], buffers: Buffers) -> Answer[list[StoreStatus]]:
        """As read, with each page's status and holes included (StorageTier.read_each)."""
        return self._move("get", StoreStatus.TRANSIENT, page_keys, buffers, self.tier.read_each)

    def write(self, page_keys: Sequence[bytes], buffers: Buffers) -> Answer[list[bool]]:
        """Each page's buffers into the store (StorageTier.write). Until ``settled`` is done
        the store may still read them."""
        return self._move("put", False, page_keys, buffers, self.tier.write)

    def write_each(self, page_keys: Sequence[bytes], buffers: Buffers) -> Answer[list[StoreStatus]]:
        """As write, with each page's status (StorageTier.write_each)."""
        return self._move("put", StoreStatus.TRANSIENT, page_keys, buffers, self.tier.write_each)

    def _move(
        self,
        op: str,
        fail: T,
        page_keys: Sequence[bytes],
        buffers: Buffers,
        method: Callable[..., Awaitable[list[T]]],
    ) -> Answer[list[T]]:
        per_pool = self._per_pool(buffers)
        ids: list[int] = []
        host_pages: dict[PoolName, list[int]] = {}
        for pool, bufs in per_pool.items():
            host_pages[pool] = self.storage.buffers.add(bufs)
            ids.extend(host_pages[pool])
        deadline = self.storage.deadline()
        if not page_keys:
            self.storage.buffers.drop(ids)
            return Answer([], Outcome.ANSWERED, _done())
        return self.storage.call(
            op,
            [fail] * len(page_keys),
            lambda: method(page_keys, host_pages, deadline=deadline),
            ids,
        )

    def _per_pool(self, buffers: Buffers) -> Mapping[PoolName, Sequence[PageBuffer]]:
        if isinstance(buffers, Mapping):
            return buffers
        if len(self.tier.pools) != 1:
            raise ConfigError(
                f"bounded tier of pools {[p.value for p in self.tier.pools]}: expected the "
                "buffers as a mapping pool -> page buffers (one sequence per pool)"
            )
        return {self.tier.pools[0]: buffers}

    def __repr__(self) -> str:
        return f"<BoundedTier {[p.value for p in self.tier.pools]} over {self.storage!r}>"
