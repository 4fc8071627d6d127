"""The SGLang backend's page moves: one read path and one write path under every call family.

- PageMoves(counters, window, storage_config): ``get`` / ``set`` move pages between given
  buffers and a pool's bounded tier (one store call, SGLang's CallWindow and hicache's counters
  of it); ``get_host`` / ``set_host`` move a pool's pages at host token indices, in place when
  the pool has zero-copy segments, else through staging pages (get) or flat copies (set);
  ``exists`` / ``exists_each`` ask the tier which keys the store holds. A call the bounded
  storage did not answer (closed, stuck, timeout) is counted as an error and answered as a miss
  or a failed backup. A non-writer rank of a replicated pool stores nothing and answers True
  (the writer rank stores the same bytes); ``skipped_non_writer`` counts those pages.

Pages are stored in SGLang's flat page order whatever path moves them
(hicache.integrations.sglang.pages).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from hicache.domain.storage import PageBuffer
from hicache.engine.bounded import Answer
from hicache.integrations.sglang.keys import page_key
from hicache.integrations.sglang.pages import tensor_bytes
from hicache.integrations.sglang.stats import CallWindow
from hicache.integrations.sglang.tiers import BackendPool
from hicache.metrics import IntegrationCounters


class PageMoves:
    """The read and write paths of one HiCacheBackend (module docstring). Thread-safe."""

    def __init__(self, counters: IntegrationCounters, window: CallWindow, storage_config: Any):
        self.counters = counters
        self.window = window
        self.storage_config = storage_config  # SGLang's HiCacheStorageConfig
        self._lock = threading.Lock()
        self._skipped_non_writer = 0

    @property
    def skipped_non_writer(self) -> int:
        """Pages a non-writer rank of a replicated pool answered True without storing."""
        return self._skipped_non_writer

    def answered(self, op: str, answer: Answer[Any]) -> bool:
        """Count a call the bounded storage did not answer (closed, stuck, timeout)."""
        if not answer.answered:
            self.counters.count_error(operation=op, status=answer.outcome.value)
        return answer.answered

    # -- the store call -----------------------------------------------------------------------

    def _store_call(
        self, op: str, pool: BackendPool, keys: Sequence[str], buffers: list[PageBuffer]
    ) -> list[bool]:
        """One bounded store call of ``op`` ("get" or "set"): per key, whether it moved;
        SGLang's statistics and hicache's counters of it."""
        if not keys:
            return []
        start = time.perf_counter()
        store_keys = [page_key(k) for k in keys]
        if op == "get":
            answer = pool.calls.read(store_keys, buffers)
        else:
            answer = pool.calls.write(store_keys, buffers)
        ok, answered = answer.value, self.answered(op, answer)
        seconds = time.perf_counter() - start
        moved = sum(ok)
        kind = "prefetch" if op == "get" else "backup"
        self.window.note(kind, moved, pool.pages.flat_nbytes, seconds)
        nbytes = moved * pool.pages.flat_nbytes
        if op == "get":
            self.counters.count_load(pages=moved, nbytes=nbytes, seconds=seconds, ok=answered)
        else:
            self.counters.count_save(
                pages=moved, nbytes=nbytes, seconds=seconds, ok=answered and moved == len(keys)
            )
        return ok

    # -- the read and write paths -------------------------------------------------------------

    def get(
        self,
        pool: BackendPool,
        keys: Sequence[str],
        buffers: list[PageBuffer],
        finish: Callable[[list[bool]], None] | None = None,
    ) -> list[bool]:
        """The read path of every get call: read ``buffers``, then ``finish`` (staged pages
        copied into the pool) with the per-key result."""
        ok = self._store_call("get", pool, keys, buffers)
        if finish is not None:
            finish(ok)
        return ok

    def set(self, pool: BackendPool, keys: Sequence[str], buffers: list[PageBuffer]) -> list[bool]:
        """The write path of every set call; a non-writer rank of a replicated pool stores
        nothing and answers True (the writer rank stores the same bytes)."""
        if pool.replicated and not self.storage_config.is_storage_writer:
            with self._lock:
                self._skipped_non_writer += len(keys)
            return [True] * len(keys)
        return self._store_call("set", pool, keys, buffers)

    def get_host(self, pool: BackendPool, keys: Sequence[str], tokens: list[int]) -> list[bool]:
        """Read pages into the pool at ``tokens``: in place (zero-copy) or through staging."""
        if pool.pages.zero_copy:
            return self.get(pool, keys, [pool.pages.segments(t) for t in tokens])
        staging = [pool.pages.staging() for _ in tokens]

        def fill(ok: list[bool]) -> None:
            for t, page, good in zip(tokens, staging, ok, strict=True):
                if good:
                    pool.pages.fill_from(t, page)

        return self.get(pool, keys, [[tensor_bytes(p)] for p in staging], fill)

    def set_host(self, pool: BackendPool, keys: Sequence[str], tokens: list[int]) -> list[bool]:
        """Write the pool's pages at ``tokens``: in place (zero-copy) or flat copies."""
        if pool.pages.zero_copy:
            return self.set(pool, keys, [pool.pages.segments(t) for t in tokens])
        return self.set(pool, keys, [[pool.pages.flat_copy(t)] for t in tokens])

    def host(self, op: str) -> Callable[[BackendPool, Sequence[str], list[int]], list[bool]]:
        """``get_host`` for op "get", else ``set_host``."""
        return self.get_host if op == "get" else self.set_host

    # -- lookups ------------------------------------------------------------------------------

    def exists(self, pool: BackendPool, keys: Sequence[str]) -> int:
        """The number of leading keys the store probably holds (0 when it cannot answer);
        counted as a lookup."""
        answer = pool.calls.exists([page_key(k) for k in keys])
        self.answered("exists", answer)
        found: int = answer.value
        self.count_lookup(pool, len(keys), found)
        return found

    def exists_each(self, pool: BackendPool, keys: Sequence[str]) -> list[bool]:
        """Per key, whether the store probably holds it (all False when it cannot answer)."""
        if not keys:
            return []
        answer = pool.calls.exists_each([page_key(k) for k in keys])
        self.answered("exists", answer)
        found: list[bool] = answer.value
        return found

    def count_lookup(self, pool: BackendPool, pages: int, hit_pages: int) -> None:
        ps = pool.pages.page_size
        self.counters.count_lookup(tokens=pages * ps, hit_tokens={"storage": hit_pages * ps})
