"""The connector's counters as vLLM's own metrics objects.

- HiCacheStats: vLLM's KVConnectorStats over hicache's plain counter dict (names:
  hicache.integrations.vllm.stats.NAMES); vLLM aggregates it across workers and steps.
- HiCachePromMetrics: one Prometheus counter per name, ``vllm:hicache_<name>`` per engine,
  on vLLM's own /metrics.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

from hicache.integrations.vllm.stats import NAMES

if TYPE_CHECKING:
    from vllm.config import VllmConfig


class HiCacheStats(KVConnectorStats):
    """vLLM's stats object over hicache's plain counter dict."""

    def reset(self) -> None:
        self.data = dict.fromkeys(NAMES, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class HiCachePromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per ConnectorStats name: ``vllm:hicache_<name>`` (per engine)."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        for name in NAMES:
            counter = self._counter_cls(
                name=f"vllm:hicache_{name}",
                documentation=f"HiCacheConnector {name.replace('_', ' ')} (docs/vllm.md)",
                labelnames=labelnames,
            )
            self.counters[name] = create_metric_per_engine(counter, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self.counters.get(name)
            if per_engine is not None and value > 0:
                per_engine[engine_idx].inc(value)
