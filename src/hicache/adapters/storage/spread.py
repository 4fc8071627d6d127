"""Run one job per index of a batch on the calling thread plus a few helper threads.

- Spreader: a store's helper threads (a ThreadPoolExecutor made on first use, remade after a
  fork, shut down by ``close``); ``run(n, job)`` returns ``[job(0), ..., job(n - 1)]``.

The calling thread always works through the batch itself and helpers join in when they get a
thread: a helper that never starts (all busy with another caller's batch, or shut down) costs
nothing but speed, so no index is ever left undone. Every thread takes the next index under a
lock until none is left. ``run`` returns only when no helper is still inside a job, whatever
happened (a job raised, or the caller was interrupted): a caller never reuses a buffer that a
helper is still filling. The first exception a job raised is raised again on the caller.

DirectoryStore uses it so that the payload I/O of two pages (C code, the GIL released) runs on
two cores at once: the kernel's copy of one page while the checksum of another runs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable
from typing import Generic, TypeVar, cast

T = TypeVar("T")


class _Batch(Generic[T]):
    """One ``run``: the next index to hand out, the results, the first error."""

    def __init__(self, n: int, job: Callable[[int], T]) -> None:
        self.n = n
        self.job = job
        self.out: list[T | None] = [None] * n
        self.error: BaseException | None = None
        self._next = 0
        self._lock = threading.Lock()

    def _take(self) -> int | None:
        with self._lock:
            if self.error is not None or self._next >= self.n:
                return None
            i = self._next
            self._next += 1
            return i

    def fail(self, e: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = e

    def work(self) -> None:
        """Run jobs until none is left or one failed (the caller's loop; raises)."""
        try:
            while (i := self._take()) is not None:
                self.out[i] = self.job(i)
        except BaseException as e:
            self.fail(e)
            raise

    def help(self) -> None:
        """A helper's loop: the same, but an error is kept for the caller, never raised."""
        with contextlib.suppress(BaseException):  # kept in self.error; the caller raises it
            self.work()


def _submit(
    pool: concurrent.futures.ThreadPoolExecutor,
    batch: _Batch[T],
    helpers: int,
    futures: list[concurrent.futures.Future[None]],
) -> None:
    """Start up to ``helpers`` helper loops on ``pool``, each added to ``futures`` at once (so
    an interruption midway leaves none untracked); fewer once ``pool`` is shut down."""
    with contextlib.suppress(RuntimeError):  # shut down by close(): the caller does the rest
        # extend appends each future as it is made: one raised midway leaves the others kept
        futures.extend(pool.submit(batch.help) for _ in range(helpers))


class Spreader:
    """Helper threads for batches: ``threads - 1`` of them (the caller is the other one)."""

    def __init__(self, threads: int, *, name: str) -> None:
        self.threads = threads
        self._name = name
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pid = 0
        self._lock = threading.Lock()
        self._closed = False

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._pool is None or self._pid != os.getpid():  # a forked child has no threads
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    max_workers=self.threads - 1, thread_name_prefix=self._name
                )
                self._pid = os.getpid()
            return self._pool

    def run(self, n: int, job: Callable[[int], T]) -> list[T]:
        """``[job(i) for i in range(n)]``, spread over up to ``threads`` threads."""
        batch = _Batch(n, job)
        helpers = min(self.threads, n) - 1
        pool = self._executor() if helpers > 0 else None
        futures: list[concurrent.futures.Future[None]] = []
        try:
            if pool is not None:
                _submit(pool, batch, helpers, futures)
            batch.work()
        except BaseException as e:  # also an interruption before work(): helpers take no more
            batch.fail(e)
            raise
        finally:
            for f in futures:
                f.cancel()  # not started yet: nothing to wait for
            concurrent.futures.wait(futures)
        if batch.error is not None:
            raise batch.error
        return cast(list[T], batch.out)  # every index ran: no None is left

    def close(self) -> None:
        """Stop the helper threads (a running job finishes first); later runs use the caller
        only."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
