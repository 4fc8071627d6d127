"""The values of the cache face: its settings, what its calls return, its statistics.

- CacheSettings: write policies (device -> host, host -> storage), the state checkpoint policy,
  the sliding window (tokens), prefetch batch size and threshold, the storage tier's settings.
- InsertResult: what an insert registered and which device pages the cache did not keep.
- EvictResult: how many pages an eviction took and the page ids it gave back.
- PrefetchResult: pages asked for, read, and the host hit after the prefetch.
- CacheStatistics: a frozen snapshot: hits per tier (tokens and requests), bytes per direction,
  evictions per tier, store failures, the breaker's state, the index's counters.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

from hicache.domain.errors import ConfigError
from hicache.domain.hybrid import CheckpointPolicy
from hicache.domain.pools import PoolName
from hicache.domain.tiers import IndexStats, WriteSettings
from hicache.domain.validators import positive_int
from hicache.engine.storage_settings import StorageTierSettings, StorageTierStatistics


def _writes(value: object) -> WriteSettings:
    if isinstance(value, WriteSettings):
        return value
    if isinstance(value, Mapping):
        return WriteSettings(**value)
    raise ConfigError(f"writes must be WriteSettings or a mapping of its fields, got {value!r}")


def _checkpoints(value: object) -> CheckpointPolicy:
    if isinstance(value, CheckpointPolicy):
        return value
    if isinstance(value, Mapping):
        return CheckpointPolicy(**value)
    raise ConfigError(f"checkpoints must be a CheckpointPolicy or a mapping, got {value!r}")


def _tier_settings(_inst: object, _attr: object, value: StorageTierSettings | None) -> None:
    if value is not None and not isinstance(value, StorageTierSettings):
        raise ConfigError(
            f"storage must be StorageTierSettings or None, got {type(value).__name__}"
        )


def _window(_inst: object, _attr: object, value: int | None) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        raise ConfigError(f"sliding_window must be a positive number of tokens or None, got {value!r}")


@attrs.frozen(kw_only=True)
class CacheSettings:
    """How the cache face behaves. Every field is checked; a bad value is a ConfigError.

    ``writes``: when pages go down a tier (``WriteSettings``: host and storage policies; a
    storage policy of None with a store present means write_through). ``checkpoints``: which
    page boundaries keep a state checkpoint (hybrid state models). ``sliding_window``: tokens
    of a sliding-window pool (required when the plan has one; ``open_cache`` takes it from the
    model spec when given). ``prefetch_batch_pages``: pages per storage read batch.
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


@attrs.frozen(kw_only=True)
class PrefetchResult:
    """A prefetch: pages asked for from storage, pages read, the host hit afterwards (pages)."""

    requested: int
    read: int
    host_pages: int
    page_size: int
    skipped: str = ""

    @property
    def host_tokens(self) -> int:
        return self.host_pages * self.page_size


@attrs.frozen(kw_only=True)
class CacheStatistics:
    """A snapshot of the cache face. Hit tokens per tier count where the hit was served from:
    ``hit_tokens[0]`` already on device, ``[1]`` loaded from host, ``[2]`` found in storage
    (beyond the host hit, before a prefetch). ``hit_requests`` counts matches with any hit on
    that tier."""

    matches: int
    matched_tokens: int
    hit_tokens: tuple[int, int, int]
    hit_requests: tuple[int, int, int]
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
    evictions: tuple[int, int, int]
    breaker: str
    storage: StorageTierStatistics | None
    index: IndexStats

    def as_json(self) -> dict[str, object]:
        """A dict of plain values (json.dumps takes it): enums as their values."""
        out = attrs.asdict(self, recurse=False)
        out["index"] = attrs.asdict(self.index)
        if self.storage is not None:
            out["storage"] = attrs.asdict(self.storage, value_serializer=_plain)
        return out


def _plain(_inst: object, _field: object, value: object) -> object:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return dict(value)
    return value
