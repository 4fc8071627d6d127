"""hicache's metrics: what a cache, its engine, its storage tiers and an integration report,
read at scrape time (docs/metrics.md).

- HiCacheMetrics: the sources one exporter serves (``add_cache``, ``add_source``, ``remove``).
- IntegrationCounters: the counters a serving-framework integration feeds (lookups and hits per
  tier, loads, saves, errors).
- StorageTierSource: the storage tiers no HiCache face owns (an integration's).
- MetricsSource / Family / FamilyBuilder: how a source of one's own writes its figures.

This package needs nothing beyond hicache's own dependencies. Prometheus (the optional extra
``hicache[metrics]``) lives in hicache.metrics.prometheus: ``register`` in a framework's
CollectorRegistry, ``serve`` on a port, ``exposition`` for one scrape's text.
"""

from hicache.metrics.families import (
    CacheSource,
    Family,
    FamilyBuilder,
    HiCacheMetrics,
    MetricsSource,
    StorageTierSource,
)
from hicache.metrics.integration import IntegrationCounters, IntegrationStatistics

__all__ = [
    "CacheSource",
    "Family",
    "FamilyBuilder",
    "HiCacheMetrics",
    "IntegrationCounters",
    "IntegrationStatistics",
    "MetricsSource",
    "StorageTierSource",
]
