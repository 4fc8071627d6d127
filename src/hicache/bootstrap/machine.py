"""What this machine can hold, asked before anything large is allocated.

- available_memory_bytes: the host memory the kernel says a new allocation can get
  (MemAvailable in /proc/meminfo; physical pages available elsewhere; None when unknown).
- check_fits: raise SizingError naming what, how many bytes it needs and the machine's limit,
  when ``nbytes`` exceed what is available (minus a small margin); a no-op when unknown.
- check_count: a loop count (repeats, rounds) within a ceiling, else ConfigError naming both.
"""

from __future__ import annotations

import os

from hicache.domain import ConfigError, SizingError

HEADROOM = 0.9  # never plan to take the last 10% of what the kernel reports available


def available_memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def check_fits(nbytes: int, what: str) -> None:
    """SizingError when ``nbytes`` (what ``what`` would allocate) exceed available memory."""
    available = available_memory_bytes()
    if available is None:
        return
    limit = int(available * HEADROOM)
    if nbytes > limit:
        raise SizingError(
            f"{what} needs {nbytes} B of host memory but this machine has {available} B "
            f"available (limit {limit} B); choose smaller sizes"
        )


def check_count(value: object, flag: str, ceiling: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{flag} must be a positive integer, got {value!r}")
    if value > ceiling:
        raise ConfigError(f"{flag} must be at most {ceiling}, got {value}")
    return value
