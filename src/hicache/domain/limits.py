"""Ceilings and strict readers for values that come from outside (config files, flags, JSON).

- MAX_LAYERS / MAX_DIM / MAX_UNITS / MAX_BYTES: the largest layer count, per-layer dimension,
  capacity in tokens or slots, and byte size hicache accepts; far above any real model or
  machine, low enough that nothing is allocated or looped over for an absurd value.
- MAX_DEPTH / MAX_NODES: the deepest nesting and the most values of a parsed config document.
- bounded_int: an int (never a bool, float or string) within [minimum, maximum], else ConfigError.
- config_int / optional_config_int: the same for one key of a config mapping, naming the key.
- config_flag: a JSON boolean (true/false), never a truthy string or number.
- parse_json: JSON text into Python values; nesting, Infinity/NaN and integers of more than
  MAX_INT_DIGITS digits are ConfigErrors, never RecursionError or ValueError.
- check_tree: a parsed document (JSON, TOML, YAML or a mapping from Python) walked without
  recursion: too deep, non-finite floats or integers beyond 64 bits are ConfigErrors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from hicache.domain.errors import ConfigError

MAX_LAYERS = 1 << 16  # the largest real models have a few hundred layers
MAX_DIM = 1 << 24  # heads, head dims, ranks, kernels, hidden sizes
MAX_UNITS = 1 << 40  # tokens, slots, windows: ~1.1e12
MAX_BYTES = 1 << 60  # 1 EiB
MAX_DEPTH = 64
MAX_INT_DIGITS = 30
MAX_NODES = 1_000_000
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
    """A value for a message, cut short (a 5000-digit integer is not repeated in full)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of about {int(value.bit_length() * 0.30103) + 1} digits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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


def parse_json(text: str, what: str) -> Any:
    """Parse JSON text; every failure is a ConfigError that names ``what``."""
    try:
        data = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
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
