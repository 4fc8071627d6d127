"""The values of the cache face: its settings, what its calls return, its statistics.

- CacheSettings: write policies (device -> host, host -> storage), the state checkpoint policy,
  the sliding window (tokens), prefetch batch size and threshold, the storage tier's settings.
- InsertResult: what an insert registered and which device pages the cache did not keep.
- EvictResult: how many pages an eviction took and the page ids it gave back.
- PrefetchResult: pages asked for, read, and the host hit after the prefetch; PrefetchSkip:
  why one did not start.
- CacheStatistics: a frozen snapshot: hits and misses per tier (PerTier: tokens, pages,
  requests), bytes per direction, evictions per tier, store failures, the breaker's state, the
  index's counters.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.domain.errors import ConfigError, shown
from hicache.domain.hybrid import CheckpointPolicy
from hicache.domain.pools import PoolName
from hicache.domain.tiers import IndexStats, PerTier, WriteSettings
from hicache.domain.validators import positive_int
from hicache.engine.storage_settings import StorageTierSettings, StorageTierStatistics


def _fields(cls: type, value: Mapping[Any, Any], what: str) -> dict[str, Any]:
    """``value`` as keyword arguments of ``cls``: text keys naming its fields, else ConfigError."""
    names = attrs.fields_dict(cls)
    for key in value:
        if not isinstance(key, str) or key not in names:
            raise ConfigError(
                f"{what}: unknown field {shown(key)}: expected some of {', '.join(names)}"
            )
    return dict(value)


def _writes(value: object) -> WriteSettings:
    if isinstance(value, WriteSettings):
        return value
    if isinstance(value, Mapping):
        return WriteSettings(**_fields(WriteSettings, value, "writes"))
    raise ConfigError(
        f"writes must be WriteSettings or a mapping of its fields, got {shown(value)}"
    )


def _checkpoints(value: object) -> CheckpointPolicy:
    if isinstance(value, CheckpointPolicy):
        return value
    if isinstance(value, Mapping):
        return CheckpointPolicy(**_fields(CheckpointPolicy, value, "checkpoints"))
    raise ConfigError(f"checkpoints must be a CheckpointPolicy or a mapping, got {shown(value)}")


def _tier_settings(_inst: object, _attr: object, value: StorageTierSettings | None) -> None:
    if value is not None and not isinstance(value, StorageTierSettings):
        raise ConfigError(
            f"storage must be StorageTierSettings or None, got {type(value).__name__}"
        )


def _window(_inst: object, _attr: object, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ConfigError(
            f"sliding_window must be a positive number of tokens or None, got {shown(value)}"
        )


@attrs.frozen(kw_only=True)
class CacheSettings:
    """How the cache face behaves. Every field is checked; a bad value is a ConfigError.

    ``writes``: when pages go down a tier (``WriteSettings``: host and storage policies; a
    storage policy of None with a store present means write_through). ``checkpoints``: which
    page boundaries keep a state checkpoint (hybrid state models). ``sliding_window``: tokens
    of a sliding-window pool: None takes the plan's (``plan_stack`` copies
    ``ModelSpec.sliding_window`` into it); needed only for a plan built without one, and one
    that differs from the plan's is a ConfigError naming both. ``prefetch_batch_pages``: pages per storage read batch.
    ``prefetch_min_pages``: a prefetch of fewer pages than this is not started (SGLang's
    ``prefetch_threshold``, 256 tokens by default, in pages). ``storage``: the storage tier's
    own settings (hicache.engine.storage_tier.StorageTierSettings: deadlines, prefetch policy,
    breaker), None for its defaults.
    """

    writes: WriteSettings = attrs.field(factory=WriteSettings, converter=_writes)
    checkpoints: CheckpointPolicy = attrs.field(factory=CheckpointPolicy, converter=_checkpoints)
    sliding_window: int | None = attrs.field(default=None, validator=_window)
    prefetch_batch_pages: int = attrs.field(default=64, validator=positive_int)
    prefetch_min_pages: int = attrs.field(default=1, validator=positive_int)
    storage: StorageTierSettings | None = attrs.field(default=None, validator=_tier_settings)


@attrs.frozen(kw_only=True)
class InsertResult:
    """What ``insert`` did: pages registered and device pages the cache does not keep.

    ``released`` are the request's device pages the cache did not take (duplicates of pages
    already cached, checkpoints at boundaries the policy does not keep). With
    ``device_ownership="engine"`` the face already returned them to the engine's allocator; with
    ``"framework"`` the framework frees them.
    """

    pages: int
    released: Mapping[PoolName, tuple[int, ...]]
    backups: int
    freed_by_cache: bool


@attrs.frozen(kw_only=True)
class EvictResult:
    """What ``evict`` did: pages evicted, and the page ids it freed per pool.

    Device ids: with ``device_ownership="framework"`` these are the framework's to reuse; with
    ``"engine"`` they are back in the engine's allocator already. Host ids are back in the host
    allocator.
    """

    evicted: int
    freed: Mapping[PoolName, tuple[int, ...]]


class PrefetchSkip(enum.Enum):
    """Why a prefetch did not start (``PrefetchResult.skipped``; None when it ran)."""

    NO_STORAGE = "no storage tier"
    TOO_FEW_PAGES = "fewer pages than prefetch_min_pages"


@attrs.frozen(kw_only=True)
class PrefetchResult:
    """A prefetch: pages asked for from storage, pages read, the host hit afterwards (pages);
    ``skipped``: why it did not start (a PrefetchSkip), None when it ran."""

    requested: int
    read: int
    host_pages: int
    page_size: int
    skipped: PrefetchSkip | None = None

    @property
    def host_tokens(self) -> int:
        return self.host_pages * self.page_size


@attrs.frozen(kw_only=True)
class CacheStatistics:
    """A snapshot of the cache face (safe to take from another thread, e.g. a metrics scrape).

    Per-tier figures are ``PerTier`` values (``stats.hit_tokens.host``). Hit tokens per tier
    count where the hit was served from: ``device`` already on device, ``host`` loaded from host
    (beyond the device hit), ``storage`` found in storage (beyond the host hit, before a
    prefetch); ``hit_pages`` the same in full pages. ``hit_requests`` counts matches with any
    hit on that tier. ``miss_tokens`` / ``miss_pages`` (derived) count, per tier, what a match
    looked for there and did not find there or above: the device misses are everything asked
    beyond the device hit, the host misses what the host did not add, the storage misses what
    no tier held (what the framework recomputes). So ``hit(t) + miss(t) == miss(t - 1)``.
    ``bytes_by_pool``: the ``bytes_*`` figures per pool, ``{"loaded": {"kv": .., "indexer":
    ..}, "backed_up": .., "prefetched": .., "stored": ..}`` (a sidecar's bytes under its own
    name; each direction sums to its total).
    """

    matches: int
    matched_tokens: int
    matched_pages: int
    hit_tokens: PerTier
    hit_pages: PerTier
    hit_requests: PerTier
    inserts: int
    inserted_pages: int
    loads: int
    loads_failed: int
    loaded_pages: int
    backups: int
    backups_failed: int
    backups_skipped: int
    prefetches: int
    prefetched_pages: int
    stored_pages: int
    store_failures: int
    bytes_loaded: int
    bytes_backed_up: int
    bytes_prefetched: int
    bytes_stored: int
    bytes_by_pool: Mapping[str, Mapping[str, int]]
    evictions: PerTier
    breaker: str
    storage: StorageTierStatistics | None
    index: IndexStats

    @property
    def miss_tokens(self) -> PerTier:
        return _misses(self.matched_tokens, self.hit_tokens)

    @property
    def miss_pages(self) -> PerTier:
        return _misses(self.matched_pages, self.hit_pages)

    def as_json(self) -> dict[str, object]:
        """A dict of plain values (json.dumps takes it): per-tier figures as ``{"device": ..,
        "host": .., "storage": ..}``, enums as their values."""
        out: dict[str, object] = {}
        for f in attrs.fields(CacheStatistics):
            value = getattr(self, f.name)
            out[f.name] = value.as_dict() if isinstance(value, PerTier) else value
        out["bytes_by_pool"] = {k: dict(v) for k, v in self.bytes_by_pool.items()}
        out["miss_tokens"] = self.miss_tokens.as_dict()
        out["miss_pages"] = self.miss_pages.as_dict()
        out["index"] = self.index.as_dict()
        if self.storage is not None:
            out["storage"] = attrs.asdict(self.storage, value_serializer=_plain)
        return out


def _misses(asked: int, hits: PerTier) -> PerTier:
    device = asked - hits.device
    host = device - hits.host
    return PerTier(device=device, host=host, storage=host - hits.storage)


def _plain(_inst: object, _field: object, value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return dict(value)
    return value
