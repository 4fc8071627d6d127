"""The demo's embedding framework: the hybrid model served over hicache's pools and engine.

- demo_plan: the HostGroupPlan of the demo model (KV anchor + indexer sidecar on the full
  layers, sliding-window KV on the sliding layers, Gated DeltaNet state slots), built with the
  domain's constructors in one place.
- demo_cache_settings: the CacheSettings the demo opens its cache face with (write-through to
  host, and to storage when there is a store; the model's sliding window; wait_complete
  prefetches).
- Sequence: one request's device pages (the framework's page tables): KV pages (the indexer
  follows them), sliding-window pages by page index (only those the window needs), its live
  state slot, and the restored state checkpoint its first chunk reads.
- Request: one request in flight: its match, its load, its sequence, the device pages the
  framework gave the load, the state slots it checkpoints into.
- DemoServer: what a serving framework does around the model and the cache face: allocate
  device pages, ``begin`` a request (match, allocate the load's device pages, load layer by
  layer), ``prefill`` with per-layer waits and state checkpoints at the face's boundaries,
  ``finish`` it (insert what it computed, free what stays the framework's, release the match)
  or ``abort`` it (cancel the load, free everything of its own), evict tiers, prefetch; it
  tallies the tokens its matches served per tier (``served``: device, host, storage).

It uses hicache's public API only: the domain's plan values, ``open_cache`` (device pools,
slot allocator, the cache face) and the face's calls. The framework owns its device pages
(``device_ownership="framework"``): its allocator is the runtime's ``device_slots`` (which the
engine never touches then); it hands pages to ``load`` and ``insert`` and frees what ``insert``
and ``evict`` give back.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Sequence as Seq

import anyio
import attrs
import torch

from hicache.bootstrap.cache import CacheRuntime
from hicache.cache.match import CacheLoad, CacheMatch
from hicache.cache.values import CacheSettings
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
    Tier,
    WriteSettings,
    gated_deltanet_state,
    resolve_host_memory,
)
from hicache.domain.geometry import AnyGeometry
from hicache.engine.storage_settings import StorageTierSettings

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


def demo_cache_settings(config: HybridConfig, *, storage: bool) -> CacheSettings:
    """Write-through to host (and to the store when there is one), every 8 pages and the end
    of an insert keep a state checkpoint, prefetches wait until complete."""
    return CacheSettings(
        writes=WriteSettings(host="write_through", storage="write_through" if storage else None),
        sliding_window=config.window,
        storage=StorageTierSettings(prefetch_policy="wait_complete") if storage else None,
    )


@attrs.define
class Sequence:
    """One request's device pages (the framework's page tables)."""

    kv: list[int]
    swa: dict[int, int]
    slot: int
    capacity: int  # tokens the pages hold
    state_from: int | None = None  # the restored checkpoint the first chunk reads


@attrs.define
class Request:
    """One request in flight (see DemoServer.begin)."""

    tokens: tuple[int, ...]
    match: CacheMatch
    load: CacheLoad
    seq: Sequence
    hit: int  # tokens restored (whole pages)
    load_pages: PageSet  # device pages the framework gave the load
    own: PageSet  # device pages of this request that are the framework's (not the cache's)
    checkpoints: dict[int, int] = attrs.field(factory=dict)  # token boundary -> state slot


class DemoServer:
    """The framework around the model: page tables, prefill, and the cache face's calls."""

    def __init__(self, crt: CacheRuntime, model: HybridLM) -> None:
        self.crt = crt
        self.cache = crt.cache
        self.rt = crt.runtime
        self.model = model
        self.page_size = self.rt.plan.anchor.page_size
        cfg = model.config
        dev = self.rt.device

        def buf(pool: PoolName, name: str, layer: int) -> torch.Tensor:
            pl = self.rt.plan.pool(pool).binding.pool_layer(layer)
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
        self._live: set[int] = set()
        # What the framework saw its matches serve, per tier (tokens): the demo reports it, and
        # a metrics scrape of the cache must show the same (docs/metrics.md).
        self.served = [0, 0, 0]

    # -- pages ---------------------------------------------------------------------------------

    def _pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def allocate(self, counts: Mapping[PoolName, int]) -> PageSet:
        counts = {p: n for p, n in counts.items() if n > 0}
        if not counts:
            return {}
        return {p: tuple(v) for p, v in self.rt.device_slots.allocate(counts).pages.items()}

    def free_pages(self, pages: Mapping[PoolName, Seq[int]]) -> None:
        pages = {p: tuple(v) for p, v in pages.items() if v}
        if pages:
            self.rt.device_slots.free(pages)

    def new_sequence(self, tokens: int) -> Sequence:
        """Fresh device pages for ``tokens`` positions and a live state slot."""
        n = self._pages_for(tokens)
        got = self.allocate({KV: n, SWA: n, MAMBA: 1})
        seq = Sequence(list(got[KV]), dict(enumerate(got[SWA])), got[MAMBA][0], n * self.page_size)
        self._live.add(id(seq))
        return seq

    def extend(self, seq: Sequence, tokens: int) -> None:
        """Grow ``seq`` to hold ``tokens`` positions."""
        more = self._pages_for(tokens) - len(seq.kv)
        if more <= 0:
            return
        got = self.allocate({KV: more, SWA: more})
        base = len(seq.kv)
        seq.kv.extend(got[KV])
        seq.swa.update({base + i: p for i, p in enumerate(got[SWA])})
        seq.capacity = len(seq.kv) * self.page_size

    def new_slot(self) -> int:
        """A state slot for a checkpoint."""
        return self.allocate({MAMBA: 1})[MAMBA][0]

    def free(self, seq: Sequence) -> None:
        """Free every page of a sequence the cache never saw (a recompute)."""
        self.free_pages({KV: seq.kv, SWA: tuple(seq.swa.values()), MAMBA: (seq.slot,)})
        self._live.discard(id(seq))

    def scribble(self) -> None:
        """Overwrite every device buffer with garbage (only when no sequence is live and nothing
        is cached on the device): a restore must then bring every byte it needs back."""
        if self._live:
            raise ConfigError(
                f"{len(self._live)} sequences are live; scribbling would corrupt them"
            )
        on_device = self.cache.index.statistics().on_tier.device
        if on_device:
            raise ConfigError(
                f"{on_device} pages are cached on the device; evict them before scribbling"
            )
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
        return SeqCache(
            full_rows=full.to(dev), swa_rows=swa.to(dev), slot=seq.slot, state_from=seq.state_from
        )

    # -- compute -------------------------------------------------------------------------------

    def prefill(
        self,
        seq: Sequence,
        tokens: Seq[int],
        start: int,
        *,
        wait: CacheLoad | None = None,
        checkpoints: Mapping[int, int] | None = None,
        times: LayerTimes | None = None,
    ) -> torch.Tensor:
        """Run the model on ``tokens`` at ``start`` (decode is a one-token prefill); with
        ``wait``, each layer waits for its part of the load before it reads its cache."""
        self.extend(seq, start + len(tokens))
        out = self.model.forward(
            tokens,
            start,
            self._view(seq),
            self.caches,
            wait=wait.wait_model_layer if wait is not None else None,
            checkpoints=checkpoints,
            times=times,
        )
        seq.state_from = None  # the live slot holds the state from now on
        return out

    # -- the cache face ------------------------------------------------------------------------

    async def begin(self, tokens: Seq[int], computed: int) -> Request:
        """Match ``tokens`` (at least one token is left to compute), load the hit into device
        pages of the framework's, and set up the sequence and the state checkpoints of the
        ``computed`` positions this request will run (the face's CheckpointPolicy boundaries)."""
        match = await self._match(tokens)
        own: dict[PoolName, list[int]] = {}
        load_pages: PageSet = {}
        load: CacheLoad | None = None
        try:
            counts = match.load_counts()
            load_pages = self.allocate(counts)
            load = await self.cache.load(match, load_pages or None)
            hit = match.host_tokens
            placed = match.placements()  # the pages already on the device
            nexts = {p: iter(v) for p, v in load_pages.items()}
            kv: list[int] = []
            swa: dict[int, int] = {}
            state_from: int | None = None
            for i, (source, pools) in enumerate(zip(match.sources, match.needed, strict=True)):
                if source is Tier.HOST:
                    where = {p: next(nexts[p]) for p in sorted(pools, key=lambda p: p.value)}
                else:
                    where = placed[i]
                kv.append(where[KV])
                if SWA in where:
                    swa[i] = where[SWA]
                if MAMBA in pools:
                    state_from = where[MAMBA]
            rest = self._pages_for(computed) - len(kv)
            got = self.allocate({KV: rest, SWA: rest, MAMBA: 1})
            base = len(kv)
            kv.extend(got.get(KV, ()))
            swa.update({base + j: p for j, p in enumerate(got.get(SWA, ()))})
            seq = Sequence(kv, swa, got[MAMBA][0], len(kv) * self.page_size, state_from)
            own = {p: list(v) for p, v in got.items()}
            pages = computed // self.page_size
            bounds = self.cache.checkpoint_boundaries(pages, match)  # past the hit
            checkpoints: dict[int, int] = {}
            for b in (b * self.page_size for b in bounds):
                checkpoints[b] = self.new_slot()
                own.setdefault(MAMBA, []).append(checkpoints[b])
        except BaseException:
            with anyio.CancelScope(shield=True):
                self.free_pages(own)
                if load is not None and not load.finished:
                    await load.cancel()
                if load is None or not load.ok:
                    self.free_pages(load_pages)
                match.release()
            raise
        self._live.add(id(seq))
        return Request(
            tuple(tokens),
            match,
            load,
            seq,
            hit,
            load_pages,
            {p: tuple(v) for p, v in own.items()},
            checkpoints,
        )

    async def finish(self, req: Request, tokens: Seq[int]) -> None:
        """Insert what ``req`` computed (``tokens``: every position it ran) with its state
        checkpoints, free the pages that stay the framework's, release the match."""
        with anyio.CancelScope(shield=True):
            try:
                await req.load.wait()
                seq, ps = req.seq, self.page_size
                tail = self._pages_for(len(tokens))
                full = len(tokens) // ps
                result = await self.cache.insert(
                    list(tokens),
                    {KV: seq.kv[:tail], SWA: [seq.swa.get(i) for i in range(tail)]},
                    checkpoints={b // ps: {MAMBA: s} for b, s in req.checkpoints.items()},
                )
                kept = {KV: set(seq.kv[:full]), SWA: {seq.swa[i] for i in seq.swa if i < full}}
                kept[MAMBA] = {s for b, s in req.checkpoints.items() if b // ps <= full}
                for pool, ids in result.released.items():
                    kept.get(pool, set()).difference_update(ids)
                self.free_pages(
                    {p: [x for x in v if x not in kept.get(p, set())] for p, v in req.own.items()}
                )
            finally:
                req.match.release()
                self._live.discard(id(req.seq))

    async def abort(self, req: Request) -> None:
        """Give everything of a failed request back: cancel its load if it still runs (the face
        then returns its host pins), free the framework's pages (the load's too unless it
        finished: loaded pages belong to the cache), release the match."""
        with anyio.CancelScope(shield=True):
            try:
                if not req.load.finished:
                    await req.load.cancel()
                self.free_pages(req.own)
                if not req.load.ok:
                    self.free_pages(req.load_pages)
            finally:
                req.match.release()
                self._live.discard(id(req.seq))

    async def evict_all(self, tier: Tier) -> int:
        """Evict every unpinned page of ``tier``; device pages come back to the framework."""
        await self.cache.wait_idle()
        pages = self.cache.index.statistics().on_tier.of(tier)
        result = await self.cache.evict(tier, max(pages, 1))
        if tier is Tier.DEVICE:
            self.free_pages(result.freed)
        return result.evicted

    async def warm_host(self, tokens: Seq[int]) -> int:
        """Make the host hit of ``tokens`` as deep as the storage hint: prefetch what the host
        lacks (whole pages, or only the state checkpoints and window pages of pages whose KV is
        on host already); pages read."""
        return await self.prefetch(tokens)

    async def _match(self, tokens: Seq[int]) -> CacheMatch:
        """Match all but the last token (one is left to compute); tally the tiers it hit."""
        m = await self.cache.match(list(tokens[: len(tokens) - 1]))
        self.served[0] += m.device_tokens
        self.served[1] += m.host_tokens - m.device_tokens
        self.served[2] += m.storage_tokens - m.host_tokens
        return m

    async def prefetch(self, tokens: Seq[int]) -> int:
        """Storage -> host for ``tokens``' stored pages past the host hit; pages read."""
        async with await self._match(tokens) as m:
            if m.storage_pages <= m.host_pages:
                return 0
            result = await self.cache.prefetch(m)
        return result.read


__all__ = ["DemoServer", "Request", "Sequence", "demo_cache_settings", "demo_plan"]
