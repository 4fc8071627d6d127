"""Settings and statistics of the storage tier (hicache.engine.storage_tier), torch-free.

- PrefetchPolicy: best_effort / wait_complete / timeout (SGLang's prefetch stop policy names).
- StorageTierSettings: the policy and its timeout formula, batch size, concurrency, per-call
  deadline, background write queue and breaker settings (validated; ConfigError names a field).
- prefetch_deadline: the deadline a prefetch of ``tokens`` tokens gets under a policy.
- StorageTierStatistics: a frozen snapshot of what the tier did.

The names and the timeout formula are SGLang's: ``hicache_storage_prefetch_policy`` in
python/sglang/srt/mem_cache/hiradix_cache.py (``can_terminate_prefetch``,
``_prefetch_timeout_check_linear_func``: timeout = min(max, base + per_ki_token x tokens / 1024)),
the three numbers read from the storage backend's extra config (``prefetch_timeout_base``,
``prefetch_timeout_per_ki_token``, ``prefetch_timeout_max``) in
python/sglang/srt/managers/cache_controller.py.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.domain.breaker import BreakerSnapshot
from hicache.domain.errors import ConfigError, shown
from hicache.domain.limits import bounded_seconds
from hicache.domain.validators import nonneg_seconds, positive_int


class PrefetchPolicy(enum.Enum):
    BEST_EFFORT = "best_effort"  # take what is read by the time the request is scheduled
    WAIT_COMPLETE = "wait_complete"  # wait until every page answered
    TIMEOUT = "timeout"  # wait up to min(max, base + per_ki_token x tokens / 1024) seconds

    @classmethod
    def parse(cls, value: str | PrefetchPolicy) -> PrefetchPolicy:
        if isinstance(value, PrefetchPolicy):
            return value
        try:
            if not isinstance(value, str):  # an enum lookup would repr it (deep: RecursionError)
                raise ValueError(value)
            return cls(value)
        except ValueError:
            raise ConfigError(
                f"prefetch policy {shown(value)}: expected one of {', '.join(m.value for m in cls)}"
            ) from None


def _policy(value: str | PrefetchPolicy) -> PrefetchPolicy:
    return PrefetchPolicy.parse(value)


def _positive_seconds(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    bounded_seconds(value, attribute.name, positive=True)


@attrs.frozen(kw_only=True)
class StorageTierSettings:
    """How the storage tier calls its store. Every field is checked; a bad one is a ConfigError.
    Every number of seconds is finite and at most MAX_SECONDS (hicache.domain.limits, 1e6 s)."""

    prefetch_policy: PrefetchPolicy = attrs.field(default=PrefetchPolicy.TIMEOUT, converter=_policy)
    timeout_base_s: float = attrs.field(default=2.0, validator=nonneg_seconds)
    timeout_per_ki_token_s: float = attrs.field(default=0.1, validator=nonneg_seconds)
    timeout_max_s: float = attrs.field(default=30.0, validator=nonneg_seconds)
    batch_pages: int = attrs.field(default=32, validator=positive_int)  # pages per store call
    max_concurrency: int = attrs.field(default=4, validator=positive_int)  # store calls at once
    call_deadline_s: float = attrs.field(default=5.0, validator=_positive_seconds)
    write_queue: int = attrs.field(default=256, validator=positive_int)  # background writes
    breaker_threshold: int = attrs.field(default=5, validator=positive_int)
    breaker_cooldown_s: float = attrs.field(default=10.0, validator=nonneg_seconds)

    def __attrs_post_init__(self) -> None:
        if self.timeout_max_s < self.timeout_base_s:
            raise ConfigError(
                f"timeout_max_s {shown(self.timeout_max_s)} is below timeout_base_s "
                f"{shown(self.timeout_base_s)}: expected max >= base"
            )


def prefetch_deadline(settings: StorageTierSettings, tokens: int, now: float) -> float | None:
    """The absolute deadline of a prefetch of ``tokens`` tokens started at ``now``.

    wait_complete: None (no deadline; each store call is still bounded by call_deadline_s).
    best_effort: ``now``: nothing is waited for; the caller takes what was read by the time it
    asks (a read given this deadline issues no store call).
    timeout: now + min(max, base + per_ki_token x tokens / 1024).
    """
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
        raise ConfigError(f"tokens {tokens!r}: expected a non-negative integer")
    policy = settings.prefetch_policy
    if policy is PrefetchPolicy.WAIT_COMPLETE:
        return None
    if policy is PrefetchPolicy.BEST_EFFORT:
        return now
    linear = settings.timeout_base_s + settings.timeout_per_ki_token_s * tokens / 1024
    return now + min(settings.timeout_max_s, linear)


@attrs.frozen(kw_only=True)
class StorageTierStatistics:
    """What the storage tier did since it was built (a snapshot)."""

    pages_read_ok: int
    pages_read_failed: int
    pages_written_ok: int
    pages_written_failed: int
    bytes_read: int
    bytes_written: int
    calls: Mapping[str, int]  # store calls made, per operation (exists, get, put, remove, health)
    failed_calls: int  # calls that raised or answered TRANSIENT/FATAL for some key
    refused_calls: int  # calls the open breaker refused (the store was not called)
    statuses: Mapping[str, int]  # non-OK key statuses seen (get and put), by status value
    writes_dropped: int  # background writes refused because the queue was full
    writes_pending: int  # background writes queued or running
    store_seconds: float  # wall time spent inside store calls (summed over threads)
    breaker: BreakerSnapshot
    buffers_safe: bool
