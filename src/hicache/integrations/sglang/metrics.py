"""The SGLang backend's metrics: its IntegrationCounters, its storage tiers, and their export.

- BackendMetrics(pools, port, register_global, tp_rank): ``metrics`` (a HiCacheMetrics with
  the backend's IntegrationCounters, label ``source="sglang"``, and a StorageTierSource over its
  per-pool StorageTiers, label ``cache="sglang"``), ``counters`` (what the backend feeds at
  each batch_exists* / batch_get* / batch_set* call), and the exports the extra config asks for:
  ``metrics_port`` N serves on 127.0.0.1:N+tp_rank (one port per TP rank process), ``metrics``
  true registers in prometheus_client's global REGISTRY of the process. ``close()`` undoes both.

hicache.metrics.prometheus (and so prometheus_client, the extra ``hicache[metrics]``) is imported
only when an export is asked for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hicache.cache.storage import TierPort
from hicache.metrics import HiCacheMetrics, IntegrationCounters, StorageTierSource

SOURCE = "sglang"


class BackendMetrics:
    """The counters, sources and exports of one HiCacheBackend (module docstring)."""

    def __init__(
        self,
        tiers: Callable[[], Mapping[str, TierPort]],
        *,
        port: int | None,
        register_global: bool,
        tp_rank: int,
    ) -> None:
        self.counters = IntegrationCounters(SOURCE)
        self.metrics = HiCacheMetrics()
        self.metrics.add_source(self.counters)
        self.metrics.add_source(StorageTierSource(tiers, name=SOURCE))
        self.server: Any = None
        self._collector: Any = None
        if port is None and not register_global:
            return
        from hicache.metrics import prometheus

        if register_global:
            self._collector = prometheus.register(self.metrics)
        if port is not None:
            try:
                self.server = prometheus.serve(self.metrics, port + tp_rank if port else 0)
            except BaseException:
                self.close()
                raise

    def close(self) -> None:
        """Stop the server and leave the global registry; idempotent."""
        server, self.server = self.server, None
        collector, self._collector = self._collector, None
        if server is not None:
            server.close()
        if collector is not None:
            from hicache.metrics import prometheus

            prometheus.unregister(collector)
