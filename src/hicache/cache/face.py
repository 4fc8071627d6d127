"""The cache face: what a serving framework calls to reuse prefixes across device, host, storage.

- HiCache(engine, settings=..., storage=None, ranks=SingleProcess()): opened with ``async
  with``; one owner (the event loop that opened it).
- match(token_ids): page keys of the full pages, the index's hit, extended by the storage
  tier's ``exists`` hint, cut to the boundary every pool can restore, agreed over TP ranks
  (minimum), pinned until released: a CacheMatch (hicache.cache.hit).
- load(match, device_pages=None): copies the host part of the hit to the device layer by layer
  (a CacheLoad with per-layer waits); registers the pages on the device tier when done, gives
  slots and pins back on failure or cancellation (hicache.cache.load).
- insert(token_ids, device_pages, checkpoints=None): registers what a request computed;
  performs the write policies' backups (device -> host) and storage writes in the background
  (hicache.cache.insert checks the arguments; hicache.cache.work does the work).
- prefetch(match or token_ids): storage -> host in bounded batches before the deadline of the
  storage tier's prefetch policy; a hit is the leading run read (hicache.cache.prefetch).
- evict(tier, pages, pool=None): LRU eviction from DEVICE or HOST (write_back: copies first).
- statistics(), aclose(), checkpoint_boundaries(n_pages), device_placements(match),
  load_pools(match) (per page, the pools a load of the match copies).

Hybrid groups: a hit ends at a boundary where every pool restores (docs/cache.md); a page
partly on the device (e.g. its KV there, its state checkpoint only on host) is restorable: its
device copy stays pinned and ``load`` copies only the pools it lacks
(hicache.cache.load.load_pools).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Mapping, Sequence

import anyio
import anyio.abc

from hicache.cache import args as cache_args
from hicache.cache.hit import find_hit
from hicache.cache.insert import insert_placements
from hicache.cache.load import load_match, load_pools
from hicache.cache.match import CacheLoad, CacheMatch, MatchPins
from hicache.cache.prefetch import prefetch
from hicache.cache.rules import HitRules
from hicache.cache.storage import CacheStorage
from hicache.cache.values import (
    CacheSettings,
    CacheStatistics,
    EvictResult,
    InsertResult,
    PrefetchResult,
)
from hicache.cache.work import CacheWork, Counters
from hicache.domain.errors import CacheStateError, ConfigError, EngineClosedError
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue
from hicache.domain.hybrid import GroupRules, Restore
from hicache.domain.keys import key_chain
from hicache.domain.pools import PoolName
from hicache.domain.prefix_index import PrefixIndex
from hicache.domain.tiers import PerTier, Tier
from hicache.engine._ops import wait_until
from hicache.engine._scopes import innermost
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
        self.hits = HitRules(self.rules)
        self._checkpoint_pools = tuple(
            r.pool for r in self.rules.rules if r.restore is Restore.CHECKPOINT
        )
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
        log.info(
            "cache_opened",
            pools=[p.value for p in self.rules.names],
            store=self.storage is not None,
        )
        return self

    async def __aexit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
        try:
            await self.aclose()
        finally:
            tg, self._tg = self._tg, None
            if tg is not None:
                # Background work has finished (or was cancelled and settled): this only
                # leaves the group, here where ``async with`` entered it.
                await tg.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Let background backups and storage writes finish, then close; idempotent.

        Callable from any cancel scope: a cancelled close cancels the background tasks (each
        still completes or aborts its index ticket, shielded), waits for them to settle and
        re-raises the cancellation to the caller's scope. The face's task group is left here
        only when this is where ``async with`` entered it (hicache.engine._scopes); otherwise
        at the ``async with`` exit, so the task's cancel scopes stay in order.
        """
        if self._state in ("new", "closed"):
            self._state = "closed"
            await self._leave_group()
            await anyio.lowlevel.checkpoint()
            return
        if self._state == "closing":
            with anyio.CancelScope(shield=True):
                await wait_until(lambda: self._state == "closed")
            return
        self._state = "closing"
        try:
            await wait_until(lambda: self.work.busy == 0)
        except BaseException:
            self.work.cancel_all()
            with anyio.CancelScope(shield=True):
                await wait_until(lambda: self.work.busy == 0)
            raise
        finally:
            self.work.tg = None
            self._state = "closed"
            self._drain_orphans()
            log.info("cache_closed", **self.index.statistics().as_dict())
            await self._leave_group()  # not under a shield: that scope would be the innermost

    async def _leave_group(self) -> None:
        tg = self._tg
        if tg is not None and innermost(tg.cancel_scope):
            self._tg = None
            await tg.__aexit__(None, None, None)

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
    async def match(self, token_ids: Sequence[int]) -> CacheMatch:
        """The agreed, pinned hit of ``token_ids`` (see CacheMatch; hicache.cache.hit)."""
        self._check_open("match")
        return await find_hit(self, cache_args.token_ids(token_ids), self._orphaned)

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
        required when the framework owns device pages). hicache.cache.load."""
        self._check_open("load")
        self._own_match(match, "load")
        if device_pages is not None:
            cache_args.mapping(device_pages, "load: device_pages")
        if match.loading:
            raise CacheStateError(
                f"{match!r} is being loaded already: wait for (or cancel) that load"
            )
        match._calling = True  # from here: a second load of it is refused, not joined
        try:
            return await load_match(self, match, device_pages, after=after)
        finally:
            match._calling = False

    async def wait_idle(self) -> None:
        """Return once no background work (backups, storage writes, load settling) runs."""
        await wait_until(lambda: self.work.busy == 0)

    def _own_match(self, match: object, what: str) -> None:
        if not isinstance(match, CacheMatch):
            raise ConfigError(
                f"{what}: expected a CacheMatch from this cache's match(), got "
                f"{type(match).__name__}"
            )
        if match._cache is not self:
            raise ConfigError(f"{what}: {match!r} comes from another cache")

    def load_pools(self, match: CacheMatch) -> list[frozenset[PoolName]]:
        self._own_match(match, "load_pools")
        return load_pools(self, match)

    def device_placements(self, match: CacheMatch) -> list[dict[PoolName, int]]:
        self._own_match(match, "placements")
        out: list[dict[PoolName, int]] = []
        for key, pools in zip(match.keys, match.needed, strict=False):
            where = self.index.placement(Tier.DEVICE, key) or {}
            out.append({p: where[p] for p in pools if p in where})
        return out

    # ---- insert ------------------------------------------------------------------------------
    def checkpoint_boundaries(self, total_pages: int, hit: CacheMatch | int = 0) -> list[int]:
        """The page boundaries of a request of ``total_pages`` full pages at which the
        framework should keep a state checkpoint, past ``hit`` (the request's CacheMatch, whose
        ``host_pages`` the cache restores, or a page count): the state at a boundary the cache
        restored from is cached already, and the framework never computes one before it."""
        total = cache_args.count(total_pages, "checkpoint_boundaries: total_pages")
        if isinstance(hit, CacheMatch):
            self._own_match(hit, "checkpoint_boundaries")
            start = hit.host_pages
        else:
            start = cache_args.count(hit, "checkpoint_boundaries: hit (a CacheMatch or pages)")
        if not self._checkpoint_pools:
            return []
        return [b for b in self.settings.checkpoints.boundaries(total) if b > start]

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
        tokens = cache_args.token_ids(token_ids)
        keys = key_chain(tokens, self.page_size)
        n = len(keys)
        placements, released, named = insert_placements(
            self.rules,
            self.settings.checkpoints,
            len(tokens) // 4 if isinstance(tokens, bytes) else len(tokens),
            n,
            device_pages,
            checkpoints,
        )
        # Every id is checked before the index changes: a refused insert leaves nothing.
        cache_args.device_ids(
            self.engine.device_slots, named, allocated=not self.work.framework_device
        )
        acts = self.index.insert(keys, placements)
        # Ids the index gave back: the caller's own duplicates go back to the pool, unless the
        # id is the one the page already had (then the page still uses it). An insert only adds
        # placements, so the pages' device placements after it hold those ids as before it.
        dropped = list(acts.free)
        if dropped:
            same = {
                (p, pid)
                for e in self.index.placements(Tier.DEVICE, keys)
                if e
                for p, pid in e.items()
            }
            dropped = [f for f in dropped if (f.pool, f.page) not in same]
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
    async def evict(
        self, tier: Tier, pages: int, pool: PoolName | str | None = None
    ) -> EvictResult:
        """Evict up to ``pages`` LRU unpinned pages of ``pool`` (a PoolName or its text; None:
        the anchor, whole pages) from DEVICE or HOST. Under write_back the copy down a tier is
        waited for first."""
        self._check_open("evict")
        tier = cache_args.tier(tier)
        pages = cache_args.count(pages, "evict: pages")
        name = None if pool is None else cache_args.pool(pool, "evict: pool")
        acts = self.index.evict(tier, pages, name)
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
        self._check_open("prefetch")
        if isinstance(target, CacheMatch):
            self._own_match(target, "prefetch")
        else:
            target = cache_args.token_ids(target, "prefetch: target (a CacheMatch or token ids)")
        return await prefetch(self, target, deadline=cache_args.deadline(deadline))

    # ---- statistics --------------------------------------------------------------------------
    def statistics(self) -> CacheStatistics:
        c = _Snapshot(self.counters.snapshot())
        idx = self.index.statistics()
        storage = self.storage.statistics() if self.storage is not None else None
        breaker = self.storage.breaker if self.storage is not None else "none"
        return CacheStatistics(
            matches=c["matches"],
            matched_tokens=c["matched_tokens"],
            matched_pages=c["matched_pages"],
            hit_tokens=_per_tier(c, "hit_tokens"),
            hit_pages=_per_tier(c, "hit_pages"),
            hit_requests=_per_tier(c, "hit_requests"),
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
            bytes_by_pool=c.by_pool("bytes_"),
            evictions=idx.evictions,
            breaker=breaker,
            storage=storage,
            index=idx,
        )

    def __repr__(self) -> str:
        return f"<HiCache {self._state}: {self.index!r}>"


class _Snapshot(dict[str, int]):
    """The face's counters at one moment (missing: 0)."""

    def __missing__(self, name: str) -> int:
        return 0

    def by_pool(self, prefix: str) -> dict[str, dict[str, int]]:
        """``{"loaded": {"kv": ..}, ...}`` from the counters named ``<prefix><what>:<pool>``."""
        out: dict[str, dict[str, int]] = {}
        for name, n in self.items():
            if name.startswith(prefix) and ":" in name:
                what, pool = name[len(prefix) :].split(":", 1)
                out.setdefault(what, {})[pool] = n
        return out


def _per_tier(c: _Snapshot, name: str) -> PerTier:
    return PerTier(device=c[f"{name}_device"], host=c[f"{name}_host"], storage=c[f"{name}_storage"])


__all__ = ["HiCache"]
