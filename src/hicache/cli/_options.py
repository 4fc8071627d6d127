"""Checks of command-line option values shared by the command modules.

- positive_option: an option's value as a positive int, or a ConfigError naming ``--name``.
"""

from __future__ import annotations

from hicache.domain import ConfigError


def positive_option(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"--{name} must be a positive integer, got {value!r}")
    return value
