"""attrs field validators shared by the domain's values; each raises ConfigError naming the field.

- positive_int: an int > 0 (bool refused).
- optional_positive_int: None or an int > 0.
- nonneg_int: an int >= 0.
- is_int: an int that is not a bool.
"""

from __future__ import annotations

from typing import Any

import attrs

from hicache.domain.errors import ConfigError


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not is_int(value) or value <= 0:
        raise ConfigError(f"{attribute.name} must be a positive integer, got {value!r}")


def optional_positive_int(inst: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None:
        positive_int(inst, attribute, value)


def nonneg_int(_inst: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not is_int(value) or value < 0:
        raise ConfigError(f"{attribute.name} must be a non-negative integer, got {value!r}")
