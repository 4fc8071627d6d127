"""What the cache face's helpers read of the face: its parts, not the face itself.

- CacheParts: a MatchOwner with the rules, settings, index, engine, storage tiers,
  background work, counters, TP agreement, hit rules and loads in flight of one HiCache.
  ``find_hit`` (cache.hit), ``load_match`` (cache.load) and ``prefetch`` (cache.prefetch) take
  a CacheParts; HiCache is one (structurally), and the helpers never import
  hicache.cache.face, so the face's modules import one another in one direction only
  (tests/test_layering.py checks that no module of hicache imports itself through others).
"""

from __future__ import annotations

from typing import Protocol

from hicache.cache.match import CacheLoad, MatchOwner
from hicache.cache.rules import HitRules
from hicache.cache.storage import CacheStorage
from hicache.cache.values import CacheSettings
from hicache.cache.work import CacheWork, Counters
from hicache.domain.hybrid import GroupRules
from hicache.domain.prefix_index import PrefixIndex
from hicache.engine.engine import TransferEngine
from hicache.engine.ranks import RankAgreement


class CacheParts(MatchOwner, Protocol):
    """The parts of a HiCache its helper modules use (read-only views), and what a CacheMatch
    asks of its face (MatchOwner: ``find_hit`` hands the face to the match it makes)."""

    @property
    def rules(self) -> GroupRules: ...

    @property
    def page_size(self) -> int: ...

    @property
    def settings(self) -> CacheSettings: ...

    @property
    def index(self) -> PrefixIndex: ...

    @property
    def engine(self) -> TransferEngine: ...

    @property
    def storage(self) -> CacheStorage | None: ...

    @property
    def work(self) -> CacheWork: ...

    @property
    def counters(self) -> Counters: ...

    @property
    def ranks(self) -> RankAgreement: ...

    @property
    def hits(self) -> HitRules: ...

    @property
    def loading(self) -> dict[bytes, CacheLoad]:
        """Page key -> the load bringing it to the device."""
        ...


__all__ = ["CacheParts"]
