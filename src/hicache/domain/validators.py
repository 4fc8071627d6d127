"""attrs field validators shared by the domain's values; each raises ConfigError naming the field.

- positive_int: an int in [1, MAX_UNITS] (bool refused).
- optional_positive_int: None or such an int.
- nonneg_int: an int in [0, MAX_UNITS].
- is_int: an int that is not a bool.
- nonneg_seconds: a finite int or float >= 0 (bool refused).

MAX_UNITS (hicache.domain.limits, 2**40) is far above any real count of layers, heads, tokens or
slots; a larger value is refused before anything is sized from it.
"""

from __future__ import annotations

import math
from typing import Any

import attrs

from hicache.domain.errors import ConfigError
from hicache.domain.limits import MAX_UNITS


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    if is_int(value) and value.bit_length() > 64:  # type: ignore[attr-defined]
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"  # type: ignore[attr-defined]
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(
            f"{attribute.name} must be a finite number of seconds >= 0, got {value!r}"
        )
