"""The error classes: one root, and the families the command line maps to exit statuses."""

from __future__ import annotations

import pytest

from hicache.domain import errors
from hicache.domain.errors import HiCacheError

# Bad input: ValueError, so `hicache` exits 2 for it.
BAD_INPUT = [
    errors.ConfigError,
    errors.UnsupportedModelError,
    errors.LayoutError,
    errors.BindingError,
    errors.GroupError,
    errors.AllocatorMismatchError,
    errors.SizingError,
]
# Runtime failures: `hicache` exits 1 for these.
RUNTIME = [
    errors.HostMemoryError,
    errors.PinnedMemoryError,
    errors.SlotError,
    errors.DoubleFreeError,
    errors.ForeignIndexError,
    errors.OutOfSlotsError,
    errors.DeviceError,
    errors.TransferError,
    errors.StoreError,
    errors.CacheStateError,
    errors.EngineClosedError,
]


def test_every_error_class_is_listed_here() -> None:
    defined = {
        v
        for v in vars(errors).values()
        if isinstance(v, type) and issubclass(v, Exception) and v is not HiCacheError
    }
    assert defined == set(BAD_INPUT) | set(RUNTIME)


@pytest.mark.parametrize("cls", BAD_INPUT)
def test_bad_input_errors_are_config_errors_and_value_errors(cls: type[Exception]) -> None:
    assert issubclass(cls, errors.ConfigError)
    assert issubclass(cls, ValueError)
    assert issubclass(cls, HiCacheError)


@pytest.mark.parametrize("cls", RUNTIME)
def test_runtime_errors_are_not_value_errors(cls: type[Exception]) -> None:
    assert issubclass(cls, HiCacheError)
    assert not issubclass(cls, ValueError)


def test_host_memory_errors_are_os_errors() -> None:
    assert issubclass(errors.PinnedMemoryError, OSError)
