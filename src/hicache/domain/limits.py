"""Ceilings and strict readers for values that come from outside (config files, flags, JSON).

- MAX_LAYERS / MAX_DIM / MAX_UNITS / MAX_BYTES: the largest layer count, per-layer dimension,
  capacity in tokens or slots, and byte size hicache accepts; far above any real model or
  machine, low enough that nothing is allocated or looped over for an absurd value.
- MAX_DEPTH / MAX_NODES: the deepest nesting and the most values of a parsed config document.
- MAX_SECONDS: the longest duration (a deadline, timeout, grace or cooldown) a setting may give,
  1e6 s (about 11.6 days): finite, and far below what a thread wait or a clock can add.
- MAX_EVENT_SETS: the most event sets runtime.event_sets / open_runtime(event_sets=) keep.
- MAX_DEADLINE: the largest absolute deadline (time.monotonic() seconds) a call accepts, 1e9.
- is_finite_number: an int or float that converts to a finite float (never a bool; an integer
  of 400 digits is not, and asking never raises OverflowError).
- bounded_seconds: a number of seconds in [0, MAX_SECONDS] (or (0, ...] with positive=True).
- bounded_int: an int (never a bool, float or string) within [minimum, maximum], else ConfigError.
- config_int / optional_config_int: the same for one key of a config mapping, naming the key.
- config_flag: a JSON boolean (true/false), never a truthy string or number.
- parse_json: JSON text into Python values; nesting, Infinity/NaN, integers of more than
  MAX_INT_DIGITS digits and a key given twice in one object are ConfigErrors, never
  RecursionError, ValueError or last-one-wins.
- check_tree: a parsed document (JSON, TOML, YAML or a mapping from Python) walked without
  recursion: too deep, non-finite floats or integers beyond 64 bits are ConfigErrors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from hicache.domain.errors import ConfigError, shown

MAX_LAYERS = 1 << 16  # the largest real models have a few hundred layers
MAX_DIM = 1 << 24  # heads, head dims, ranks, kernels, hidden sizes
MAX_UNITS = 1 << 40  # tokens, slots, windows: ~1.1e12
MAX_BYTES = 1 << 60  # 1 EiB
MAX_DEPTH = 64
MAX_INT_DIGITS = 30
MAX_NODES = 1_000_000
MAX_SECONDS = 1e6  # about 11.6 days; any longer deadline or timeout is a mistake
# An absolute deadline (time.monotonic() seconds, counted from boot) past 1e9 s (31 years)
# cannot be waited for: a thread wait ends near 9.2e9 s.
MAX_DEADLINE = 1e9
MAX_EVENT_SETS = 1024  # finished per-layer event sets an engine keeps for reuse per size
_INT64 = 1 << 63


def bounded_int(value: object, what: str, *, minimum: int = 1, maximum: int = MAX_DIM) -> int:
    """``value`` if it is an int in [minimum, maximum]; a bool, float or string is refused."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{what} must be an integer, got {_show(value)}")
    if value < minimum:
        raise ConfigError(f"{what} must be at least {minimum}, got {_show(value)}")
    if value > maximum:
        raise ConfigError(f"{what} must be at most {maximum}, got {_show(value)}")
    return value


def config_int(
    config: Mapping[str, Any], key: str, *, minimum: int = 1, maximum: int = MAX_DIM
) -> int:
    """The integer at ``config[key]`` (missing -> ConfigError naming the key)."""
    if key not in config:
        raise ConfigError(f"config is missing key {key!r}")
    return bounded_int(config[key], f"config key {key!r}", minimum=minimum, maximum=maximum)


def optional_config_int(
    config: Mapping[str, Any], key: str, *, minimum: int = 1, maximum: int = MAX_DIM
) -> int | None:
    """None when ``key`` is absent or null; else the integer it holds (0 is no "unset")."""
    value = config.get(key)
    if value is None:
        return None
    return bounded_int(value, f"config key {key!r}", minimum=minimum, maximum=maximum)


def config_flag(config: Mapping[str, Any], key: str, default: bool = False) -> bool:
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(f"config key {key!r} must be true or false, got {_show(value)}")
    return value


def _show(value: object) -> str:
    """A value for a message, cut short (errors.shown: bounded depth, length and digits)."""
    return shown(value)


def is_finite_number(value: object) -> bool:
    """True for an int or float that is a finite float (a bool is not a number here)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, int):
        return value.bit_length() <= 1023  # float(value) would raise OverflowError beyond
    return math.isfinite(value)


def bounded_seconds(
    value: object, what: str, *, positive: bool = False, maximum: float = MAX_SECONDS
) -> float:
    """``value`` as a float number of seconds in [0, maximum] ((0, maximum] when ``positive``);
    a bool, a string, NaN, an infinity or a huge integer is a ConfigError naming ``what``."""
    lowest = "> 0" if positive else ">= 0"
    if not is_finite_number(value) or value > maximum:  # type: ignore[operator]
        raise ConfigError(
            f"{what} must be a finite number of seconds {lowest} and at most {maximum:g}, "
            f"got {_show(value)}"
        )
    if value < 0 or (positive and value == 0):  # type: ignore[operator]
        raise ConfigError(f"{what} must be a number of seconds {lowest}, got {_show(value)}")
    return float(value)  # type: ignore[arg-type]


def _parse_int(text: str) -> int:
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise ConfigError(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} accepted)")
    return int(text)


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ConfigError(f"the number {text[:40]} is out of range (not a finite float)")
    return value


def _parse_constant(text: str) -> float:
    raise ConfigError(f"{text} is not a number hicache accepts (JSON has no Infinity or NaN)")


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"key {shown(key)} is given twice in one object (keep one)")
        out[key] = value
    return out


def parse_json(text: str, what: str) -> Any:
    """Parse JSON text; every failure is a ConfigError that names ``what``. A key given twice in
    one object is refused (never last-one-wins)."""
    try:
        data = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
            object_pairs_hook=_unique_pairs,
        )
    except ConfigError as e:
        raise ConfigError(f"{what}: {e}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what} is not valid JSON ({e.msg} at {e.pos})") from None
    except RecursionError:
        raise ConfigError(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)") from None
    except ValueError as e:
        raise ConfigError(f"{what} is not valid JSON ({e})") from None
    check_tree(data, what)
    return data


def check_tree(data: object, what: str) -> None:
    """Refuse a document nested deeper than MAX_DEPTH, or holding inf/NaN or huge integers."""
    stack: list[tuple[object, int]] = [(data, 0)]
    seen = 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:  # YAML aliases can expand a small file into billions of nodes
            raise ConfigError(f"{what} holds more than {MAX_NODES} values")
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"{what} holds {item}, not a finite number")
        if isinstance(item, int) and not isinstance(item, bool) and not -_INT64 <= item < _INT64:
            raise ConfigError(f"{what} holds {_show(item)}, beyond a 64-bit integer")
        children: list[object]
        if isinstance(item, Mapping):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple, set, frozenset)):
            children = list(item)
        else:
            continue
        if depth >= MAX_DEPTH:
            raise ConfigError(f"{what} is nested too deeply (at most {MAX_DEPTH} levels)")
        stack.extend((c, depth + 1) for c in children)
