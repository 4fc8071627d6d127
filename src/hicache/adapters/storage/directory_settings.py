"""The settings of a DirectoryStore, from code or from a storage extra config.

- DirectorySettings: root, capacity cap, fsync, checksum, default timeout, stale temp age, I/O
  threads per get and per put; ``from_config`` parses a storage extra config (unknown keys are
  a ConfigError).

A bad value is a ConfigError that names the field and what was expected; nothing is rewritten.
Seconds (timeout_s, stale_tmp_s) are finite and at most MAX_SECONDS (1e6 s).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from hicache.adapters.storage.checksum import Checksum
from hicache.domain import ConfigError
from hicache.domain.errors import shown
from hicache.domain.limits import MAX_BYTES, bounded_seconds

_KEYS = (
    "root",
    "capacity_bytes",
    "fsync",
    "checksum",
    "timeout_s",
    "stale_tmp_s",
    "read_threads",
    "write_threads",
)
MAX_THREADS = 64
# Keys of a storage extra config that other readers own (host memory, plug-in dispatch).
_OTHERS = frozenset({"allocator", "backend_name", "module_path", "class_name"})


def _optional_positive(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is not None:
        bounded_seconds(value, f"directory store {attr.name}", positive=True)


def _optional_bytes(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= MAX_BYTES:
        raise ConfigError(
            f"directory store {attr.name} must be a whole number of bytes in [1, {MAX_BYTES}], "
            f"got {shown(value)}"
        )


def _non_negative(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    bounded_seconds(value, f"directory store {attr.name}")


def _bool(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"directory store {attr.name} must be true or false, got {shown(value)}")


def _threads(_inst: object, attr: attrs.Attribute[Any], value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_THREADS:
        raise ConfigError(
            f"directory store {attr.name} must be a whole number in [1, {MAX_THREADS}], "
            f"got {shown(value)}"
        )


def _root(value: object) -> Path | None:
    if value is None or isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"directory store root must be a non-empty path, got {shown(value)}")
    if "\x00" in value:
        raise ConfigError(f"directory store root {shown(value)} holds a NUL byte: not a path")
    return Path(value)


def _checksum(value: object) -> Checksum:
    return Checksum.parse(value)


@attrs.frozen(kw_only=True)
class DirectorySettings:
    """How a DirectoryStore behaves. ``root=None``: a fresh temporary directory, removed on close."""

    root: Path | None = attrs.field(default=None, converter=_root)
    capacity_bytes: int | None = attrs.field(default=None, validator=_optional_bytes)
    fsync: bool = attrs.field(default=False, validator=_bool)
    checksum: Checksum = attrs.field(default=Checksum.XXH3, converter=_checksum)
    timeout_s: float | None = attrs.field(default=None, validator=_optional_positive)
    stale_tmp_s: float = attrs.field(default=600.0, validator=_non_negative)
    # Threads a get (read_threads) or a put (write_threads) of several pages spreads them over,
    # the caller's thread counting as one. The payload I/O runs with the GIL released, so two
    # threads read on two cores; puts stay on one by default, because on the development VM
    # two writing threads measured no faster than one (docs/storage.md, "Measured").
    read_threads: int = attrs.field(default=2, validator=_threads)
    write_threads: int = attrs.field(default=1, validator=_threads)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DirectorySettings:
        unknown = sorted(shown(k) for k in config if k not in _KEYS and k not in _OTHERS)
        if unknown:
            raise ConfigError(
                f"directory store extra config has unknown keys [{', '.join(unknown)}]: "
                f"expected some of "
                f"{', '.join(_KEYS)}"
            )
        return cls(**{k: config[k] for k in _KEYS if k in config})
