"""Metric families read from hicache's own statistics at scrape time (no prometheus_client here).

- Family: one metric: its name (``hicache_...``, counters without ``_total``), kind (counter,
  gauge, histogram), help text, label names, and samples (label values -> a number, or a
  HistogramSnapshot for a histogram).
- FamilyBuilder(const_labels): ``add(name, kind, help, value, **labels)``, ``per_tier(...)``,
  ``build()``: how a source writes its families.
- MetricsSource: anything with ``metric_families() -> list[Family]``: a cache (through
  CacheSource), an integration's IntegrationCounters (hicache.metrics.integration), or a source
  of the caller's own.
- CacheSource(cache, name): the families of one HiCache face, its transfer engine and its
  storage tiers, read from ``cache.statistics()``, ``cache.engine.statistics()``, the host
  allocator and each storage tier's ``statistics()`` when asked (nothing on the hot path).
- HiCacheMetrics: the set of sources one exporter serves: ``add_cache``, ``add_source``,
  ``remove``, and ``families()`` (families of the same name from several sources merged).

Every metric and label is listed in docs/metrics.md. hicache.metrics.prometheus turns families
into Prometheus's; it is the only module that imports prometheus_client.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

from hicache.domain.breaker import BreakerState
from hicache.domain.errors import ConfigError
from hicache.domain.tiers import PerTier, Tier
from hicache.engine.histogram import HistogramSnapshot

if TYPE_CHECKING:
    from hicache.cache.face import HiCache
    from hicache.cache.storage import TierPort
    from hicache.cache.sync import SyncCache

KINDS = ("counter", "gauge", "histogram")
TIERS = tuple(t.name.lower() for t in Tier)
BREAKER_STATES = tuple(s.value for s in BreakerState)

Value = float | int | HistogramSnapshot


@attrs.frozen(kw_only=True)
class Family:
    """One metric family: ``samples`` maps label values (in ``labels`` order) to a value."""

    name: str
    kind: str
    help: str
    labels: tuple[str, ...]
    samples: Mapping[tuple[str, ...], Value]

    def __attrs_post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"metric {self.name!r}: kind {self.kind!r}, expected one of {KINDS}")
        for values in self.samples:
            if len(values) != len(self.labels):
                raise ConfigError(
                    f"metric {self.name!r}: label values {values!r} do not match its labels "
                    f"{self.labels!r}"
                )


@runtime_checkable
class MetricsSource(Protocol):
    """What HiCacheMetrics reads at scrape time."""

    def metric_families(self) -> list[Family]: ...


class FamilyBuilder:
    """Collects samples per family name while one source is read; ``const`` labels (e.g.
    ``{"cache": "rank0"}``) come first on every sample."""

    def __init__(self, const: Mapping[str, str]) -> None:
        self._const = dict(const)
        self._order: list[str] = []
        self._meta: dict[str, tuple[str, str, tuple[str, ...]]] = {}
        self._samples: dict[str, dict[tuple[str, ...], Value]] = {}

    def add(self, name: str, kind: str, doc: str, value: Value, **labels: str) -> None:
        names = (*self._const, *labels)
        if name not in self._meta:
            self._order.append(name)
            self._meta[name] = (kind, doc, names)
            self._samples[name] = {}
        self._samples[name][(*self._const.values(), *labels.values())] = value

    def per_tier(self, name: str, doc: str, values: PerTier, kind: str = "counter") -> None:
        for tier in TIERS:
            self.add(name, kind, doc, getattr(values, tier), tier=tier)

    def build(self) -> list[Family]:
        out = []
        for name in self._order:
            kind, doc, labels = self._meta[name]
            out.append(
                Family(name=name, kind=kind, help=doc, labels=labels, samples=self._samples[name])
            )
        return out


class CacheSource:
    """The families of one HiCache face (with its engine and storage tiers), label ``cache``."""

    def __init__(self, cache: HiCache, *, name: str = "cache") -> None:
        _check_label("name", name)
        self.cache = cache
        self.name = name
        self.pools = tuple(p.name.value for p in cache.plan.pools)

    def metric_families(self) -> list[Family]:
        f = FamilyBuilder({"cache": self.name})
        self._face(f)
        self._engine(f)
        self._slots(f)
        self._storage(f)
        return f.build()

    def _face(self, f: FamilyBuilder) -> None:
        s = self.cache.statistics()
        f.add("hicache_matches", "counter", "calls of match", s.matches)
        f.add("hicache_matched_tokens", "counter", "tokens the matches asked for", s.matched_tokens)
        f.add(
            "hicache_matched_pages", "counter", "full pages the matches asked for", s.matched_pages
        )
        f.per_tier(
            "hicache_hit_tokens",
            "tokens of the agreed hits, by the tier that served them",
            s.hit_tokens,
        )
        f.per_tier(
            "hicache_hit_pages",
            "full pages of the agreed hits, by the tier that served them",
            s.hit_pages,
        )
        f.per_tier("hicache_hit_requests", "matches with a hit on the tier", s.hit_requests)
        f.per_tier(
            "hicache_miss_tokens",
            "tokens a match looked for on the tier and found neither there nor above",
            s.miss_tokens,
        )
        f.per_tier(
            "hicache_miss_pages",
            "full pages a match looked for on the tier and found neither there nor above",
            s.miss_pages,
        )
        f.add("hicache_inserts", "counter", "calls of insert", s.inserts)
        f.add(
            "hicache_inserted_pages", "counter", "full pages registered by insert", s.inserted_pages
        )
        for outcome, n in (("ok", s.loads), ("failed", s.loads_failed)):
            f.add(
                "hicache_loads",
                "counter",
                "host -> device loads of the cache face",
                n,
                outcome=outcome,
            )
        f.add("hicache_loaded_pages", "counter", "pages loaded host -> device", s.loaded_pages)
        for outcome, n in (
            ("ok", s.backups),
            ("failed", s.backups_failed),
            ("skipped", s.backups_skipped),
        ):
            f.add(
                "hicache_backups", "counter", "device -> host backups (pages)", n, outcome=outcome
            )
        f.add("hicache_prefetches", "counter", "prefetches started (not skipped)", s.prefetches)
        f.add(
            "hicache_prefetched_pages", "counter", "pages read storage -> host", s.prefetched_pages
        )
        f.add("hicache_stored_pages", "counter", "pages written host -> storage", s.stored_pages)
        f.add(
            "hicache_store_failures",
            "counter",
            "pages not written to storage and prefetch batches cut short",
            s.store_failures,
        )
        for name in ("loaded", "backed_up", "prefetched", "stored"):
            per_pool = dict(s.bytes_by_pool.get(name, {}))
            for pool in self.pools:
                per_pool.setdefault(pool, 0)
            for pool, n in sorted(per_pool.items()):
                f.add(
                    f"hicache_{name}_bytes",
                    "counter",
                    f"bytes {name.replace('_', ' ')} ({_DIRECTION[name]}), per pool",
                    n,
                    pool=pool,
                )
        f.per_tier("hicache_evicted_pages", "pages evicted from the tier", s.evictions)
        f.per_tier(
            "hicache_pages",
            "pages the index holds on the tier (occupancy; a page on two tiers counts on both)",
            s.index.on_tier,
            kind="gauge",
        )
        f.per_tier(
            "hicache_pinned_pages",
            "pages pinned on the tier (matches, transfers)",
            s.index.pinned,
            kind="gauge",
        )
        f.add(
            "hicache_transfers_in_flight",
            "gauge",
            "index transfers prepared and not completed",
            s.index.in_flight,
        )

    def _engine(self, f: FamilyBuilder) -> None:
        e = self.cache.engine.statistics()
        for kind, outcomes in (
            ("loads", (e.loads, e.loads_failed, e.loads_cancelled)),
            ("backups", (e.backups, e.backups_failed, e.backups_cancelled)),
        ):
            for outcome, n in zip(("ok", "failed", "cancelled"), outcomes, strict=True):
                f.add(
                    f"hicache_engine_{kind}",
                    "counter",
                    f"transfer-engine {kind} by outcome",
                    n,
                    outcome=outcome,
                )
        f.add(
            "hicache_engine_loads_joined",
            "counter",
            "load handles that joined a load in flight",
            e.loads_joined,
        )
        for direction, secs in (("load", e.load_copy_s), ("backup", e.backup_copy_s)):
            f.add(
                "hicache_engine_copy_seconds",
                "counter",
                "copy-stream time of the engine's transfers",
                secs,
                direction=direction,
            )
        f.add(
            "hicache_exposed_wait_seconds",
            "counter",
            "time forward passes waited for loaded layers (copy time compute did not hide)",
            e.exposed_wait_s,
        )
        f.add(
            "hicache_engine_operations_queued",
            "gauge",
            "transfers prepared, not submitted",
            e.queued,
        )
        f.add(
            "hicache_engine_operations_in_flight",
            "gauge",
            "transfers on the copy stream",
            e.in_flight,
        )
        f.add(
            "hicache_load_seconds",
            "histogram",
            "per load: prepare to settled (latency)",
            e.load_seconds,
        )
        f.add(
            "hicache_layer_wait_seconds",
            "histogram",
            "per forward-pass wait for a loaded "
            "layer: the time it blocked (exposed time; 0 when the layer was there)",
            e.wait_seconds,
        )

    def _slots(self, f: FamilyBuilder) -> None:
        engine = self.cache.engine
        groups = [("host", engine.host_slots)]
        if engine.device_ownership == "engine":
            groups.append(("device", engine.device_slots))
        for tier, slots in groups:
            for pool in slots.order:
                a = slots.allocator(pool)
                f.add(
                    "hicache_slots",
                    "gauge",
                    "pages of the pool on the tier (capacity)",
                    a.pages,
                    tier=tier,
                    pool=pool.value,
                )
                f.add(
                    "hicache_slots_used",
                    "gauge",
                    "pages of the pool in use on the tier (occupancy)",
                    a.used_count(),
                    tier=tier,
                    pool=pool.value,
                )

    def _storage(self, f: FamilyBuilder) -> None:
        storage = self.cache.storage
        if storage is None:
            return
        storage_tier_families(f, {pool.value: tier for pool, tier in storage.tiers.items()})


def storage_tier_families(f: FamilyBuilder, tiers: Mapping[str, TierPort]) -> None:
    """The ``hicache_store_*`` and ``hicache_breaker_state`` families of storage tiers, by pool
    name (label ``pool``) and their store's name (label ``store``)."""
    for pool, tier in tiers.items():
        st = tier.statistics()
        store = getattr(getattr(tier, "store", None), "name", "store")
        lab = {"pool": pool, "store": str(store)}
        for op, ok, bad in (
            ("read", st.pages_read_ok, st.pages_read_failed),
            ("write", st.pages_written_ok, st.pages_written_failed),
        ):
            for outcome, n in (("ok", ok), ("failed", bad)):
                f.add(
                    "hicache_store_pages",
                    "counter",
                    "pages the storage tier read or wrote, by outcome",
                    n,
                    **lab,
                    operation=op,
                    outcome=outcome,
                )
        for op, n in (("read", st.bytes_read), ("write", st.bytes_written)):
            f.add(
                "hicache_store_bytes",
                "counter",
                "bytes the storage tier read or wrote",
                n,
                **lab,
                operation=op,
            )
        for op, n in sorted(st.calls.items()):
            f.add(
                "hicache_store_calls",
                "counter",
                "store calls made, by operation",
                n,
                **lab,
                operation=op,
            )
        f.add(
            "hicache_store_failed_calls",
            "counter",
            "store calls that raised or answered transient/fatal for some key",
            st.failed_calls,
            **lab,
        )
        f.add(
            "hicache_store_refused_calls",
            "counter",
            "store calls the open breaker refused",
            st.refused_calls,
            **lab,
        )
        for status, n in sorted(st.statuses.items()):
            f.add(
                "hicache_store_errors",
                "counter",
                "non-OK key statuses the store answered (get and put), by status",
                n,
                **lab,
                status=status,
            )
        f.add(
            "hicache_store_writes_dropped",
            "counter",
            "background writes refused: queue full",
            st.writes_dropped,
            **lab,
        )
        f.add(
            "hicache_store_writes_pending",
            "gauge",
            "background writes queued or running",
            st.writes_pending,
            **lab,
        )
        f.add(
            "hicache_store_seconds",
            "counter",
            "wall time inside store calls (summed over threads)",
            st.store_seconds,
            **lab,
        )
        state = st.breaker.state.value
        for s in BREAKER_STATES:
            f.add(
                "hicache_breaker_state",
                "gauge",
                "the storage tier's circuit breaker: 1 for its current state",
                int(s == state),
                **lab,
                state=s,
            )


