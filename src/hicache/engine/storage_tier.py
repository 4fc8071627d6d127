"""The storage tier as the engine uses it: page keys in, host pages filled or backed up, off the loop.

- StorageTier: exists (leading run of pages probably held), exists_each (per page), read
  (store -> host pages), write (host pages -> store), read_each / write_each (the same, with
  each page's StoreStatus), start_write (a background write with a completion callback),
  remove, deadline_for (the prefetch policy's deadline), buffers_safe, statistics;
  ``async with tier:`` owns the background writes.

A page's StoreKeys are one per pool, ``StoreKey(namespace of the pool, pool name, page hex)``,
unless the tier is given ``keys`` (a function of the page key): then those are the page's keys
(``exists`` asks all of them; ``read``/``write`` need exactly one per pool, in pool order).

Every store call runs on a worker thread (anyio.to_thread with a CapacityLimiter of
``max_concurrency``), in batches of at most ``batch_pages`` pages, with a deadline of at most
``call_deadline_s`` (and never past the caller's deadline). Each call first asks the circuit
breaker (hicache.domain.breaker); a refused call fails its pages without calling the store. A
call fails for the breaker when it raised or some key answered TRANSIENT or FATAL. A store's own
exceptions never leave the tier: they fail the pages and are logged.

A storage hit is the LEADING run of pages read OK: read stops at the first page that failed (or
when the deadline passed) and answers False for it and every later page.

A thread call is never abandoned: when the awaiting task is cancelled, the call finishes first
(its result is still counted), then the cancellation is raised, so no thread writes host pages
after read/write returned or raised. A store that overran a deadline may still write buffers in
its own native threads (Mooncake): after a call that answered TRANSIENT the tier asks
``store.health()``; while it is unhealthy ``buffers_safe()`` is False and the caller must not hand
the host pages of failed reads (or of writes) to anyone else.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
import attrs
from anyio.abc import TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from hicache.domain.breaker import Breaker, BreakerState
from hicache.domain.errors import ConfigError, EngineClosedError
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue
from hicache.domain.keys import page_hex
from hicache.domain.pools import PoolName
from hicache.domain.storage import (
    HostPageBuffers,
    PageBuffer,
    Store,
    StoreKey,
    StoreStatus,
    buffer_nbytes,
)
from hicache.engine.logs import get_logger
from hicache.engine.storage_settings import (
    StorageTierSettings,
    StorageTierStatistics,
    prefetch_deadline,
)

log = get_logger("hicache.storage")

_FAILED = (StoreStatus.TRANSIENT, StoreStatus.FATAL)
OnDone = Callable[[list[bool]], None]


@attrs.frozen
class _Job:
    page_keys: tuple[bytes, ...]
    host_pages: Mapping[PoolName, tuple[int, ...]]
    on_done: OnDone


class StorageTier:
    """The storage tier of one rank's host group: see the module docstring."""

    def __init__(
        self,
        store: Store,
        buffers: HostPageBuffers,
        namespaces: Mapping[PoolName, str],
        pools: Sequence[PoolName],
        settings: StorageTierSettings | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        keys: Callable[[bytes], Sequence[StoreKey]] | None = None,
    ) -> None:
        self.settings = settings if settings is not None else StorageTierSettings()
        pools = tuple(pools)
        if not pools or len(set(pools)) != len(pools):
            raise ConfigError(f"storage tier pools {pools!r}: expected distinct pool names")
        missing = [p.value for p in pools if p not in namespaces]
        if missing and keys is None:
            raise ConfigError(f"storage tier pools {missing} have no namespace")
        self.store = store
        self.pools = pools
        self._buffers = buffers
        self._namespaces = dict(namespaces)
        self._clock = clock
        self._keys = keys
        self._breaker = Breaker(self.settings.breaker_threshold, self.settings.breaker_cooldown_s)
        self._limiter = anyio.CapacityLimiter(self.settings.max_concurrency)
        self._pages: Counter[str] = Counter()
        self._bytes: Counter[str] = Counter()
        self._calls: Counter[str] = Counter()
        self._statuses: Counter[str] = Counter()
        self._failed_calls = 0
        self._refused_calls = 0
        self._writes_dropped = 0
        self._pending = 0
        self._store_seconds = 0.0
        self._unsafe: str | None = None
        self._tg: TaskGroup | None = None
        self._send: MemoryObjectSendStream[_Job] | None = None
        self._recv: MemoryObjectReceiveStream[_Job] | None = None
        self._opened = False

    # -- policy ------------------------------------------------------------------------------

    def deadline_for(self, tokens: int, now: float | None = None) -> float | None:
        """The prefetch deadline of ``tokens`` tokens under the settings' policy (see
        storage_settings.prefetch_deadline); ``now`` defaults to the tier's clock."""
        return prefetch_deadline(self.settings, tokens, self._clock() if now is None else now)

    # -- keys and buffers --------------------------------------------------------------------

    def store_keys(self, page_key: bytes) -> list[StoreKey]:
        """The StoreKeys of one page key: one per stored pool (in ``pools`` order), or what the
        tier's ``keys`` function gives."""
        if self._keys is not None:
            return list(self._keys(page_key))
        text = page_hex(page_key)
        return [StoreKey(self._namespaces[p], p.value, text) for p in self.pools]

    def _check(
        self, page_keys: Sequence[bytes], host_pages: Mapping[PoolName, Sequence[int]]
    ) -> None:
        for pool in self.pools:
            pages = host_pages.get(pool)
            if pages is None or len(pages) != len(page_keys):
                got = None if pages is None else len(pages)
                raise ConfigError(
                    f"storage tier: pool {pool.value!r} has {got} host pages for "
                    f"{len(page_keys)} page keys: expected one host page per page key"
                )

    def _batch(
        self,
        page_keys: Sequence[bytes],
        host_pages: Mapping[PoolName, Sequence[int]],
        lo: int,
        hi: int,
    ) -> tuple[list[StoreKey], list[PageBuffer]]:
        keys: list[StoreKey] = []
        bufs: list[PageBuffer] = []
        for i in range(lo, hi):
            page = self.store_keys(page_keys[i])
            if len(page) != len(self.pools):
                raise ConfigError(
                    f"storage tier: page {page_keys[i].hex()[:16]} has {len(page)} store keys "
                    f"for {len(self.pools)} pools: expected one key per pool to move its bytes"
                )
            keys.extend(page)
            bufs.extend(self._buffers.buffer(p, host_pages[p][i]) for p in self.pools)
        return keys, bufs

    # -- one store call ----------------------------------------------------------------------

    def _call_deadline(self, deadline: float | None) -> float:
        own = self._clock() + self.settings.call_deadline_s
        return own if deadline is None else min(own, deadline)

    async def _call(self, op: str, fn: Callable[[], Any]) -> Any | None:
        """Run one store call off the loop; None when the breaker refused or the store raised."""
        if not self._breaker.allow(self._clock()):
            self._refused_calls += 1
            return None
        self._calls[op] += 1
        start = time.perf_counter()
        try:
            # Not abandoned on cancellation: a cancelled caller waits for the thread first.
            result = await anyio.to_thread.run_sync(fn, limiter=self._limiter)
        except Exception as exc:  # a store's own exception type never leaves the tier
            self._store_seconds += time.perf_counter() - start
            self._failed_calls += 1
            self._breaker.record(False, self._clock())
            log.warning("store call raised", store=self.store.name, op=op, error=repr(exc))
            return None
        except BaseException:  # cancelled while waiting for the limiter: the call never ran
            self._breaker.abandon()
            raise
        self._store_seconds += time.perf_counter() - start
        return result

    async def _statuses_call(
        self, op: str, fn: Callable[[], list[StoreStatus]]
    ) -> list[StoreStatus] | None:
        statuses = await self._call(op, fn)
        if statuses is None:
            return None
        failed = any(s in _FAILED for s in statuses)
        self._statuses.update(s.value for s in statuses if not s.ok)
        if failed:
            self._failed_calls += 1
        self._breaker.record(not failed, self._clock())
        if StoreStatus.TRANSIENT in statuses:
            await self._check_health()
        return list(statuses)

    async def _check_health(self) -> None:
        # Not through the breaker: health is asked even while the breaker is open.
        self._calls["health"] += 1
        try:
            health = await anyio.to_thread.run_sync(self.store.health, limiter=self._limiter)
        except Exception as exc:
            self._unsafe = f"store.health() raised {exc!r}"
            log.warning("store.health() raised", store=self.store.name, error=repr(exc))
            return
        self._unsafe = None if health.healthy else (health.detail or "unhealthy")
        if self._unsafe is not None:
            log.warning(
                "store unhealthy: host pages of its calls are quarantined",
                store=self.store.name,
                detail=self._unsafe,
            )

    def buffers_safe(self) -> bool:
        """False while the store reported unhealthy after a call that answered TRANSIENT: a
        call past its deadline may still write (or read) host pages of that call. While False,
        do not hand those host pages to another transfer. Polls ``store.health()`` (a snapshot)
        again when unsafe, so it turns True once the store reports healthy."""
        if self._unsafe is None:
            return True
        try:
            health = self.store.health()
        except Exception as exc:
            log.warning("store.health() raised", store=self.store.name, error=repr(exc))
            return False
        if health.healthy:
            self._unsafe = None
        return health.healthy

    # -- the tier's operations ---------------------------------------------------------------

    async def exists(self, page_keys: Sequence[bytes], *, deadline: float | None = None) -> int:
        """How many leading pages every pool probably holds (a hint, never a hit); 0 when the
        breaker is open or the call failed. No store call starts once ``deadline`` (absolute,
        the tier's clock; None = none beyond call_deadline_s) passed."""
        found = 0
        for held in await self._exists(page_keys, deadline, leading=True):
            if not held:
                break
            found += 1
        return found

    async def exists_each(
        self, page_keys: Sequence[bytes], *, deadline: float | None = None
    ) -> list[bool]:
        """Per page, whether every pool probably holds it (a hint, holes included: a caller with
        its own hit rule, e.g. a trailing window, needs more than the leading run); all False
        from the first batch the breaker refused, that failed or that ``deadline`` cut off."""
        return await self._exists(page_keys, deadline, leading=False)

    async def _exists(
        self, page_keys: Sequence[bytes], deadline: float | None, *, leading: bool
    ) -> list[bool]:
        out = [False] * len(page_keys)
        step = self.settings.batch_pages
        for lo in range(0, len(page_keys), step):
            if deadline is not None and self._clock() >= deadline:
                break
            hi = min(lo + step, len(page_keys))
            per_page = [self.store_keys(page_keys[i]) for i in range(lo, hi)]
            keys = [k for page in per_page for k in page]
            call_deadline = self._call_deadline(deadline)
            answer = await self._call(
                "exists", functools.partial(self.store.exists, keys, deadline=call_deadline)
            )
            if answer is None:
                break
            self._breaker.record(self._clock() <= call_deadline, self._clock())
            at = 0
            for j, page in enumerate(per_page):
                out[lo + j] = all(answer[at : at + len(page)])
                at += len(page)
            if leading and not all(out[lo:hi]):
                break
        return out

    async def read(
        self,
        page_keys: Sequence[bytes],
        host_pages: Mapping[PoolName, Sequence[int]],
        *,
        deadline: float | None,
    ) -> list[bool]:
        """Get every pool's object of each page into its host page; per page True only when every
        pool answered OK. The Trues are a leading run: reading stops at the first failed page or
        once ``deadline`` (absolute, the tier's clock; None = no overall deadline) passed."""
        statuses = await self._transfer("get", page_keys, host_pages, deadline, leading=True)
        out = [False] * len(statuses)
        for i, s in enumerate(statuses):
            if not s.ok:
                break
            out[i] = True
        return out

    async def write(
        self,
        page_keys: Sequence[bytes],
        host_pages: Mapping[PoolName, Sequence[int]],
        *,
        deadline: float | None,
    ) -> list[bool]:
        """Put each page's host bytes of every pool; per page True when every pool answered OK.
        Later batches are still written after a failed page (FULL, INVALID); past the deadline
        the remaining pages are False."""
        return [s.ok for s in await self.write_each(page_keys, host_pages, deadline=deadline)]

    async def read_each(
        self,
        page_keys: Sequence[bytes],
        host_pages: Mapping[PoolName, Sequence[int]],
        *,
        deadline: float | None,
    ) -> list[StoreStatus]:
        """Like read, but every batch is read (holes included) and each page gets its status:
        OK when every pool answered OK, else the first pool's non-OK status; TRANSIENT for a
        page no store call answered (the breaker refused, the store raised, ``deadline``
        passed). A page OK after a failed one holds its bytes in its host page."""
        return await self._transfer("get", page_keys, host_pages, deadline, leading=False)

    async def write_each(
        self,
        page_keys: Sequence[bytes],
        host_pages: Mapping[PoolName, Sequence[int]],
        *,
        deadline: float | None,
    ) -> list[StoreStatus]:
        """Like write, with each page's status (as read_each)."""
        return await self._transfer("put", page_keys, host_pages, deadline, leading=False)

    async def _transfer(
        self,
        op: str,
        page_keys: Sequence[bytes],
        host_pages: Mapping[PoolName, Sequence[int]],
        deadline: float | None,
        *,
        leading: bool,
    ) -> list[StoreStatus]:
        """Each page's status; with ``leading``, no batch after a failed page is read and
        every page from the first failed one is counted as failed (read answers the leading
        run of OK)."""
        self._check(page_keys, host_pages)
        out = [False] * len(page_keys)  # counted OK
        each = [StoreStatus.TRANSIENT] * len(page_keys)
        n = len(self.pools)
        step = self.settings.batch_pages
        method = self.store.get if op == "get" else self.store.put
        kind = "read" if op == "get" else "written"
        try:
            for lo in range(0, len(page_keys), step):
                if deadline is not None and self._clock() >= deadline:
                    break
                hi = min(lo + step, len(page_keys))
                keys, bufs = self._batch(page_keys, host_pages, lo, hi)
                call = functools.partial(method, keys, bufs, deadline=self._call_deadline(deadline))
                statuses = await self._statuses_call(op, call)
                if statuses is None:
                    break
                stop = False
                for j in range(hi - lo):
                    page = statuses[j * n : (j + 1) * n]
                    each[lo + j] = next((s for s in page if not s.ok), StoreStatus.OK)
                    ok = each[lo + j].ok
                    if ok and not (leading and stop):
                        out[lo + j] = True
                        self._bytes[kind] += sum(
                            buffer_nbytes(b) for b in bufs[j * n : (j + 1) * n]
                        )
                    else:
                        stop = stop or not ok
                if leading and stop:
                    break
        finally:
            good = sum(out)
            self._pages[f"{kind}_ok"] += good
            self._pages[f"{kind}_failed"] += len(out) - good
        return each

    async def remove(self, page_keys: Sequence[bytes]) -> list[bool]:
        """Forget every pool's object of each page; per page True when every pool answered OK."""
        keys = [k for pk in page_keys for k in self.store_keys(pk)]
        if not keys:
            return []
        statuses = await self._statuses_call("remove", functools.partial(self.store.remove, keys))
        if statuses is None:
            return [False] * len(page_keys)
        n = len(self.pools)
        return [all(s.ok for s in statuses[i * n : (i + 1) * n]) for i in range(len(page_keys))]

    # -- background writes -------------------------------------------------------------------

    async def __aenter__(self) -> StorageTier:
        if self._opened:
            raise EngineClosedError("storage tier: already opened once (a tier is opened once)")
        self._opened = True
        send, recv = anyio.create_memory_object_stream[_Job](self.settings.write_queue)
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._send, self._recv, self._tg = send, recv, tg
        for _ in range(self.settings.max_concurrency):
            tg.start_soon(self._worker, recv)
        return self

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
        # The body's exception propagates on its own; the task group only sees our cancel.
        await self._close(cancel=exc is not None)

    async def aclose(self, *, cancel: bool = False) -> None:
        """Stop taking background writes; drain the queued ones (cancel=False) or cancel them
        (cancel=True: every queued or running write's on_done gets all False). Call it from the
        task that entered ``async with`` (or let the ``async with`` call it); idempotent."""
        await self._close(cancel=cancel)

    async def _close(self, *, cancel: bool) -> None:
        tg, send, recv = self._tg, self._send, self._recv
        if tg is None or send is None or recv is None:
            return
        self._tg = self._send = None
        send.close()
        if cancel:
            tg.cancel_scope.cancel()
        try:
            await tg.__aexit__(None, None, None)
        finally:
            self._fail_queued(recv)
            self._recv = None
            recv.close()

    def _fail_queued(self, recv: MemoryObjectReceiveStream[_Job]) -> None:
        while True:
            try:
                job = recv.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream, anyio.ClosedResourceError):
                return
            self._pending -= 1
            self._done(job, [False] * len(job.page_keys))

    def start_write(
        self,
        page_keys: Sequence[bytes],
        host_pages: Mapping[PoolName, Sequence[int]],
        on_done: OnDone,
    ) -> None:
        """Queue a background write of these host pages (keep them pinned until on_done).

        ``on_done(per-page ok)`` is called exactly once, from the event loop: after the write,
        when the tier is closed with cancel=True, or at once (before start_write returns, all
        False) when the queue is full. EngineClosedError when the tier is not open.
        """
        if self._send is None:
            raise EngineClosedError("storage tier: start_write needs an open tier (async with)")
        self._check(page_keys, host_pages)
        job = _Job(tuple(page_keys), {p: tuple(host_pages[p]) for p in self.pools}, on_done)
        try:
            self._send.send_nowait(job)
        except anyio.WouldBlock:
            self._writes_dropped += 1
            self._done(job, [False] * len(job.page_keys))
            return
        self._pending += 1

    async def _worker(self, recv: MemoryObjectReceiveStream[_Job]) -> None:
        async for job in recv:
            results = [False] * len(job.page_keys)
            try:
                results = await self.write(job.page_keys, job.host_pages, deadline=None)
            except Exception as exc:  # e.g. a host page outside its pool: fail this write only
                log.error("background storage write failed", error=repr(exc))
            finally:
                self._pending -= 1
                self._done(job, results)

    def _done(self, job: _Job, results: list[bool]) -> None:
        try:
            job.on_done(results)
        except Exception as exc:  # a callback's bug must not stop the other writes
            log.error("storage write on_done raised", error=repr(exc))

    # -- statistics --------------------------------------------------------------------------

    @property
    def breaker_state(self) -> BreakerState:
        return self._breaker.state

    def statistics(self) -> StorageTierStatistics:
        return StorageTierStatistics(
            pages_read_ok=self._pages["read_ok"],
            pages_read_failed=self._pages["read_failed"],
            pages_written_ok=self._pages["written_ok"],
            pages_written_failed=self._pages["written_failed"],
            bytes_read=self._bytes["read"],
            bytes_written=self._bytes["written"],
            calls=dict(self._calls),
            failed_calls=self._failed_calls,
            refused_calls=self._refused_calls,
            statuses=dict(self._statuses),
            writes_dropped=self._writes_dropped,
            writes_pending=self._pending,
            store_seconds=self._store_seconds,
            breaker=self._breaker.snapshot(),
            buffers_safe=self._unsafe is None,
        )
