"""The demo's embedding framework: the hybrid model served over hicache's pools and engine.

- demo_plan: the HostGroupPlan of the demo model (KV anchor + indexer sidecar on the full
  layers, sliding-window KV on the sliding layers, Gated DeltaNet state slots), built with the
  domain's constructors in one place.
- Sequence: one request's device pages: KV pages (the indexer follows them), sliding-window
  pages by page index (only those the window needs), its live state slot.
- HostEntry: a backed-up prefix on the host: its tokens, host pages per pool, and the page index
  of its first sliding-window page.
- DemoServer: what a serving framework does around the model: allocate device pages, prefill
  (with state checkpoints at page boundaries), back a prefix up to host, restore it with a
  layer-by-layer load whose per-layer waits the forward pass honours, free everything (also
  when a request fails while its load is in flight: ``release``).

It uses hicache's public API only: the domain's plan values, ``open_runtime``'s device pools,
slot allocators and transfer engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from collections.abc import Sequence as Seq

import anyio
import attrs
import torch

from hicache.bootstrap.runtime import Runtime
from hicache.demo.model import CacheTensors, HybridConfig, HybridLM, LayerKind, LayerTimes, SeqCache
from hicache.domain import (
    ConfigError,
    DType,
    HitPolicy,
    HostGroupPlan,
    IndexerGeometry,
    KVGeometry,
    LayerBinding,
    Layout,
    Pinning,
    PoolName,
    PoolPlan,
    PoolRole,
    StorageSettings,
    gated_deltanet_state,
    resolve_host_memory,
)
from hicache.domain.geometry import AnyGeometry
from hicache.engine import LoadHandle, OperationState

KV, SWA, MAMBA, INDEXER = PoolName.KV, PoolName.SWA, PoolName.MAMBA, PoolName.INDEXER
PageSet = dict[PoolName, tuple[int, ...]]


def demo_plan(
    config: HybridConfig,
    *,
    page_size: int = 64,
    device_pages: int = 160,
    host_pages: int = 512,
    device_slots: int = 16,
    host_slots: int = 64,
    layout: Layout = Layout.PAGE_FIRST_DIRECT,
) -> HostGroupPlan:
    """The host group of the demo model; transfer layer t is model layer t."""
    full = list(config.layers_of(LayerKind.FULL))
    swa = list(config.layers_of(LayerKind.SLIDING))
    delta = list(config.layers_of(LayerKind.DELTANET))
    kv = KVGeometry(kv_heads=config.kv_heads, head_dim=config.head_dim, dtype=DType.FP32)
    tokens, device_tokens = host_pages * page_size, device_pages * page_size

    def token_pool(
        name: PoolName, role: PoolRole, geometry: AnyGeometry, layers: list[int]
    ) -> PoolPlan:
        return PoolPlan(
            name=name,
            role=role,
            geometry=geometry,
            binding=LayerBinding.contiguous(layers),
            layout=layout,
            page_size=page_size,
            capacity=tokens,
            device_capacity=device_tokens,
            hit_policy=HitPolicy.TRAILING_PAGES if name is SWA else HitPolicy.ALL_PAGES,
        )

    state = gated_deltanet_state(
        key_heads=config.delta_heads,
        value_heads=config.delta_heads,
        key_dim=config.delta_dim,
        value_dim=config.delta_dim,
        conv_kernel=config.conv_kernel,
        conv_dtype=DType.FP32,
        ssm_dtype=DType.FP32,
    )
    return HostGroupPlan(
        host_memory=resolve_host_memory(StorageSettings(), Pinning.AUTO),
        pools=[
            token_pool(KV, PoolRole.ANCHOR, kv, full),
            token_pool(
                INDEXER,
                PoolRole.SIDECAR,
                IndexerGeometry(heads=1, head_dim=config.index_dim, dtype=DType.FP32),
                full,
            ),
            token_pool(SWA, PoolRole.INDEPENDENT, kv, swa),
            PoolPlan(
                name=MAMBA,
                role=PoolRole.INDEPENDENT,
                geometry=state,
                binding=LayerBinding.contiguous(delta),
                layout=layout,
                page_size=1,
                capacity=host_slots,
                device_capacity=device_slots,
                hit_policy=HitPolicy.TRAILING_PAGES,
            ),
        ],
        model_layers=tuple(range(config.layers)),
        model_type="hicache-demo-hybrid",
    )


@attrs.define
class Sequence:
    """One request's device pages (the framework's page tables)."""

    kv: list[int]
    swa: dict[int, int]
    slot: int
    capacity: int  # tokens the pages hold


@attrs.frozen
class HostEntry:
    """A prefix backed up to host: ``tokens`` (whole pages), host pages, state at its end."""

    tokens: tuple[int, ...]
    host_pages: Mapping[PoolName, tuple[int, ...]]
    swa_first: int  # page index of the first sliding-window page kept


class DemoServer:
    """The framework around the model: page tables, prefill, backup and restore via hicache."""

    def __init__(self, runtime: Runtime, model: HybridLM) -> None:
        self.rt = runtime
        self.model = model
        self.page_size = runtime.plan.anchor.page_size
        cfg = model.config
        dev = runtime.device

        def buf(pool: PoolName, name: str, layer: int) -> torch.Tensor:
            pl = runtime.plan.pool(pool).binding.pool_layer(layer)
            if pl is None:
                raise ConfigError(f"pool {pool.value!r} has no buffer for model layer {layer}")
            t: torch.Tensor = dev.pool(pool).buffers[name][pl]
            return t

        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, kind in enumerate(cfg.pattern):
            if kind is LayerKind.DELTANET:
                continue
            pool = KV if kind is LayerKind.FULL else SWA
            kv[i] = (buf(pool, "k", i), buf(pool, "v", i))
        self.caches = CacheTensors(
            kv=kv,
            index_k={i: buf(INDEXER, "k", i) for i in cfg.layers_of(LayerKind.FULL)},
            state={
                i: (buf(MAMBA, "conv", i), buf(MAMBA, "temporal", i))
                for i in cfg.layers_of(LayerKind.DELTANET)
            },
        )
        # Pages before a boundary that the sliding window can still read.
        self.swa_pages = math.ceil((cfg.window - 1) / self.page_size)
        self._live: set[int] = set()

    # -- pages ---------------------------------------------------------------------------------

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def new_sequence(self, tokens: int) -> Sequence:
        """Fresh device pages for ``tokens`` positions and a live state slot."""
        n = self._pages_for(tokens)
        got = self.rt.device_slots.allocate({KV: n, SWA: n, MAMBA: 1}).pages
        seq = Sequence(list(got[KV]), dict(enumerate(got[SWA])), got[MAMBA][0], n * self.page_size)
        self._live.add(id(seq))
        return seq

    def extend(self, seq: Sequence, tokens: int) -> None:
        """Grow ``seq`` to hold ``tokens`` positions."""
        more = self._pages_for(tokens) - len(seq.kv)
        if more <= 0:
            return
        got = self.rt.device_slots.allocate({KV: more, SWA: more}).pages
        base = len(seq.kv)
        seq.kv.extend(got[KV])
        seq.swa.update({base + i: p for i, p in enumerate(got[SWA])})
        seq.capacity = len(seq.kv) * self.page_size

    def new_slot(self) -> int:
        """A state slot for a checkpoint."""
        return self.rt.device_slots.allocate({MAMBA: 1}).pages[MAMBA][0]

    def free_slot(self, slot: int) -> None:
        self.rt.engine.free_device({MAMBA: (slot,)})

    def free(self, seq: Sequence) -> None:
        self.rt.engine.free_device(
            {KV: tuple(seq.kv), SWA: tuple(seq.swa.values()), MAMBA: (seq.slot,)}
        )
        self._live.discard(id(seq))

    def scribble(self) -> None:
        """Overwrite every device buffer with garbage (only when no sequence is live): a restore
        must then bring every byte it needs back from host."""
        if self._live:
            raise ConfigError(f"{len(self._live)} sequences are live; scribbling would corrupt them")
        for pool in self.rt.device.pools.values():
            for layers in pool.buffers.values():
                for t in layers:
                    t.fill_(float("nan"))

    def _view(self, seq: Sequence) -> SeqCache:
        ps = self.page_size
        pos = torch.arange(seq.capacity)
        full = torch.tensor(seq.kv, dtype=torch.long)[pos // ps] * ps + pos % ps
        swa_pages = torch.full((len(seq.kv),), -1, dtype=torch.long)
        for index, page in seq.swa.items():
            swa_pages[index] = page
        page_of = swa_pages[pos // ps]
        swa = torch.where(page_of >= 0, page_of * ps + pos % ps, torch.full_like(pos, -1))
        dev = self.model.device
        return SeqCache(full_rows=full.to(dev), swa_rows=swa.to(dev), slot=seq.slot)

    # -- compute -------------------------------------------------------------------------------

    def prefill(
        self,
        seq: Sequence,
        tokens: Seq[int],
        start: int,
        *,
        wait: LoadHandle | None = None,
        checkpoints: Mapping[int, int] | None = None,
        times: LayerTimes | None = None,
    ) -> torch.Tensor:
        """Run the model on ``tokens`` at ``start`` (decode is a one-token prefill)."""
        self.extend(seq, start + len(tokens))
        return self.model.forward(
            tokens,
            start,
            self._view(seq),
            self.caches,
            wait=wait.wait_layer if wait is not None else None,
            checkpoints=checkpoints,
            times=times,
        )

    # -- host tier -----------------------------------------------------------------------------

    def prefix_pages(self, seq: Sequence, boundary: int, slot: int) -> PageSet:
        """The device pages that restore ``seq`` at token ``boundary`` (a page boundary):
        every KV page before it, the sliding-window pages the window reads, the state ``slot``."""
        if boundary <= 0 or boundary % self.page_size:
            raise ConfigError(f"boundary {boundary} is not a positive multiple of the page size")
        n = boundary // self.page_size
        first = max(0, n - self.swa_pages)
        return {
            KV: tuple(seq.kv[:n]),
            SWA: tuple(seq.swa[i] for i in range(first, n)),
            MAMBA: (slot,),
        }

    async def backup(self, seq: Sequence, tokens: Seq[int], slot: int) -> HostEntry:
        """Copy the prefix ``tokens`` of ``seq`` (whole pages; state checkpoint in ``slot``) to
        host pages the engine allocates; returns the entry that restores it."""
        boundary = len(tokens)
        pages = self.prefix_pages(seq, boundary, slot)
        handle = await self.rt.engine.backup(pages)
        await handle.wait()
        n = boundary // self.page_size
        return HostEntry(tuple(tokens), handle.host_pages, max(0, n - self.swa_pages))

    def start_restore(self, entry: HostEntry) -> LoadHandle:
        """Prepare and submit the layer-by-layer load of ``entry`` into fresh device pages."""
        handle = self.rt.engine.prepare_load(dict(entry.host_pages))
        self.rt.engine.submit()
        return handle

    def restored_sequence(self, entry: HostEntry, handle: LoadHandle) -> Sequence:
        """The sequence whose first pages are the load's: its KV pages, the window's pages, and
        the loaded state slot as its live state (the host copy keeps the checkpoint)."""
        dp = handle.device_pages
        swa = {entry.swa_first + i: p for i, p in enumerate(dp[SWA])}
        seq = Sequence(list(dp[KV]), swa, dp[MAMBA][0], len(dp[KV]) * self.page_size)
        self._live.add(id(seq))
        return seq

    async def release(self, seq: Sequence, handle: LoadHandle) -> None:
        """Free a restored sequence whatever became of its load.

        A finished load's pages are the sequence's: all are freed. A load still in flight (the
        request failed or was cancelled mid-prefill) is cancelled, which returns the pages the
        engine allocated for it; only the pages the sequence added on top are freed here.
        """
        with anyio.CancelScope(shield=True):
            if handle.state is not OperationState.DONE:
                await handle.cancel()
            if handle.state is OperationState.DONE:
                self.free(seq)
                return
            loaded = handle.device_pages
            added = {
                KV: tuple(p for p in seq.kv if p not in set(loaded.get(KV, ()))),
                SWA: tuple(p for p in seq.swa.values() if p not in set(loaded.get(SWA, ()))),
            }
            added = {pool: pages for pool, pages in added.items() if pages}
            if added:
                self.rt.engine.free_device(added)
            self._live.discard(id(seq))

    def free_host(self, entry: HostEntry) -> None:
        self.rt.engine.free_host(dict(entry.host_pages))


__all__ = ["DemoServer", "HostEntry", "Sequence", "demo_plan"]
