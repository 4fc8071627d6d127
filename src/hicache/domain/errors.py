"""Typed errors of hicache. Every error that hicache raises on purpose derives from HiCacheError.

- HiCacheError: the root; catch it to catch everything hicache reports.
- ConfigError: a setting, an extra config or a config file is malformed or names an unknown value.
- UnsupportedModelError: a model type or model configuration hicache cannot plan.
- LayoutError: a host layout that cannot be used with a pool kind or a storage backend.
- BindingError: a layer binding that is not injective or out of range.
- GroupError: a host group that breaks an invariant (anchors, names, page sizes).
- AllocatorMismatchError: pools of one group come from different host memory kinds.
- SizingError: a capacity, budget or memory check that cannot be satisfied.
- HostMemoryError / PinnedMemoryError: host memory could not be mapped, attached or pinned.
- SlotError / DoubleFreeError / ForeignIndexError / OutOfSlotsError: slot bookkeeping misuse.
- DeviceError: a device pool that cannot be allocated or does not match its plan.
- TransferError: a copy between tiers failed; it carries the context of the failed operation.
- StoreError: a storage tier failed.
- CacheStateError: a prefix-index call its state forbids (unknown page, duplicate transfer,
  unpin below zero, a ticket completed twice).
- EngineClosedError: an operation on an engine that was closed.
- shown(value): a value for an error message, bounded: nesting past a few levels, long
  containers and texts are cut, and an integer of more than 64 bits is described by its digits
  (so a message never recurses, never prints a 4000-digit number, and never raises).
"""

from __future__ import annotations

import reprlib

_REPR = reprlib.Repr()
_REPR.maxlevel = 4
_REPR.maxstring = 60
_REPR.maxother = 60
_REPR.maxlong = 40
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdeque = 16
_REPR.maxdict = 8


def shown(value: object, limit: int = 80) -> str:
    """``value`` for an error message, at most ``limit`` characters, never raising."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    try:
        text = _REPR.repr(value)
    except Exception:  # a __repr__ that raises, or one too deep for reprlib's own limits
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class HiCacheError(Exception):
    """Root of every error hicache raises on purpose."""


class ConfigError(HiCacheError, ValueError):
    """A setting or a config source is malformed or names an unknown value."""


class UnsupportedModelError(ConfigError):
    """The model type or the model's configuration cannot be planned."""


class LayoutError(ConfigError):
    """A host layout cannot be used with a pool kind or a storage backend."""


class BindingError(ConfigError):
    """A layer binding is not injective or refers to layers out of range."""


class GroupError(ConfigError):
    """A host group breaks one of its invariants."""


class AllocatorMismatchError(GroupError):
    """The pools offered for one host group come from different host memory kinds."""


class SizingError(ConfigError):
    """A capacity, a byte budget or a memory check cannot be satisfied."""


class HostMemoryError(HiCacheError, OSError):
    """Host memory could not be mapped, attached, registered or released."""


class PinnedMemoryError(HostMemoryError):
    """Page-locking (cudaHostRegister / hipHostRegister) was asked for and failed or is impossible."""


class SlotError(HiCacheError):
    """Slot bookkeeping was misused."""


class DoubleFreeError(SlotError):
    """A slot was freed that is already free."""


class ForeignIndexError(SlotError):
    """An index does not belong to the pool it was handed to."""


class OutOfSlotsError(SlotError):
    """Not enough free pages or slots to satisfy an allocation."""


class DeviceError(HiCacheError):
    """A device pool cannot be allocated or does not match its plan."""


class TransferError(HiCacheError):
    """A copy between device and host (or host and store) failed."""


class StoreError(HiCacheError):
    """A storage tier operation failed."""


class CacheStateError(HiCacheError):
    """A prefix-index call that the index's state forbids; nothing was changed."""


class EngineClosedError(HiCacheError):
    """The engine was closed before or during the operation."""
