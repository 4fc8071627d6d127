"""The connector's WORKER role: vLLM's worker-side hooks translated for WorkerTransfers.

- WorkerConnector.register(kv_caches, rank): checks vLLM's registered caches against the
  Layout and builds the rank's WorkerTransfers (host memory, copies, store I/O); registers the
  host memory with the store (Store.register: a zero-copy store such as Mooncake transfers
  only to and from registered memory), unregistered again at shutdown.
- bind / start_load_kv / wait_for_layer_load / save_kv_layer / wait_for_save: one step's plan
  run around vLLM's forward pass (wait_for_save waits for no copy); handle_preemptions orders
  the next step after the saves still in flight; get_finished, get_transfer_results,
  get_block_ids_with_load_errors and build_connector_worker_meta report what happened.

Reference: vllm/distributed/kv_transfer/kv_connector/v1/base.py (the worker-side methods),
vllm/v1/worker/kv_connector_model_runner_mixin.py (when vLLM calls them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from hicache.adapters.copy.rows import RowCopier
from hicache.domain import CacheStateError, ConfigError, DeviceError, TransferError
from hicache.domain.storage import StoreKey
from hicache.engine.bounded import BoundedStorage
from hicache.engine.logs import get_logger
from hicache.integrations.vllm.block_rows import heads_tokens_order, manager_blocks
from hicache.integrations.vllm.kv_layouts import HEADS_FIRST
from hicache.integrations.vllm.layout import Shape
from hicache.integrations.vllm.metadata import HiCacheMetadata, HiCacheWorkerMetadata
from hicache.integrations.vllm.plan import StepPlan, WorkerEvents
from hicache.integrations.vllm.settings import ConnectorSettings
from hicache.integrations.vllm.stats import ConnectorStats
from hicache.integrations.vllm.tp_reads import LayerHeads, TpReader, head_geometry
from hicache.integrations.vllm.worker import WorkerTransfers, block_rows, choose_copier, state_rows
from hicache.integrations.vllm.worker_host import address, unregister

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorMetadata,
        KVConnectorTransferResults,
    )
    from vllm.forward_context import ForwardContext

log = get_logger("hicache.vllm")
IDLE_WAIT_S = 0.02  # longest wait for the store thread in a step without a forward


class WorkerConnector:
    """The worker half of HiCacheConnector (one per vLLM worker, i.e. per rank)."""

    def __init__(
        self,
        shape: Shape,
        settings: ConnectorSettings,
        *,
        num_blocks: int,
        store: BoundedStorage | None,
        store_key: Callable[[int, bytes], StoreKey],
        stats: ConnectorStats,
    ) -> None:
        self.shape = shape
        self.settings = settings
        self.num_blocks = num_blocks
        self.store = store
        self.store_key = store_key
        self.stats = stats
        self._transfers: WorkerTransfers | None = None

    @property
    def transfers(self) -> WorkerTransfers:
        if self._transfers is None:
            raise CacheStateError(
                "HiCacheConnector worker: no KV caches registered yet (vLLM calls "
                "register_kv_caches before the first step)"
            )
        return self._transfers

    def _check_order(self, name: str, cache: torch.Tensor) -> None:
        """A block's bytes lie in the order the store namespace says (Shape.block_order)."""
        found = heads_tokens_order(cache)
        expected = self.shape.block_order or HEADS_FIRST
        if found is not None and found != expected:
            raise DeviceError(
                f"HiCacheConnector: vLLM's cache of layer {name!r} (shape {tuple(cache.shape)}, "
                f"strides {cache.stride()}) holds each block as {found}; vLLM's resolved KV "
                f"cache layout says {expected} (the store namespace records it)"
            )

    def register(self, kv_caches: dict[str, torch.Tensor], rank: int) -> None:
        layout, num_blocks = self.shape.layout, self.num_blocks
        # attention caches over vLLM's blocks, where the kernel splits them (manager_blocks)
        attention = [name for name, _ in layout.kv] + [name for name, _, _ in layout.window]
        kv_caches = {
            name: manager_blocks(name, cache, num_blocks) if name in attention else cache
            for name, cache in kv_caches.items()
        }
        layers = []
        for name, nbytes in layout.kv:
            if name not in kv_caches:
                raise ConfigError(f"HiCacheConnector: vLLM registered no cache for layer {name!r}")
            self._check_order(name, kv_caches[name])
            rows = block_rows(name, kv_caches[name], num_blocks)
            if rows.shape[1] != nbytes:
                raise ConfigError(
                    f"HiCacheConnector: layer {name!r} has {rows.shape[1]} bytes per block; "
                    f"vLLM's cache spec says {nbytes}"
                )
            layers.append((name, rows))
        states = []
        for name, pos, nbytes in layout.state:
            if name not in kv_caches:
                raise ConfigError(f"HiCacheConnector: vLLM registered no cache for layer {name!r}")
            rows = state_rows(name, kv_caches[name], num_blocks)
            if rows.shape[1] != nbytes:
                raise ConfigError(
                    f"HiCacheConnector: state layer {name!r} has {rows.shape[1]} bytes per "
                    f"block; vLLM's state spec says {nbytes}"
                )
            states.append((name, pos, rows))
        windows = []
        for name, pos, nbytes in layout.window:
            if name not in kv_caches:
                raise ConfigError(f"HiCacheConnector: vLLM registered no cache for layer {name!r}")
            self._check_order(name, kv_caches[name])
            rows = block_rows(name, kv_caches[name], num_blocks)
            if rows.shape[1] != nbytes:
                raise ConfigError(
                    f"HiCacheConnector: sliding-window layer {name!r} has {rows.shape[1]} bytes "
                    f"per block; vLLM's cache spec says {nbytes}"
                )
            windows.append((name, pos, rows))
        caches = [rows for _, rows in layers] + [rows for _, _, rows in (*states, *windows)]
        self._transfers = WorkerTransfers(
            layers,
            host_bytes=self.shape.host_slots * self.shape.page_bytes,
            store=self.store,
            store_key=lambda page: self.store_key(rank, page),
            stats=self.stats,
            rank=rank,
            state_layers=states,
            state_host_bytes=self.shape.state_host_bytes,
            window_layers=windows,
            window_host_bytes=self.shape.window_slots * layout.window_bytes,
            copier=self._copier(caches),
            tp_reads=self._tp_reader(kv_caches, rank),
        )
        if self.store is not None:  # Mooncake moves bytes only to and from registered memory
            try:
                self.store.store.register(self._transfers.tier.regions())
            except BaseException:
                self._transfers.close()
                self._transfers = None
                raise

    def _tp_reader(self, kv_caches: dict[str, torch.Tensor], rank: int) -> TpReader | None:
        """Reads of pages stored at another TP size, for models whose blocks split by head
        (a cache whose heads cannot be sliced reads only whole objects: the same heads)."""
        heads = self.shape.heads
        if heads is None:
            return None
        per = heads.per_rank(self.shape.ranks)
        try:
            layers: list[LayerHeads] | None = [
                head_geometry(name, kv_caches[name], self.num_blocks, per)
                for name, _ in self.shape.layout.kv
            ]
        except ConfigError as exc:
            log.warning("vllm.tp_slices_unavailable", rank=rank, reason=str(exc))
            layers = None
        store = self.store.store if self.store is not None else None
        return TpReader(heads, self.shape.ranks, rank, layers, store=store)

    def _copier(self, caches: list[torch.Tensor]) -> RowCopier:
        try:
            return choose_copier(self.settings.copy_backend, caches)
        except TransferError as exc:  # the native helper or the CUDA driver cannot run here
            raise ConfigError(
                f"kv_connector_extra_config 'copy_backend' = {self.settings.copy_backend!r}: "
                f"{exc}; set 'copy_backend': 'torch' to copy with torch"
            ) from exc

    # vLLM may run a forward (its profiling and warm-up runs) before it registers the caches:
    # until then every hook is a no-op that reports nothing.

    def bind(self, metadata: KVConnectorMetadata) -> None:
        if self._transfers is not None:
            plan = metadata.plan if isinstance(metadata, HiCacheMetadata) else StepPlan()
            self._transfers.bind(plan)

    def start_load_kv(self, forward_context: ForwardContext) -> None:
        t = self._transfers
        if t is None:
            return
        t.start_step()
        if getattr(forward_context, "attn_metadata", True) is None:
            # a step with no forward (vLLM's kv_connector_no_forward): nothing to overlap, so
            # settle the copies in flight and let the store thread run (wait_pending)
            t.wait_saves()
            t.wait_pending(IDLE_WAIT_S)

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._transfers is not None:
            self._transfers.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str) -> None:
        if self._transfers is not None:
            self._transfers.save_layer(layer_name)

    def wait_for_save(self) -> None:
        # Submits what is left of the step; waits for no copy (WorkerTransfers.finish_step).
        if self._transfers is not None:
            self._transfers.finish_step()

    def handle_preemptions(self) -> None:
        # Before vLLM overwrites blocks it freed (preempted or finished requests): later
        # compute and loads wait for the saves still reading them (WorkerTransfers.fence).
        if self._transfers is not None:
            self._transfers.poll()
            self._transfers.fence()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        if self._transfers is None:
            return None, None
        self._transfers.poll()
        return None, self._transfers.drain_finished() or None

    def get_transfer_results(self, results: type[KVConnectorTransferResults]) -> Any:
        t = self._transfers
        if t is None:
            return results()
        t.poll()
        failed = t.drain_failed()
        return results(finished_recving=t.drain_finished() | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._transfers.drain_errors() if self._transfers is not None else set()

    def build_connector_worker_meta(self) -> HiCacheWorkerMetadata | None:
        if self._transfers is None:
            return None
        self._transfers.poll()
        events = self._transfers.drain_events()
        return HiCacheWorkerMetadata(WorkerEvents(events)) if events else None

    def shutdown(self) -> None:
        if self._transfers is not None:
            starts = [address(v) for v in self._transfers.tier.regions()]
            self._transfers.close()
            if self._transfers.tp_reads is not None:
                self._transfers.tp_reads.close()
            if self.store is not None:  # the store closes next: nothing moves in between
                for start in starts:
                    unregister(self.store.store, start)
