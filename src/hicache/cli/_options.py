"""Checks of command-line option values shared by the command modules.

- positive_option: an option's value as a positive int, or a ConfigError naming ``--name``.
- one_of: "one of a, b, c", how every option's fixed set of values is listed in its help.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from hicache.domain import ConfigError


def positive_option(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"--{name} must be a positive integer, got {value!r}")
    return value


def one_of(values: Iterable[object]) -> str:
    """The text "one of a, b, c" for the help of an option with a fixed set of values (enum members are
    shown by value), so every choice is listed the same way."""
    names = [str(v.value) if isinstance(v, enum.Enum) else str(v) for v in values]
    return "one of " + ", ".join(names)
