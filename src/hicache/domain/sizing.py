"""Host capacity sizing.

- RatioSizing: host capacity = device capacity x ratio (floored to whole pages).
- BudgetSizing: a byte budget per rank for the whole group, split over the pools in proportion to
  their device bytes; the total never exceeds the budget.
- parse_size: "64GiB", "500MB", "1.5G", "1048576" -> bytes.
- ratio_capacity / split_budget: the two pure computations behind them.
- check_host_memory: a plan against the host memory available, minus a reserve, over the ranks
  that share the host.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction

import attrs

from hicache.domain.errors import ConfigError, SizingError, shown
from hicache.domain.limits import MAX_BYTES, MAX_UNITS, is_finite_number

GiB = 1 << 30
MAX_RATIO = 1e6  # host capacity at most a million times the device's
DEFAULT_RESERVE_BYTES = 10 * GiB

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}


def parse_size(text: str | int) -> int:
    """Parse a byte size such as "64GiB", "500MB" or 1048576 into bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ConfigError(f"size must be positive, got {shown(text)}")
        if text > MAX_BYTES:
            raise ConfigError(
                f"size {shown(text)} is above the largest accepted, {MAX_BYTES} B (1 EiB)"
            )
        return text
    if not isinstance(text, str):
        raise ConfigError(f"size must be a string such as '64GiB' or an int, got {shown(text)}")
    if len(text) > 40:
        raise ConfigError(f"cannot read size {text[:40]!r}...: longer than 40 characters")
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ConfigError(
            f"cannot read size {shown(text)}: expected a number with an optional unit "
            f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 64GiB"
        )
    value = int(Fraction(m.group(1)) * _UNITS[unit])  # exact: no float rounding or overflow
    if value <= 0:
        raise ConfigError(f"size must be positive, got {shown(text)}")
    if value > MAX_BYTES:
        raise ConfigError(
            f"size {shown(text)} is above the largest accepted, {MAX_BYTES} B (1 EiB)"
        )
    return value


def _positive_ratio(_inst: object, _attr: object, value: float) -> None:
    if not is_finite_number(value) or value <= 0:
        raise ConfigError(f"host ratio must be a positive number, got {shown(value)}")
    if value > MAX_RATIO:
        raise ConfigError(f"host ratio must be at most {MAX_RATIO}, got {shown(value)}")


def _positive_bytes(_inst: object, _attr: object, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"host budget must be a positive number of bytes, got {shown(value)}")
    if value > MAX_BYTES:
        raise ConfigError(f"host budget must be at most {MAX_BYTES} B (1 EiB), got {shown(value)}")


@attrs.frozen
class RatioSizing:
    """Host capacity = device capacity x ratio."""

    ratio: float = attrs.field(default=2.0, validator=_positive_ratio)


@attrs.frozen
class BudgetSizing:
    """One byte budget per rank for the whole group."""

    bytes_per_rank: int = attrs.field(validator=_positive_bytes)


Sizing = RatioSizing | BudgetSizing


def ratio_capacity(device_units: int, ratio: float, page_size: int) -> int:
    """Host units for ``device_units`` x ``ratio``, floored to whole pages (at least one page)."""
    if device_units <= 0:
        raise SizingError(f"device capacity must be positive, got {device_units}")
    pages = math.floor(Fraction(device_units) * Fraction(ratio) / page_size)
    if pages * page_size > MAX_UNITS:
        raise SizingError(
            f"{device_units} device units x ratio {ratio} is {pages * page_size} units, above the "
            f"largest capacity accepted ({MAX_UNITS})"
        )
    if pages < 1:
        raise SizingError(
            f"{device_units} device units x ratio {ratio} is less than one page of {page_size}"
        )
    return pages * page_size


@attrs.frozen
class Demand:
    """One share of a budget split: device bytes weigh it, bytes per page quantise it."""

    key: str
    device_bytes: int
    bytes_per_page: int


def split_budget(budget: int, demands: Sequence[Demand]) -> dict[str, int]:
    """Pages per demand: proportional to device bytes, whole pages, total within ``budget``.

    Each share gets floor(budget x w_i / W / bytes_per_page_i) pages, so every share is within one
    page of its exact proportion and the sum never exceeds the budget.
    """
    if budget <= 0:
        raise SizingError(f"budget must be positive, got {budget}")
    total_weight = sum(d.device_bytes for d in demands)
    if total_weight <= 0:
        raise SizingError("no pool has device bytes to weigh the budget split")
    out: dict[str, int] = {}
    for d in demands:
        if d.bytes_per_page <= 0:
            raise SizingError(f"pool {shown(d.key)} has no bytes per page")
        # Integer arithmetic: floor(budget * w / (W * bpp)) exactly.
        pages = (budget * d.device_bytes) // (total_weight * d.bytes_per_page)
        if pages < 1:
            raise SizingError(
                f"budget {budget} B leaves pool {shown(d.key)} less than one page "
                f"({d.bytes_per_page} B); raise the budget or give {shown(d.key)} an override"
            )
        out[d.key] = pages
    return out


def check_host_memory(
    plan_bytes: int,
    available_bytes: int,
    *,
    reserve_bytes: int = DEFAULT_RESERVE_BYTES,
    ranks_on_host: int = 1,
) -> None:
    """Raise SizingError when ``ranks_on_host`` plans of ``plan_bytes`` do not fit the host."""
    for name, value in (
        ("plan_bytes", plan_bytes),
        ("available_bytes", available_bytes),
        ("reserve_bytes", reserve_bytes),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ConfigError(f"{name} must be a non-negative integer, got {shown(value)}")
    if not isinstance(ranks_on_host, int) or isinstance(ranks_on_host, bool) or ranks_on_host < 1:
        raise ConfigError(f"ranks_on_host must be at least 1, got {ranks_on_host}")
    usable = available_bytes - reserve_bytes
    needed = plan_bytes * ranks_on_host
    if needed > usable:
        raise SizingError(
            f"host plan needs {needed} B ({ranks_on_host} rank(s) x {plan_bytes} B) but only "
            f"{max(usable, 0)} B are usable ({available_bytes} B available - {reserve_bytes} B "
            f"reserve)"
        )


def check_overrides(overrides: Mapping[str, int], page_sizes: Mapping[str, int]) -> None:
    for name, units in overrides.items():
        if name not in page_sizes:
            raise ConfigError(
                f"capacity override names pool {shown(name)}, which this plan does not have "
                f"(pools: {sorted(page_sizes)})"
            )
        if units <= 0 or units > MAX_UNITS or units % page_sizes[name]:
            raise ConfigError(
                f"capacity override for {shown(name)} must be a positive whole number of pages of "
                f"{page_sizes[name]}, got {units} (at most {MAX_UNITS})"
            )
