"""Checks of command-line option values shared by the command modules.

- count_option: an option's value as an int in [1, ceiling], or a ConfigError naming ``--name``
  and the ceiling (the CLI prints it and exits 2).
- positive_option: the same with the ceiling MAX_UNITS (kept for callers without a ceiling).
- The ceilings of the bench commands' counts (docs/reliability.md lists them): far above what a
  useful run needs, low enough that no value runs for hours or prints meaningless figures.
- one_of: "one of a, b, c", how every option's fixed set of values is listed in its help.
- comma_items: the items of a comma-separated option; an empty item ("1,,16", a trailing comma)
  or too many items is a ConfigError naming the option, never skipped.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

from hicache.domain import ConfigError
from hicache.domain.errors import shown
from hicache.domain.limits import MAX_UNITS

MAX_REPEATS = 1000  # rounds of a bench (medians are reported)
MAX_PAGE_SIZE = 1 << 16  # tokens per page (serving engines use 1..256)
MAX_BENCH_TOKENS = 1 << 24  # tokens of one bench request (16 Mi)
MAX_INDEX_PAGES = 10_000_000  # pages in a bench index (bench scale's --max-pages too)
MAX_STORAGE_PAGES = 1 << 16  # pages moved per bench storage round
MAX_SOAK_OPS = 10_000_000  # soak operations (about an hour on one core)
MAX_CONCURRENCY = 1024  # concurrent soak workers
MAX_SEED = (1 << 64) - 1


def count_option(name: str, value: object, ceiling: int) -> int:
    """``value`` as an int in [1, ceiling]; ConfigError naming ``--name`` otherwise."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"--{name} must be a positive integer, got {shown(value)}")
    if value > ceiling:
        raise ConfigError(f"--{name} must be at most {ceiling}, got {shown(value)}")
    return value


def positive_option(name: str, value: object) -> int:
    return count_option(name, value, MAX_UNITS)


def one_of(values: Iterable[object]) -> str:
    """The text "one of a, b, c" for the help of an option with a fixed set of values (enum members are
    shown by value), so every choice is listed the same way."""
    names = [str(v.value) if isinstance(v, enum.Enum) else str(v) for v in values]
    return "one of " + ", ".join(names)


def comma_items(flag: str, text: str, most: int = 64) -> list[str]:
    """The stripped items of ``text`` split at commas: at least one, at most ``most``, none
    empty (``"1,,16"`` is refused, not read as ``"1,16"``)."""
    items = [t.strip() for t in text.split(",")]
    if not text.strip() or any(not t for t in items):
        raise ConfigError(
            f"{flag} {shown(text)}: expected comma-separated values without an empty one"
        )
    if len(items) > most:
        raise ConfigError(f"{flag} {shown(text)}: expected at most {most} values")
    return items
