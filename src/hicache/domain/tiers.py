"""The values the prefix index takes and returns: tiers, write policies, transfers and actions.

- Tier: DEVICE (L1), HOST (L2), STORAGE (L3).
- WritePolicy: write_through, write_through_selective, write_back (SGLang's
  ``--hicache-write-policy`` values and semantics).
- WriteSettings: the host (device -> host) and storage (host -> storage) write policies and the
  hit thresholds of the selective policy.
- Placement: where one page lives on one tier: page id per owning pool (sidecars use the
  anchor's id on device and host; on storage the ids are 0 and only membership counts).
- OpKind / Ticket: one prepared transfer (backup, load, prefetch, store) awaiting completion.
- PageOp: one page the caller should copy, with its source placement.
- Freed: one page id the caller must return to its allocator.
- Actions: what a call asks the caller to do (backups, stores, frees) and how many pages an
  eviction took.
- Match: device, host and storage hit lengths at the hybrid-consistent boundary.
- PerTier: one figure per tier, by name (``device``, ``host``, ``storage``); statistics use it
  instead of positional tuples.
- IndexStats: a frozen snapshot of the index's counters.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from hicache.domain.errors import ConfigError, shown
from hicache.domain.pools import PoolName
from hicache.domain.validators import positive_int


class Tier(enum.IntEnum):
    DEVICE = 0
    HOST = 1
    STORAGE = 2


class WritePolicy(enum.Enum):
    WRITE_THROUGH = "write_through"  # copy down on insert (threshold 1)
    WRITE_THROUGH_SELECTIVE = "write_through_selective"  # copy down after N hits
    WRITE_BACK = "write_back"  # copy down when evicted; the eviction waits for the copy

    @classmethod
    def parse(cls, value: str | WritePolicy) -> WritePolicy:
        if isinstance(value, WritePolicy):
            return value
        try:
            if not isinstance(value, str):
                raise ValueError(value)
            return cls(value.strip().lower())
        except ValueError:
            raise ConfigError(
                f"unknown write policy {shown(value)}: expected one of "
                f"{', '.join(m.value for m in cls)}"
            ) from None


def _policy(value: str | WritePolicy) -> WritePolicy:
    return WritePolicy.parse(value)


def _optional_policy(value: str | WritePolicy | None) -> WritePolicy | None:
    return None if value is None else WritePolicy.parse(value)


@attrs.frozen(kw_only=True)
class WriteSettings:
    """When pages are copied down a tier. ``storage=None``: no storage tier.

    SGLang (python/sglang/srt/mem_cache/hiradix_cache.py) backs a node up when its hit count
    reaches ``write_through_threshold``: 1 for write_through, 2 for write_through_selective;
    write_back never backs up on hits and instead backs up (and waits) on eviction.
    """

    host: WritePolicy = attrs.field(default=WritePolicy.WRITE_THROUGH, converter=_policy)
    storage: WritePolicy | None = attrs.field(default=None, converter=_optional_policy)
    host_hits: int = attrs.field(default=2, validator=positive_int)
    storage_hits: int = attrs.field(default=2, validator=positive_int)

    def threshold(self, tier: Tier) -> int | None:
        """Hits after which a page is copied down to ``tier`` (None: only on eviction/never)."""
        policy = self.host if tier is Tier.HOST else self.storage
        if policy is None or policy is WritePolicy.WRITE_BACK:
            return None
        if policy is WritePolicy.WRITE_THROUGH:
            return 1
        return self.host_hits if tier is Tier.HOST else self.storage_hits


Placement = Mapping[PoolName, int]


class OpKind(enum.Enum):
    BACKUP = "backup"  # device -> host
    LOAD = "load"  # host -> device
    PREFETCH = "prefetch"  # storage -> host
    STORE = "store"  # host -> storage

    @property
    def source(self) -> Tier:
        return _SOURCE[self]

    @property
    def dest(self) -> Tier:
        return _DEST[self]


_SOURCE = {
    OpKind.BACKUP: Tier.DEVICE,
    OpKind.LOAD: Tier.HOST,
    OpKind.PREFETCH: Tier.STORAGE,
    OpKind.STORE: Tier.HOST,
}
_DEST = {
    OpKind.BACKUP: Tier.HOST,
    OpKind.LOAD: Tier.DEVICE,
    OpKind.PREFETCH: Tier.HOST,
    OpKind.STORE: Tier.STORAGE,
}


@attrs.frozen
class Ticket:
    """A prepared transfer: its pages, their source placements and their destinations."""

    id: int
    kind: OpKind
    keys: tuple[bytes, ...]
    sources: tuple[Placement, ...]
    dests: tuple[Placement, ...]

    def __len__(self) -> int:
        return len(self.keys)


@attrs.frozen
class PageOp:
    """One page to copy down a tier, read from ``source`` (its placement on the source tier).

    ``source`` may be the index's own placement dict (the index never changes a placement in
    place, it replaces it): read it, do not change it.
    """

    key: bytes
    source: Placement


@attrs.frozen
class Freed:
    """A page id of ``pool`` on ``tier`` that the caller must return to its allocator."""

    tier: Tier
    pool: PoolName
    page: int


@attrs.frozen(kw_only=True)
class Actions:
    """What a call asks of the caller. Empty when nothing is to be done."""

    backup: tuple[PageOp, ...] = ()
    store: tuple[PageOp, ...] = ()
    free: tuple[Freed, ...] = ()
    evicted: int = 0

    def free_ids(self, tier: Tier, pool: PoolName) -> list[int]:
        return [f.page for f in self.free if f.tier is tier and f.pool is pool]

    def __bool__(self) -> bool:
        return bool(self.backup or self.store or self.free or self.evicted)


NO_ACTIONS = Actions()


@attrs.frozen(kw_only=True)
class Match:
    """How many leading pages each tier can restore at the hybrid-consistent boundary.

    Cumulative: ``host_pages`` counts pages restorable from device or host, ``storage_pages``
    from any tier, so device_pages <= host_pages <= storage_pages <= len(keys). ``keys``: the
    first ``storage_pages`` keys matched, a tuple (a KeyChain when the match was given one).
    """

    keys: Sequence[bytes]
    page_size: int
    device_pages: int
    host_pages: int
    storage_pages: int

    @property
    def device_tokens(self) -> int:
        return self.device_pages * self.page_size

    @property
    def host_tokens(self) -> int:
        return self.host_pages * self.page_size

    @property
    def storage_tokens(self) -> int:
        return self.storage_pages * self.page_size


@attrs.frozen(kw_only=True)
class PerTier:
    """One figure per tier, by name: ``stats.hit_tokens.host``, not ``stats.hit_tokens[1]``.

    ``of(tier)`` reads the figure of a ``Tier``; ``as_dict()`` gives ``{"device": .., "host":
    .., "storage": ..}`` for JSON; ``total`` is the sum.
    """

    device: int = 0
    host: int = 0
    storage: int = 0

    @classmethod
    def from_counts(cls, counts: Sequence[int]) -> PerTier:
        """From three counts in tier order (device, host, storage)."""
        if len(counts) != len(Tier):
            raise ConfigError(
                f"PerTier: expected 3 counts (device, host, storage), got {shown(counts)}"
            )
        return cls(device=counts[0], host=counts[1], storage=counts[2])

    def of(self, tier: Tier) -> int:
        if not isinstance(tier, Tier):
            raise ConfigError(f"PerTier.of: tier must be a Tier, got {shown(tier)}")
        return int(getattr(self, tier.name.lower()))

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "storage": self.storage}


@attrs.frozen(kw_only=True)
class IndexStats:
    """Counters of a prefix index at one moment: pages on each tier (a page on two tiers counts
    on both), pages pinned on each tier, transfers in flight, pages evicted from each tier."""

    pages: int
    on_tier: PerTier
    pinned: PerTier
    in_flight: int
    evictions: PerTier

    def as_dict(self) -> dict[str, object]:
        """Plain values for JSON: the per-tier figures as ``{"device": .., ...}``."""
        return {
            "pages": self.pages,
            "on_tier": self.on_tier.as_dict(),
            "pinned": self.pinned.as_dict(),
            "in_flight": self.in_flight,
            "evictions": self.evictions.as_dict(),
        }
