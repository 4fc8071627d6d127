"""The connector's SCHEDULER role: vLLM's scheduler-side hooks translated for SchedulerSide.

- SchedulerConnector: get_num_new_matched_tokens, update_state_after_alloc,
  get_external_cache_hit_sources, build_connector_meta, update_connector_output,
  request_finished, reset_cache, take_events (hicache.integrations.vllm.events: the tiers'
  KV events, made only when vLLM's kv_events_config enables them). ``time_steps``: whether
  the load policy times engine steps, false under vLLM's asynchronous scheduling
  (hicache.integrations.vllm.load_policy). It reads
  vLLM's Request, KVCacheBlocks and SchedulerOutput and hands plain values (token ids, block
  ids, each block's extra keys through hicache.integrations.vllm.request_keys) to
  hicache.integrations.vllm.scheduler.SchedulerSide, which decides hits and plans.

Reference: vllm/distributed/kv_transfer/kv_connector/v1/base.py (the scheduler-side methods),
vllm/v1/core/sched/output.py (SchedulerOutput).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage
from hicache.integrations.vllm.events import TierEvents, describer
from hicache.integrations.vllm.layout import Shape
from hicache.integrations.vllm.load_policy import LoadPolicy
from hicache.integrations.vllm.metadata import HiCacheMetadata, HiCacheWorkerMetadata
from hicache.integrations.vllm.request_keys import prompt_tokens, request_extras
from hicache.integrations.vllm.scheduler import Scheduled, SchedulerSide
from hicache.integrations.vllm.settings import ConnectorSettings
from hicache.integrations.vllm.stats import ConnectorStats

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class SchedulerConnector:
    """The scheduler half of HiCacheConnector (one per vLLM engine core)."""

    def __init__(
        self,
        shape: Shape,
        settings: ConnectorSettings,
        *,
        store: BoundedStorage | None,
        store_keys: Callable[[bytes], list[StoreKey]],
        stats: ConnectorStats,
        kv_events: bool = False,
        hash_block_size: int | None = None,
        time_steps: bool = True,
    ) -> None:
        self.shape = shape
        self._requests: dict[str, Request] = {}
        # kv_events: vLLM's kv_events_config.enable_kv_cache_events (nobody takes them otherwise)
        self.events = (
            TierEvents(
                describer(self._requests, shape.block_size, hash_block_size or shape.block_size),
                block_size=shape.block_size,
                host_slots=shape.host_slots,
                group_idx=shape.layout.attn_group,
            )
            if kv_events
            else None
        )
        self.side = SchedulerSide(
            block_size=shape.block_size,
            host_slots=shape.host_slots,
            store=store,
            store_keys=store_keys,
            write_storage=settings.writes_storage,
            save_decode=settings.save_decode,
            ranks=shape.ranks,
            stats=stats,
            state_groups=len(shape.layout.state_groups),
            state_slots=shape.state_slots,
            events=self.events,
            window_groups=len(shape.layout.window_groups),
            window_tokens=shape.layout.window_tokens,
            window_slots=shape.window_slots,
            null_blocks=shape.layout.attn_sliding,
            heads=shape.heads,
            policy=LoadPolicy(settings.load_policy, time_steps=time_steps),
        )
        self.storage_backend = settings.storage_backend

    def tracked_requests(self) -> int:
        """vLLM requests this role still holds, and the side's own (0 once all ended)."""
        return len(self._requests) + self.side.tracked()

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        return self.side.match(
            request.request_id,
            prompt_tokens(request),
            num_computed_tokens,
            request_extras(request, self.shape.block_size),
        )

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if num_external_tokens <= 0:
            self.side.after_alloc(request.request_id, [], 0)
            return
        groups = blocks.get_block_ids()
        layout = self.shape.layout
        self.side.after_alloc(
            request.request_id,
            groups[layout.attn_group],
            num_external_tokens,
            [groups[g] for g in layout.state_groups],
            [groups[g] for g in layout.window_groups],
        )

    def build_connector_meta(
        self, scheduler_output: SchedulerOutput, manager: KVCacheManager
    ) -> HiCacheMetadata:
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
        layout = self.shape.layout
        attn, state, window = layout.attn_group, layout.state_groups, layout.window_groups
        plan = self.side.build(
            steps,
            lambda rid: manager.get_block_ids(rid)[attn],
            (lambda rid: [manager.get_block_ids(rid)[g] for g in state]) if state else None,
            (lambda rid: [manager.get_block_ids(rid)[g] for g in window]) if window else None,
        )
        return HiCacheMetadata(plan)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.side.policy.step_ended()  # vLLM processes the output of the step built last
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, HiCacheWorkerMetadata):
            self.side.on_events(meta.events.events)

    def request_finished(self, request: Request) -> tuple[bool, dict[str, Any] | None]:
        # Saves finish within their step (wait_for_save): vLLM may free the blocks now.
        self.side.finished(request.request_id)
        self._requests.pop(request.request_id, None)
        return False, None

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[CacheHitSource, int]:
        """vLLM's split of the accepted hit by tier: host pages as HOST, store pages as DISK
        (the directory store) or EXTERNAL_UNSPECIFIED (any other store, e.g. Mooncake)."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        host, storage = self.side.hit_sources(request.request_id, num_external_tokens)
        outer = (
            CacheHitSource.DISK
            if self.storage_backend == "directory"
            else CacheHitSource.EXTERNAL_UNSPECIFIED
        )
        out = {CacheHitSource.HOST: host, outer: storage}
        return {source: n for source, n in out.items() if n}

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.events.take() if self.events is not None else ()

    def reset_cache(self) -> bool:
        self.side.index.clear_unpinned()
        if self.side.states is not None:
            self.side.states.clear_unpinned()
        if self.side.windows is not None:
            self.side.windows.clear_unpinned()
        return True
