"""The cache face: what a serving framework calls to reuse prefixes across device, host, storage.

- HiCache(engine, settings=..., storage=None, ranks=SingleProcess()): opened with ``async
  with``; one owner (the event loop that opened it).
- match(token_ids): page keys of the full pages, the index's hit, extended by the storage
  tier's ``exists`` hint, cut to the boundary every pool can restore, agreed over TP ranks
  (minimum), pinned until released: a CacheMatch.
- load(match, device_pages=None): copies the host part of the hit to the device layer by layer
  (a CacheLoad with per-layer waits); registers the pages on the device tier when done, gives
  slots and pins back on failure or cancellation.
- insert(token_ids, device_pages, checkpoints=None): registers what a request computed;
  performs the write policies' backups (device -> host) and storage writes in the background.
- prefetch(match or token_ids): storage -> host in bounded batches before the deadline of the
  storage tier's prefetch policy; a hit is the leading run read.
- evict(tier, pages, pool=None): LRU eviction from DEVICE or HOST (write_back: copies first).
- statistics(), aclose(), checkpoint_boundaries(n_pages), device_placements(match),
  load_pools(match) (per page, the pools a load of the match copies).

Hybrid groups: a hit ends at a boundary where every pool restores (docs/cache.md); a page
partly on the device (e.g. its KV there, its state checkpoint only on host) is restorable: its
device copy stays pinned and ``load`` copies only the pools it lacks (cache_load.load_pools).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence
from types import TracebackType

import anyio
import anyio.abc

from hicache.domain.errors import CacheStateError, ConfigError, EngineClosedError
from hicache.domain.hybrid import GroupRules, Restore, needed_pages, usable_boundary
from hicache.domain.keys import chain_keys
from hicache.domain.pools import PoolName
from hicache.domain.prefix_index import PrefixIndex
from hicache.domain.tiers import Placement, Tier
from hicache.engine._ops import wait_until
from hicache.engine.cache_insert import insert_placements, pool_name
from hicache.engine.cache_load import completes, join_loads, load_pools, partial, settle_load
from hicache.engine.cache_match import CacheLoad, CacheMatch, MatchPins
from hicache.engine.cache_storage import CacheStorage, storage_boundary
from hicache.engine.cache_values import (
    CacheSettings,
    CacheStatistics,
    EvictResult,
    InsertResult,
    PrefetchResult,
)
from hicache.engine.cache_work import CacheWork, Counters, _split
from hicache.engine.engine import TransferEngine
from hicache.engine.logs import get_logger
from hicache.engine.ranks import RankAgreement, SingleProcess

log = get_logger("hicache.cache")


class HiCache:
    """The cache face over one transfer engine (see the module docstring and docs/cache-face.md)."""

    def __init__(
        self,
        engine: TransferEngine,
        *,
        settings: CacheSettings | None = None,
        storage: CacheStorage | None = None,
        ranks: RankAgreement | None = None,
    ) -> None:
        if not isinstance(engine, TransferEngine):
            raise ConfigError(f"engine must be a TransferEngine, got {type(engine).__name__}")
        settings = settings if settings is not None else CacheSettings()
        if not isinstance(settings, CacheSettings):
            raise ConfigError(f"settings must be CacheSettings, got {type(settings).__name__}")
        ranks = ranks if ranks is not None else SingleProcess()
        if not isinstance(ranks, RankAgreement):
            raise ConfigError(f"ranks must be a RankAgreement (agree_min), got {ranks!r}")
        if settings.writes.storage is not None and storage is None:
            raise ConfigError(
                f"writes.storage={settings.writes.storage.value!r} needs a storage tier: open "
                "the cache with a store, or set writes.storage=None"
            )
        plan = engine.plan
        self.plan = plan
        self.settings = settings
        self.rules = GroupRules.from_plan(plan, sliding_window=settings.sliding_window)
        self.page_size = self.rules.page_size
        self.index = PrefixIndex(self.rules, settings.writes)
        self.engine = engine
        self.storage = storage
        self.ranks = ranks
        self.counters = Counters()
        self.work = CacheWork(self.index, engine, storage, self.counters)
        self._owner = {
            r.pool: (self.rules.anchor if r.follows_anchor else r.pool) for r in self.rules.rules
        }
        self._checkpoint_pools = tuple(
            r.pool for r in self.rules.rules if r.restore is Restore.CHECKPOINT
        )
        self._window_pools = tuple(
            r.pool for r in self.rules.rules
            if r.restore is Restore.WINDOW and not r.follows_anchor
        )
        self._single_owner = len(self.rules.owners) == 1
        self._orphans: deque[MatchPins] = deque()
        self.loading: dict[bytes, CacheLoad] = {}  # page key -> the load bringing it to device
        self._loop_thread: int | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._state = "new"

    # ---- life cycle --------------------------------------------------------------------------
    async def __aenter__(self) -> HiCache:
        if self._state != "new":
            raise EngineClosedError("a HiCache is opened once; build a new one")
        if self.engine.closed:
            raise EngineClosedError(f"{self.engine!r} is closed: open the engine first")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        self.work.tg = tg
        self._loop_thread = threading.get_ident()
        self._state = "open"
        log.info("cache_opened", pools=[p.value for p in self.rules.names], store=self.storage
                 is not None)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Let background backups and storage writes finish, then close; idempotent.

        Background work settles its bookkeeping under a shielded scope; a cancelled close
        cancels it (each task still completes or aborts its index ticket).
        """
        tg, self._tg = self._tg, None
        if self._state == "closed" or tg is None:
            self._state = "closed"
            await anyio.lowlevel.checkpoint()
            return
        self._state = "closing"
        try:
            await tg.__aexit__(None, None, None)
        finally:
            self.work.tg = None
            self._state = "closed"
            self._drain_orphans()
            log.info("cache_closed", **self.statistics().as_json()["index"])  # type: ignore[arg-type]

    def _check_open(self, what: str) -> None:
        if self._state != "open":
            raise EngineClosedError(f"the cache is {self._state}: cannot {what}")
        self._drain_orphans()
        self.work.release_quarantine()

    # ---- pins of matches ---------------------------------------------------------------------
    def _orphaned(self, pins: MatchPins) -> None:
        # Called by a weakref finalizer (any thread): only queue; the loop releases.
        if not pins.released:
            self._orphans.append(pins)

    def _drain_orphans(self) -> None:
        while self._orphans:
            self.release_pins(self._orphans.popleft())

    def release_pins(self, pins: MatchPins) -> None:
        if pins.released:
            return
        if self._loop_thread is not None and threading.get_ident() != self._loop_thread:
            # Another thread (a synchronous scheduler calling match.release()): the index has
            # one owner, so queue it; the face releases it at its next call.
            self._orphans.append(pins)
            return
        pins.released = True
        dev, host = pins.device, pins.host
        pins.device, pins.host = [], []
        if dev:
            self.index.unpin(Tier.DEVICE, dev)
        if host:
            self.index.unpin(Tier.HOST, host)

    # ---- match -------------------------------------------------------------------------------
    def _boundary(self, n: int, at: Sequence[Placement | None],
                  fallback: Sequence[Placement | None] | None) -> int:
        owner = self._owner

        def has(pool: PoolName, i: int) -> bool:
            where = at[i]
            if where is not None and owner[pool] in where:
                return True
            if fallback is None:
                return False
            other = fallback[i]
            return other is not None and owner[pool] in other

        return usable_boundary(self.rules, n, has)

    def _needed(self, boundary: int) -> list[frozenset[PoolName]]:
        """The slot-owning pools page i must restore for a hit of ``boundary`` pages."""
        rules = self.rules
        base = frozenset(
            self._owner[r.pool] for r in rules.rules if r.restore is Restore.ALL_PAGES
        )
        out = [base] * boundary
        for r in rules.rules:
            if r.restore is not Restore.ALL_PAGES:
                for i in needed_pages(rules, r.pool, boundary):
                    out[i] = out[i] | {self._owner[r.pool]}
        return out

    async def _agree(
        self,
        keys: Sequence[bytes],
        stored: int,
        d: int,
        h: int,
        dev_at: Sequence[Placement | None],
        host_at: Sequence[Placement | None],
    ) -> tuple[int, ...]:
        """The storage hint, then (device, host, storage) agreed over the TP ranks."""
        s = max(h, stored)
        if self.storage is not None:
            s = await storage_boundary(self, keys, s)
        agreed = await self.ranks.agree_min((d, h, s))
        # A boundary another rank chose may not be restorable here (hybrid rules): cut it to
        # one that is and agree again, until two agreements in a row are equal (every rank
        # then stops at the same round, with a boundary every rank can restore). When every
        # pool restores all pages, any shorter prefix of a usable hit is usable: one round.
        while not self.rules.is_plain:
            nd = self._boundary(min(agreed[0], d), dev_at, None)
            nh = self._boundary(min(agreed[1], h), dev_at, host_at)
            ns = min(agreed[2], s)
            again = await self.ranks.agree_min((nd, nh, max(nh, ns)))
            if again == agreed:
                break
            agreed = again
        return agreed

    async def match(self, token_ids: Sequence[int]) -> CacheMatch:
        """The agreed, pinned hit of ``token_ids`` (see CacheMatch)."""
        self._check_open("match")
        keys = chain_keys(token_ids, self.page_size)
        m = self.index.match(keys)
        dev_at = [self.index.placement(Tier.DEVICE, k) for k in keys[: m.host_pages]]
        if self._single_owner:
            # Every placement holds the one owner: the index's boundaries are the loadable ones.
            host_at: list[Placement | None] = []
            d, h = m.device_pages, m.host_pages
        else:
            host_at = [self.index.placement(Tier.HOST, k) for k in keys[: m.host_pages]]
            d = self._boundary(m.device_pages, dev_at, None)
            h = self._boundary(m.host_pages, dev_at, host_at)
        # Pin what was read before any await: a concurrent eviction during the storage hint
        # or the TP agreement must not take pages this match is about to return.
        # A host copy is pinned where there is no device copy, and where it has pools the
        # device copy lacks (a load may complete the device copy from it).
        on_host = [
            dev_at[i] is None or completes(dev_at[i], host_at[i] if host_at else None)
            for i in range(h)
        ]
        sources = [Tier.DEVICE if dev_at[i] is not None else Tier.HOST for i in range(h)]
        dev_keys = [keys[i] for i in range(h) if sources[i] is Tier.DEVICE]
        host_keys = [keys[i] for i in range(h) if on_host[i]]
        self.index.pin(Tier.DEVICE, dev_keys)
        try:
            self.index.pin(Tier.HOST, host_keys)
        except BaseException:
            self.index.unpin(Tier.DEVICE, dev_keys)
            raise
        try:
            d, h, s = await self._agree(keys, m.storage_pages, d, h, dev_at, host_at)
        except BaseException:
            self.index.unpin(Tier.DEVICE, dev_keys)
            self.index.unpin(Tier.HOST, host_keys)
            raise
        # Keep the pins of the agreed hit only: a page partly on the device keeps both.
        needed = self._needed(h)
        to_load = [
            i < h and on_host[i] and partial(dev_at[i], needed[i]) for i in range(len(on_host))
        ]
        extra_dev = [keys[i] for i in range(h, len(sources)) if sources[i] is Tier.DEVICE]
        extra_host = [keys[i] for i in range(len(on_host)) if on_host[i] and not to_load[i]]
        self.index.unpin(Tier.DEVICE, extra_dev)
        self.index.unpin(Tier.HOST, extra_host)
        pins = MatchPins()
        pins.device = [keys[i] for i in range(h) if sources[i] is Tier.DEVICE]
        pins.host = [keys[i] for i in range(h) if to_load[i]]
        sources = [Tier.HOST if to_load[i] else Tier.DEVICE for i in range(h)]
        self._count_match(len(token_ids), d, h, s)
        return CacheMatch(
            self,
            keys=keys,
            tokens=len(token_ids),
            page_size=self.page_size,
            device_pages=d,
            host_pages=h,
            storage_pages=s,
            sources=sources,
            needed=needed,
            pins=pins,
            on_drop=self._orphaned,
        )

    def _count_match(self, tokens: int, d: int, h: int, s: int) -> None:
        c, ps = self.counters, self.page_size
        c.add("matches")
        c.add("matched_tokens", tokens)
        for i, n in enumerate((d, h - d, s - h)):
            c.add(f"hit_tokens_{i}", n * ps)
            c.add(f"hit_requests_{i}", int(n > 0))

    # ---- load --------------------------------------------------------------------------------
    async def load(
        self,
        match: CacheMatch,
        device_pages: Mapping[PoolName, Sequence[int]] | None = None,
        *,
        after: object | None = None,
    ) -> CacheLoad:
        """Copy the host part of ``match`` to the device (see CacheLoad); ``device_pages``:
        the pages to load into, per pool, in page order (``match.load_counts()`` of them;
        required when the framework owns device pages)."""
        self._check_open("load")
        if match.released:
            raise CacheStateError(f"{match!r} was released: match again")
        while True:
            await join_loads(self, match)
            todo = [i for i, s in enumerate(match.sources) if s is Tier.HOST]
            if not todo:
                load = CacheLoad(match, None)
                match.attach(load)
                return load
            pools = load_pools(self, match)
            counts = match.load_counts()
            if device_pages is not None:
                break
            if self.work.framework_device:
                want = {p.value: n for p, n in counts.items()}
                raise ConfigError(
                    "the framework owns device pages (device_ownership='framework'): pass "
                    f"device_pages with {want} pages"
                )
            ids = await self.work.allocate(Tier.DEVICE, counts)
            allocated = True
            # The allocation may have awaited an eviction: another request's load may have
            # brought (or started bringing) some of these pages meanwhile. Give the pages back
            # and join it rather than copy a page twice.
            arriving = any(self._arriving(match.keys[i], match.needed[i]) for i in todo)
            if not arriving and load_pools(self, match) == pools:
                break
            self.engine.free_device(ids)
        if device_pages is not None:
            got = {pool_name(p): list(v) for p, v in device_pages.items()}
            if {p: len(v) for p, v in got.items()} != counts:
                given = {p.value: len(v) for p, v in got.items()}
                want = {p.value: n for p, n in counts.items()}
                raise ConfigError(f"device_pages give {given} pages; this load needs {want}")
            ids, allocated = got, False
        # A page whose device copy lacks pools gets only those (a fill of that copy).
        wants = [sorted(pools[i], key=lambda p: p.value) for i in todo]
        dests = _split(counts, ids, wants)
        keys = [match.keys[i] for i in todo]
        # Registered before the engine is asked (an await): a concurrent load of the same
        # pages joins this one instead of finding them "on their way" with nobody to wait for.
        load = CacheLoad(match, None, starting=True)
        try:
            match.attach(load)
            ticket = self.index.prepare_load(keys, dests)
        except BaseException as e:
            if allocated:
                self.engine.free_device(ids)
            load.settle(e)
            raise
        host = {p: [ticket.sources[j][p] for j, w in enumerate(dests) if p in w] for p in counts}
        device = {p: [w[p] for w in dests if p in w] for p in counts}
        for key in ticket.keys:
            self.loading[key] = load
        try:
            handle = await self.engine.load(host, device, after=after)
        except BaseException as e:
            with anyio.CancelScope(shield=True):
                for key in ticket.keys:
                    if self.loading.get(key) is load:
                        del self.loading[key]
                acts = self.index.abort(ticket)
                self.work.free(f for f in acts.free if allocated or f.tier is not Tier.DEVICE)
                self.counters.add("loads_failed")
                load.settle(e)
            raise
        load.handle = handle
        match.pins.loading = True
        self.work.spawn(settle_load, self, load, handle, ticket, allocated)
        return load

    def _arriving(self, key: bytes, pools: frozenset[PoolName]) -> bool:
        """Whether a load is bringing ``key`` to the device or it is there with ``pools``."""
        where = self.index.placement(Tier.DEVICE, key)
        return key in self.loading or (where is not None and pools <= where.keys())

    async def wait_idle(self) -> None:
        """Return once no background work (backups, storage writes, load settling) runs."""
        await wait_until(lambda: self.work.busy == 0)

    def load_pools(self, match: CacheMatch) -> list[frozenset[PoolName]]:
        return load_pools(self, match)

    def device_placements(self, match: CacheMatch) -> list[dict[PoolName, int]]:
        out: list[dict[PoolName, int]] = []
        for key, pools in zip(match.keys, match.needed, strict=False):
            where = self.index.placement(Tier.DEVICE, key) or {}
            out.append({p: where[p] for p in pools if p in where})
        return out

    # ---- insert ------------------------------------------------------------------------------
    def checkpoint_boundaries(self, total_pages: int) -> list[int]:
        """The page boundaries at which the framework should keep a state checkpoint."""
        if not self._checkpoint_pools:
            return []
        return self.settings.checkpoints.boundaries(total_pages)

    async def insert(
        self,
        token_ids: Sequence[int],
        device_pages: Mapping[PoolName, Sequence[int | None]],
        *,
        checkpoints: Mapping[int, Mapping[PoolName, int]] | None = None,
    ) -> InsertResult:
        """Register a request's device pages: the anchor's id for every full page (a trailing
        partial page's id may follow and stays the framework's), a window pool's id or None per
        page, and ``checkpoints`` {boundary (pages): {state pool: slot}}. Checkpoints at
        boundaries the CheckpointPolicy does not keep are released, as are duplicates."""
        self._check_open("insert")
        keys = chain_keys(token_ids, self.page_size)
        n = len(keys)
        placements, released = insert_placements(
            self.rules,
            self.settings.checkpoints,
            len(token_ids),
            n,
            device_pages,
            checkpoints,
        )
        existing = [self.index.placement(Tier.DEVICE, k) for k in keys]
        acts = self.index.insert(keys, placements)
        same = {(p, pid) for e in existing if e for p, pid in e.items()}
        dropped = [f for f in acts.free if (f.pool, f.page) not in same]
        for f in dropped:
            released.setdefault(f.pool, []).append(f.page)
        if released and not self.work.framework_device:
            self.engine.free_device(released)
        self.counters.add("inserts")
        self.counters.add("inserted_pages", n)
        if acts.backup:
            await self.work.backup(acts.backup, wait=False)
        return InsertResult(
            pages=n,
            released={p: tuple(v) for p, v in released.items()},
            backups=len(acts.backup),
            freed_by_cache=not self.work.framework_device,
        )

    # ---- eviction ----------------------------------------------------------------------------
    async def evict(self, tier: Tier, pages: int, pool: PoolName | None = None) -> EvictResult:
        """Evict up to ``pages`` LRU unpinned pages of ``pool`` (the anchor: whole pages) from
        DEVICE or HOST. Under write_back the copy down a tier is waited for first."""
        self._check_open("evict")
        if not isinstance(tier, Tier) or tier is Tier.STORAGE:
            raise ConfigError(f"evict: tier must be Tier.DEVICE or Tier.HOST, got {tier!r}")
        acts = self.index.evict(tier, pages, pool)
        freed_host = [f for f in acts.free if f.tier is Tier.HOST]
        device = await self.work.perform(acts, wait=True)
        out: dict[PoolName, list[int]] = {}
        if tier is Tier.DEVICE:
            out = device
        else:
            for f in freed_host:
                out.setdefault(f.pool, []).append(f.page)
        return EvictResult(evicted=acts.evicted, freed={p: tuple(v) for p, v in out.items()})

    # ---- prefetch ----------------------------------------------------------------------------
    async def prefetch(
        self, target: CacheMatch | Sequence[int], *, deadline: float | None = None
    ) -> PrefetchResult:
        """Bring the stored part of a hit to host (see docs/cache-face.md, "Prefetch")."""
        from hicache.engine.cache_prefetch import prefetch

        self._check_open("prefetch")
        return await prefetch(self, target, deadline=deadline)

    # ---- statistics --------------------------------------------------------------------------
    def statistics(self) -> CacheStatistics:
        c = self.counters
        idx = self.index.statistics()
        storage = self.storage.statistics() if self.storage is not None else None
        breaker = self.storage.breaker if self.storage is not None else "none"
        return CacheStatistics(
            matches=c["matches"],
            matched_tokens=c["matched_tokens"],
            hit_tokens=(c["hit_tokens_0"], c["hit_tokens_1"], c["hit_tokens_2"]),
            hit_requests=(c["hit_requests_0"], c["hit_requests_1"], c["hit_requests_2"]),
            inserts=c["inserts"],
            inserted_pages=c["inserted_pages"],
            loads=c["loads"],
            loads_failed=c["loads_failed"],
            loaded_pages=c["loaded_pages"],
            backups=c["backups"],
            backups_failed=c["backups_failed"],
            backups_skipped=c["backups_skipped"],
            prefetches=c["prefetches"],
            prefetched_pages=c["prefetched_pages"],
            stored_pages=c["stored_pages"],
            store_failures=c["store_failures"],
            bytes_loaded=c["bytes_loaded"],
            bytes_backed_up=c["bytes_backed_up"],
            bytes_prefetched=c["bytes_prefetched"],
            bytes_stored=c["bytes_stored"],
            evictions=idx.evictions,
            breaker=breaker,
            storage=storage,
            index=idx,
        )

    def __repr__(self) -> str:
        return f"<HiCache {self._state}: {self.index!r}>"


__all__ = ["HiCache"]
