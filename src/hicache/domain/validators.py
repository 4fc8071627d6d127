"""attrs field validators shared by the domain's values; each raises ConfigError naming the field.

- positive_int: an int in [1, MAX_UNITS] (bool refused).
- optional_positive_int: None or such an int.
- nonneg_int: an int in [0, MAX_UNITS].
- is_int: an int that is not a bool.
- nonneg_seconds: a finite int or float in [0, MAX_SECONDS] (1e6 s; bool refused).

MAX_UNITS (hicache.domain.limits, 2**40) is far above any real count of layers, heads, tokens or
slots; a larger value is refused before anything is sized from it.
"""

from __future__ import annotations

from typing import Any

import attrs

from hicache.domain.errors import ConfigError, shown
from hicache.domain.limits import MAX_UNITS, bounded_seconds


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    return shown(value)


def positive_int(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not is_int(value) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive integer, got {_short(value)}")
    if value > MAX_UNITS:
        raise ConfigError(f"{attribute.name} must be at most {MAX_UNITS}, got {_short(value)}")


def optional_positive_int(inst: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None:
        positive_int(inst, attribute, value)


def nonneg_int(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not is_int(value) or value < 0:
        raise ConfigError(f"{attribute.name} must be a non-negative integer, got {_short(value)}")
    if value > MAX_UNITS:
        raise ConfigError(f"{attribute.name} must be at most {MAX_UNITS}, got {_short(value)}")


def nonneg_seconds(_inst: object, attribute: attrs.Attribute[Any], value: object) -> None:
    bounded_seconds(value, attribute.name)
