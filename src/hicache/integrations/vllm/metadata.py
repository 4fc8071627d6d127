"""What the connector's two roles send each other through vLLM's own channels.

- HiCacheMetadata: one step's StepPlan, scheduler -> workers (vLLM's KVConnectorMetadata).
- HiCacheWorkerMetadata: one step's per-page outcomes, workers -> scheduler
  (vLLM's KVConnectorWorkerMetadata; ``aggregate`` concatenates the ranks' events).

Both are picklable: vLLM sends them between processes when it runs the roles apart.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from hicache.integrations.vllm.plan import StepPlan, WorkerEvents


class HiCacheMetadata(KVConnectorMetadata):
    """One step's StepPlan, scheduler -> workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


class HiCacheWorkerMetadata(KVConnectorWorkerMetadata):
    """One step's per-page outcomes, workers -> scheduler (ranks concatenated)."""

    def __init__(self, events: WorkerEvents) -> None:
        self.events = events

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, HiCacheWorkerMetadata):
            return self
        return HiCacheWorkerMetadata(self.events.merge(other.events))