_DIRECTION = {
    "loaded": "host -> device",
    "backed_up": "device -> host",
    "prefetched": "storage -> host",
    "stored": "host -> storage",
}


def _check_label(arg: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{arg} must be a non-empty string (a label value), got {value!r}")


class StorageTierSource:
    """The families of storage tiers that no HiCache face owns (an integration's, e.g. one
    per SGLang pool), label ``cache``; ``tiers`` is read at each scrape."""

    def __init__(self, tiers: Callable[[], Mapping[str, TierPort]], *, name: str) -> None:
        _check_label("name", name)
        self._tiers = tiers
        self.name = name

    def metric_families(self) -> list[Family]:
        f = FamilyBuilder({"cache": self.name})
        storage_tier_families(f, self._tiers())
        return f.build()

    def __repr__(self) -> str:
        return f"<StorageTierSource {self.name!r}>"


class HiCacheMetrics:
    """The sources one exporter reads at scrape time; safe to change from any thread."""

    def __init__(self) -> None:
        self._sources: list[MetricsSource] = []
        self._lock = threading.Lock()

    def add_cache(self, cache: HiCache | SyncCache, *, name: str = "cache") -> CacheSource:
        """Export ``cache`` (a HiCache or a SyncCache: its face, engine, host slots and storage
        tiers) with ``cache=name``; names must differ between caches (``rank0``, ``rank1``)."""
        from hicache.cache.face import HiCache
        from hicache.cache.sync import SyncCache

        if isinstance(cache, SyncCache):
            cache = cache.cache  # read directly: statistics are safe from the scrape thread
        if not isinstance(cache, HiCache):
            raise ConfigError(
                f"add_cache: cache must be a HiCache or SyncCache, got {type(cache).__name__}"
            )
        source = CacheSource(cache, name=name)
        with self._lock:
            taken = [s.name for s in self._sources if isinstance(s, CacheSource)]
            if name in taken:
                raise ConfigError(f"add_cache: name {name!r} is taken; the caches are {taken}")
            self._sources.append(source)
        return source

    def add_source(self, source: MetricsSource) -> MetricsSource:
        """Export another source (an integration's IntegrationCounters, or any object with
        ``metric_families()``)."""
        if not isinstance(source, MetricsSource):
            raise ConfigError(
                f"add_source: source must have metric_families() (e.g. IntegrationCounters), "
                f"got {type(source).__name__}"
            )
        with self._lock:
            self._sources.append(source)
        return source

    def remove(self, source: MetricsSource) -> None:
        """Stop exporting ``source`` (what add_cache / add_source returned)."""
        with self._lock:
            if source not in self._sources:
                raise ConfigError(f"remove: {source!r} is not one of this exporter's sources")
            self._sources.remove(source)

    @property
    def sources(self) -> tuple[MetricsSource, ...]:
        with self._lock:
            return tuple(self._sources)

    def families(self) -> list[Family]:
        """Every source's families, those of one name merged (same kind and labels)."""
        merged: dict[str, Family] = {}
        for source in self.sources:
            for fam in source.metric_families():
                have = merged.get(fam.name)
                if have is None:
                    merged[fam.name] = fam
                    continue
                if (have.kind, have.labels) != (fam.kind, fam.labels):
                    raise ConfigError(
                        f"metric {fam.name!r}: two sources disagree on its kind and labels "
                        f"({have.kind} {have.labels} and {fam.kind} {fam.labels})"
                    )
                merged[fam.name] = attrs.evolve(have, samples={**have.samples, **fam.samples})
        return list(merged.values())


__all__ = [
    "BREAKER_STATES",
    "TIERS",
    "CacheSource",
    "Family",
    "FamilyBuilder",
    "HiCacheMetrics",
    "MetricsSource",
    "StorageTierSource",
    "Value",
    "storage_tier_families",
]
