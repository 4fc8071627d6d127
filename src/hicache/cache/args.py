"""The cache face's public edge: every argument a caller passes, checked before any state changes.

Each check raises one typed error (a HiCacheError) naming the argument, the value and what was
expected; nothing below the face sees a value of the wrong type or an invalid number.

- token_ids(value): a sized sequence of token ids (list, tuple, range, array) or packed bytes;
  None, an int, a string, a mapping, a set or a one-shot iterator (generator) are refused.
- mapping(value, what): a Mapping (page maps, checkpoints, device_pages of a load).
- pool(value, what): a PoolName from a PoolName or its text ("kv"), None passed through where
  allowed.
- tier(value): Tier.DEVICE or Tier.HOST (eviction).
- count(value, what): an int in [0, MAX_UNITS], never a bool, float, NaN or text.
- deadline(value): None or a finite number within +-MAX_DEADLINE (1e9: absolute seconds on the
  storage tier's monotonic clock; a later one could not be waited for).
- device_ids(engine, placements, checkpoints, tail): every device page id an insert names is an
  int in its pool's range, named once, and (engine-owned device pages) allocated; the messages
  name ``device_pages[pool]`` or ``checkpoints[boundary][pool]``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

from hicache.domain.errors import ConfigError, ForeignIndexError, SlotError, shown
from hicache.domain.limits import MAX_DEADLINE, MAX_UNITS, is_finite_number
from hicache.domain.pools import PoolName
from hicache.domain.slots import GroupAllocator
from hicache.domain.tiers import Tier


def _show(value: object) -> str:
    return shown(value)


def _kind(value: object) -> str:
    return f"{type(value).__name__} {_show(value)}"


def token_ids(value: object, what: str = "token_ids") -> Sequence[int] | bytes:
    """``value`` if it is packed bytes or a sized, indexable sequence of token ids."""
    if isinstance(value, bytes):
        return value
    if (
        value is None
        or isinstance(value, (str, bytearray, memoryview, Mapping))
        or not hasattr(value, "__len__")
        or not hasattr(value, "__getitem__")
    ):
        raise ConfigError(
            f"{what} must be a sequence of token ids (list, tuple, range, array) or packed "
            f"uint32 bytes, got {_kind(value)}"
        )
    return value  # type: ignore[return-value]


def mapping(value: object, what: str) -> Mapping[Any, Any]:
    """``value`` if it is a Mapping."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be a mapping, got {_kind(value)}")
    return value


def pool(value: object, what: str = "pool") -> PoolName:
    """A PoolName from a PoolName or its text; ConfigError naming ``what``."""
    if isinstance(value, PoolName):
        return value
    if isinstance(value, str):
        try:
            return PoolName(value.strip().lower())
        except ValueError:
            pass
    raise ConfigError(
        f"{what}: unknown pool {_show(value)}: expected one of {[p.value for p in PoolName]}"
    )


def tier(value: object) -> Tier:
    """Tier.DEVICE or Tier.HOST (what an eviction takes pages from)."""
    if isinstance(value, Tier) and value is not Tier.STORAGE:
        return value
    raise ConfigError(f"evict: tier must be Tier.DEVICE or Tier.HOST, got {_show(value)}")


def count(value: object, what: str) -> int:
    """An int in [0, MAX_UNITS]; bools, floats (NaN included) and text are refused."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{what} must be a non-negative integer, got {_kind(value)}")
    if not 0 <= value <= MAX_UNITS:
        raise ConfigError(f"{what} must be an integer in [0, {MAX_UNITS}], got {_show(value)}")
    return value


def deadline(value: object) -> float | None:
    """None or a finite number of seconds (absolute, the storage tier's monotonic clock)."""
    if value is None:
        return None
    if not is_finite_number(value) or abs(cast(float, value)) > MAX_DEADLINE:
        raise ConfigError(
            "deadline must be None or a finite number (absolute seconds, time.monotonic()) "
            f"within +-{MAX_DEADLINE:g}, got {_kind(value)}"
        )
    return float(cast(float, value))


def device_ids(
    slots: GroupAllocator,
    named: Iterable[tuple[str, PoolName, object]],
    *,
    allocated: bool,
) -> None:
    """Check every device page id an insert names, before anything changes.

    ``named``: (where, pool, id) with ``where`` the argument that named it, e.g.
    ``device_pages['kv'][3]`` or ``checkpoints[8]['mamba']``. An id must be an int in its
    pool's range (ForeignIndexError), named once (ConfigError: one page cannot hold two
    pages' bytes), and allocated when the engine owns device pages (SlotError: never
    allocated, or already freed).
    """
    seen: dict[tuple[PoolName, int], str] = {}
    for where, p, pid in named:
        allocator = slots.allocator(p)
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 <= pid < allocator.pages:
            raise ForeignIndexError(
                f"insert: {where} = {_show(pid)} is not a device page of pool {p.value!r} "
                f"(ids 0..{allocator.pages - 1})"
            )
        first = seen.get((p, pid))
        if first is not None:
            raise ConfigError(
                f"insert: {where} and {first} both name device page {pid} of pool "
                f"{p.value!r}: each page of a request needs its own device page"
            )
        seen[(p, pid)] = where
        if allocated and allocator.is_free(pid):
            raise SlotError(
                f"insert: {where} = {pid}: device page {pid} of pool {p.value!r} is free (never "
                "allocated, or already freed): pass pages the request holds"
            )


__all__ = ["count", "deadline", "device_ids", "mapping", "pool", "tier", "token_ids"]
