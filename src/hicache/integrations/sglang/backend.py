"""hicache's stores as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

- HiCacheBackend: a ``sglang.srt.mem_cache.hicache_storage.HiCacheStorage`` that SGLang's own
  factory loads with extra config ``{"backend_name": "hicache", "module_path":
  "hicache.integrations.sglang", "class_name": "HiCacheBackend", "interface_v1": 1, "store":
  "directory", "store_path": PATH, ...}`` (see docs/sglang.md). It serves the legacy calls
  (``batch_get`` / ``batch_set`` / ``batch_exists`` of flat pages), the v1 zero-copy calls
  (``batch_get_v1`` / ``batch_set_v1`` of host indices) and the v2 calls of hybrid side pools
  (``batch_exists_v2`` / ``batch_get_v2`` / ``batch_set_v2`` with ``PoolTransfer``), with the
  return values SGLang's controller relies on (python/sglang/srt/managers/cache_controller.py).

Every store call goes through hicache's StorageTier (one per registered SGLang pool, one shared
store): a deadline per call, the circuit breaker, statuses and statistics, driven through
hicache.engine.bounded.BoundedStorage: SGLang's controller threads wait for a call at most
``deadline_s + grace_s`` and then get a miss (get, exists) or a failed backup (set); while that
call is still running every call is refused at once, so a dead or stalled store never stalls
them, and ``close`` returns within the same bound. Pages are stored in SGLang's flat page
order whatever path moves them (hicache.integrations.sglang.pages). Importing this module imports
SGLang; nothing else in hicache does (an import-linter contract keeps it so).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from hicache.bootstrap.storage import open_named_store
from hicache.domain.errors import ConfigError, shown
from hicache.domain.pools import PoolName
from hicache.domain.storage import PageBuffer, Store
from hicache.engine.bounded import Answer, BoundedSettings, BoundedStorage, BoundedTier
from hicache.engine.logs import get_logger
from hicache.engine.storage_settings import StorageTierSettings
from hicache.engine.storage_tier import StorageTier
from hicache.integrations.sglang.arguments import (
    flat_pages,
    host_tokens,
    one_key,
    page_keys,
    transfers_of,
)
from hicache.integrations.sglang.keys import page_key, pool_namespace
from hicache.integrations.sglang.metrics import BackendMetrics
from hicache.integrations.sglang.pages import PoolPages, tensor_bytes
from hicache.integrations.sglang.settings import BackendSettings

log = get_logger("hicache.sglang")

# SGLang sends at most this many pages per call (hicache_storage.STORAGE_BATCH_SIZE).
SGLANG_BATCH_PAGES = 128


@attrs.define
class _Pool:
    name: str
    pages: PoolPages
    calls: BoundedTier  # the pool's StorageTier (``calls.tier``), bounded
    namespace: str
    replicated: bool

    @property
    def tier(self) -> StorageTier:
        return self.calls.tier


def _plain(_inst: object, _field: object, value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


class HiCacheBackend(HiCacheStorage):  # type: ignore[misc]
    """hicache's storage tier behind SGLang's HiCacheStorage interface (module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        if not isinstance(storage_config, HiCacheStorageConfig):
            raise ConfigError(
                f"HiCacheBackend: storage_config must be SGLang's HiCacheStorageConfig, got "
                f"{type(storage_config).__name__}"
            )
        self.settings = BackendSettings.parse(storage_config.extra_config)
        extra = dict(storage_config.extra_config or {})
        self.storage_config = storage_config
        self.interface_v1 = bool(extra.get("interface_v1", 0))
        # Mooncake moves bytes only from and to host memory registered with it: the pools'
        # (zero-copy) memory, never SGLang's per-call flat pages or a staging page.
        self.zero_copy_only = self.settings.store == "mooncake"
        if self.zero_copy_only and not self.interface_v1:
            raise ConfigError(
                "hicache sglang backend key 'interface_v1': store 'mooncake' needs "
                "interface_v1: 1 (the legacy calls hand over flat page copies, which Mooncake "
                "cannot read or write)"
            )
        if kwargs is not None and not isinstance(kwargs, Mapping):
            raise ConfigError(
                f"HiCacheBackend: kwargs must be a mapping, got {type(kwargs).__name__} "
                f"{shown(kwargs)}"
            )
        given = (kwargs or {}).get("store")
        if given is not None and not isinstance(given, Store):
            raise ConfigError(
                f"HiCacheBackend: kwargs['store'] must be a hicache Store, got {shown(given)}"
            )
        self.store: Store = (
            given
            if given is not None
            else open_named_store(self.settings.store, self.settings.store_config)
        )
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()
        self._skipped_non_writer = 0
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }
        try:
            self._exports = BackendMetrics(
                lambda: {name: p.tier for name, p in list(self._pools.items())},
                port=self.settings.metrics_port,
                register_global=self.settings.metrics,
                tp_rank=int(getattr(storage_config, "tp_rank", 0) or 0),
            )
        except BaseException:
            if given is None:
                self.store.close()
            raise
        # hicache's metrics of this backend (docs/sglang.md, "Metrics"): a HiCacheMetrics a
        # framework may register itself; ``counters`` is its IntegrationCounters.
        self.metrics = self._exports.metrics
        self.counters = self._exports.counters
        # Built last: it owns the store from here on (its close closes the store).
        self._bounded = BoundedStorage(
            self.store,
            BoundedSettings(deadline_s=self.settings.deadline_s, grace_s=self.settings.grace_s),
        )
        self._closed = False

    # -- registration -------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._add_pool("kv", mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        name = getattr(host_pool_name, "value", host_pool_name)
        if not isinstance(name, str) or not name:  # checked before SGLang keys a dict by it
            raise ConfigError(
                f"HiCacheBackend: host_pool_name {shown(host_pool_name)}: expected a pool name "
                "(SGLang's PoolName or a non-empty str)"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        existing = self._pools.get(name)
        if existing is not None and existing.pages.pool is host_pool:
            return
        self._add_pool(name, host_pool)

    def _add_pool(self, name: str, pool: Any) -> None:
        try:
            pages = PoolPages(name, pool)
        except (AttributeError, TypeError, ValueError) as e:
            raise ConfigError(
                f"HiCacheBackend: pool {shown(name)}: {shown(pool)} is not an SGLang host pool "
                f"({type(e).__name__}: {e})"
            ) from e
        if pages.page_size <= 0 or pages.flat_nbytes <= 0:
            raise ConfigError(
                f"HiCacheBackend: pool {shown(name)}: page_size {pages.page_size} and page bytes "
                f"{pages.flat_nbytes}: expected both > 0"
            )
        if self.zero_copy_only and not pages.zero_copy:
            raise ConfigError(
                f"HiCacheBackend: pool {shown(name)} ({type(pool).__name__}, layout "
                f"{shown(pages.layout)}) has no zero-copy segments ({pages.copy_reason}): store "
                f"{shown(self.settings.store)} cannot serve it; use a page_first layout or store "
                "'directory'"
            )
        if pages.zero_copy:
            # Zero-copy stores (Mooncake) must know the host memory first; others ignore it.
            self.store.register(pages.regions())
        namespace, replicated = pool_namespace(self.storage_config, name, pages.describe())
        try:
            internal = PoolName.parse(name)
        except ConfigError:
            internal = PoolName.KV
        tier_settings = StorageTierSettings(
            batch_pages=SGLANG_BATCH_PAGES,
            max_concurrency=self.settings.max_concurrency,
            call_deadline_s=self.settings.deadline_s,
            breaker_threshold=self.settings.breaker_threshold,
            breaker_cooldown_s=self.settings.breaker_cooldown_s,
        )
        calls = self._bounded.tier({internal: namespace}, [internal], tier_settings)
        with self._lock:
            self._pools[name] = _Pool(name, pages, calls, namespace, replicated)
        log.info(
            "sglang pool registered",
            pool=name,
            namespace=namespace,
            zero_copy=pages.zero_copy,
            copy_reason=pages.copy_reason,
            page_bytes=pages.flat_nbytes,
        )

    def pool(self, name: str) -> _Pool:
        found = self._pools.get(name)
        if found is None:
            raise ConfigError(
                f"HiCacheBackend: pool {shown(name)} is not registered: expected one of "
                f"{', '.join(sorted(self._pools)) or 'none (register_mem_pool_host first)'}"
            )
        return found

    # -- running a tier call from an SGLang thread --------------------------------------------

    def _answered(self, op: str, answer: Answer[Any]) -> bool:
        """Count a call the bounded storage did not answer (closed, stuck, timeout)."""
        if not answer.answered:
            self.counters.count_error(operation=op, status=answer.outcome.value)
        return answer.answered

    @property
    def _stuck(self) -> int:
        """Store calls that overran ``deadline_s + grace_s`` and are still running."""
        return self._bounded.stuck

    # -- the page moves -----------------------------------------------------------------------

    def _store_call(
        self, op: str, pool: _Pool, keys: Sequence[str], buffers: list[PageBuffer]
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
        ok, answered = answer.value, self._answered(op, answer)
        seconds = time.perf_counter() - start
        moved = sum(ok)
        self._note("prefetch" if op == "get" else "backup", pool, moved, seconds)
        nbytes = moved * pool.pages.flat_nbytes
        if op == "get":
            self.counters.count_load(pages=moved, nbytes=nbytes, seconds=seconds, ok=answered)
        else:
            self.counters.count_save(
                pages=moved, nbytes=nbytes, seconds=seconds, ok=answered and moved == len(keys)
            )
        return ok

    def _get(
        self,
        pool: _Pool,
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

    def _set(self, pool: _Pool, keys: Sequence[str], buffers: list[PageBuffer]) -> list[bool]:
        """The write path of every set call; a non-writer rank of a replicated pool stores
        nothing and answers True (the writer rank stores the same bytes)."""
        if pool.replicated and not self.storage_config.is_storage_writer:
            with self._lock:
                self._skipped_non_writer += len(keys)
            return [True] * len(keys)
        return self._store_call("set", pool, keys, buffers)

    def _note(self, kind: str, pool: _Pool, pages: int, seconds: float) -> None:
        if not pages:
            return
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            gbs = pages * pool.pages.flat_nbytes / max(seconds, 1e-9) / 1e9
            self._metrics[f"{kind}_bandwidth"].append(gbs)

    def _get_host(self, pool: _Pool, keys: Sequence[str], tokens: list[int]) -> list[bool]:
        """Read pages into the pool at ``tokens``: in place (zero-copy) or through staging."""
        if pool.pages.zero_copy:
            return self._get(pool, keys, [pool.pages.segments(t) for t in tokens])
        staging = [pool.pages.staging() for _ in tokens]

        def fill(ok: list[bool]) -> None:
            for t, page, good in zip(tokens, staging, ok, strict=True):
                if good:
                    pool.pages.fill_from(t, page)

        return self._get(pool, keys, [[tensor_bytes(p)] for p in staging], fill)

    def _set_host(self, pool: _Pool, keys: Sequence[str], tokens: list[int]) -> list[bool]:
        """Write the pool's pages at ``tokens``: in place (zero-copy) or flat copies."""
        if pool.pages.zero_copy:
            return self._set(pool, keys, [pool.pages.segments(t) for t in tokens])
        return self._set(pool, keys, [[pool.pages.flat_copy(t)] for t in tokens])

    # -- v1: zero-copy by host indices --------------------------------------------------------

    def _v1(self, op: str, keys: object, host_indices: object) -> list[bool]:
        call = f"batch_{op}_v1"
        checked = page_keys(keys, call)
        pool = self.pool("kv")
        tokens = host_tokens(host_indices, len(checked), pool.pages.page_size, pool.name, call)
        move = self._get_host if op == "get" else self._set_host
        return move(pool, checked, tokens)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """One bool per key; the Trues are a leading run (a prefetch stops at the first miss)."""
        return self._v1("get", keys, host_indices)

    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """One bool per key (a FULL page fails alone; SGLang stops a backup at the first False)."""
        return self._v1("set", keys, host_indices)

    # -- legacy: flat pages -------------------------------------------------------------------

    def batch_get(
        self,
        keys: list[str],
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> list[torch.Tensor | None]:
        """Each target (a flat page, e.g. ``get_dummy_flat_data_page()``) filled, or None."""
        keys = page_keys(keys, "batch_get")
        pool = self.pool("kv")
        buffers = flat_pages(
            target_locations, len(keys), pool.pages.flat_nbytes, pool.name, "target_locations"
        )
        ok = self._get(pool, keys, buffers)
        return [t if good else None for t, good in zip(target_locations, ok, strict=True)]

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        """True when every flat page was stored."""
        keys = page_keys(keys, "batch_set")
        pool = self.pool("kv")
        if isinstance(values, list | tuple):
            values = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
        return all(
            self._set(
                pool,
                keys,
                flat_pages(values, len(keys), pool.pages.flat_nbytes, pool.name, "values"),
            )
        )

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        one_key(key, "get")
        if target_location is None:
            target_location = self.pool("kv").pages.staging()
        return self.batch_get([key], [target_location])[0]

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        one_key(key, "set")
        return self.batch_set([key], [value])

    def exists(self, key: str) -> bool:
        one_key(key, "exists")
        return self.batch_exists([key]) == 1

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """The number of leading keys the store probably holds (0 when it cannot answer)."""
        keys = page_keys(keys, "batch_exists")
        if not keys:
            return 0
        pool = self.pool("kv")
        answer = pool.calls.exists([page_key(k) for k in keys])
        self._answered("exists", answer)
        found = answer.value
        self._count_lookup(pool, len(keys), found)
        return found

    def _count_lookup(self, pool: _Pool, pages: int, hit_pages: int) -> None:
        ps = pool.pages.page_size
        self.counters.count_lookup(tokens=pages * ps, hit_tokens={"storage": hit_pages * ps})

    def _exists_each(self, pool: _Pool, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        answer = pool.calls.exists_each([page_key(k) for k in keys])
        self._answered("exists", answer)
        return answer.value

    # -- v2: hybrid side pools ----------------------------------------------------------------

    def batch_exists_v2(
        self,
        keys: list[str],
        pool_transfers: list[PoolTransfer] | None = None,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> PoolTransferResult:
        """The usable prefix under each side pool's hit policy (SGLang's file backend's rules):
        ``kv_hit_pages``, the pages each pool has, and the prefix lengths every pool can restore."""
        keys = page_keys(keys, "batch_exists_v2")
        pool_transfers = transfers_of(
            [] if pool_transfers is None else pool_transfers, PoolTransfer, "batch_exists_v2"
        )
        kv = self._exists_each(self.pool("kv"), keys)
        kv_pages = kv.index(False) if False in kv else len(kv)
        hits: dict[str, int] = {"kv": kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(getattr(transfer.name, "value", transfer.name))
            have = self._exists_each(self.pool(name), keys[:kv_pages])
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = have.index(False) if False in have else kv_pages
                allowed = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys) if transfer.keys else 1)
                allowed = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - window) : n])}
                boundary = max(allowed, default=0)
            else:
                raise ConfigError(
                    f"HiCacheBackend: pool {shown(name)} hit policy {shown(transfer.hit_policy)} is not "
                    "supported: expected all_pages or trailing_pages"
                )
            if boundary:
                hits[name] = boundary
            restorable = [n for n in restorable if n in allowed]
        usable = restorable[-1] if restorable else 0
        self._count_lookup(self.pool("kv"), len(keys), usable)
        return PoolTransferResult(usable, hits, restorable)

    def _v2(self, transfers: list[PoolTransfer], op: str) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for transfer in transfers_of(transfers, PoolTransfer, f"batch_{op}_v2"):
            name = str(getattr(transfer.name, "value", transfer.name))
            pool = self.pool(name)
            keys = page_keys(transfer.keys or [], f"batch_{op}_v2 pool {shown(name)}")
            indices = transfer.host_indices
            expected = len(keys) * pool.pages.page_size
            if indices is None or (
                isinstance(indices, torch.Tensor) and int(indices.numel()) != expected
            ):
                # SGLang's file backend answers all False (and logs) here; so do we.
                log.error(
                    "v2 host_indices length mismatch",
                    op=op,
                    pool=name,
                    expected=expected,
                    got=None if indices is None else int(indices.numel()),
                )
                self.counters.count_error(operation=op, status="bad_host_indices")
                out[transfer.name] = [False] * len(keys)
                continue
            call = f"batch_{op}_v2 pool {shown(name)}"
            tokens = host_tokens(indices, len(keys), pool.pages.page_size, pool.name, call)
            move = self._get_host if op == "get" else self._set_host
            out[transfer.name] = move(pool, keys, tokens)
        return out

    def batch_get_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Per pool name, one bool per key (a leading run per pool)."""
        return self._v2(transfers, "get")

    def batch_set_v2(
        self, transfers: list[PoolTransfer], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> dict[str, list[bool]]:
        """Per pool name, one bool per key."""
        return self._v2(transfers, "set")

    # -- statistics and lifecycle -------------------------------------------------------------

    def statistics(self) -> dict[str, Any]:
        """hicache's statistics: per pool, the tier's (pages, bytes, calls, statuses, breaker)."""
        pools = {
            name: {
                "namespace": p.namespace,
                "replicated": p.replicated,
                "zero_copy": p.pages.zero_copy,
                "copy_reason": p.pages.copy_reason,
                "page_bytes": p.pages.flat_nbytes,
                "tier": attrs.asdict(p.tier.statistics(), value_serializer=_plain),
            }
            for name, p in list(self._pools.items())
        }
        bounded = self._bounded.statistics()
        return {
            "store": self.store.name,
            "pools": pools,
            "timed_out_calls": bounded.timed_out_calls,
            "refused_while_stuck": bounded.refused_while_stuck,
            "skipped_non_writer": self._skipped_non_writer,
        }

    def get_stats(self) -> Any:
        """SGLang's StorageMetrics (pages and GB/s per call since the last get_stats), with
        hicache's statistics() as its ``hicache`` attribute."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            drained = {k: list(v) for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        metrics = StorageMetrics(
            prefetch_pgs=[int(x) for x in drained["prefetch_pgs"]],
            backup_pgs=[int(x) for x in drained["backup_pgs"]],
            prefetch_bandwidth=drained["prefetch_bandwidth"],
            backup_bandwidth=drained["backup_bandwidth"],
        )
        metrics.hicache = self.statistics()
        return metrics

    def close(self) -> None:
        """Stop the tiers' loop and close the store (BoundedStorage.close: within ``deadline_s
        + grace_s``, a stuck store call is left to finish); idempotent. Later calls miss."""
        if self._closed:
            return
        self._closed = True
        try:
            self._bounded.close()
        finally:
            self._exports.close()
