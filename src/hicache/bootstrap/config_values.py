"""Values of hicache's configuration keys from files, mappings and environment variables.

- parse_value: a raw value (a file's or a mapping's typed value, or an environment variable's
  text) into the key's value (hicache.bootstrap.config_keys.Key), or a ConfigError naming the
  key, the value and the source.
- suggest: " (did you mean 'x'?)" for a misspelt key or variable.

Environment text converts: integers, numbers, true/false/1/0/yes/no/on/off, none (or empty) for
an optional key, a JSON object for a mapping, a JSON object or @file for the extra config. Files
and mappings give typed values: an integer key refuses the text "64".
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.adapters.devices import parse_device_name
from hicache.bootstrap.config_keys import Key, Kind, Source
from hicache.domain import ConfigError
from hicache.domain.errors import shown
from hicache.domain.limits import check_tree, is_finite_number, parse_json
from hicache.domain.sizing import parse_size

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("", "none", "null")


def _short(value: object) -> str:
    return shown(value)


class _Bad(Exception):
    """A value of the wrong shape; parse_value turns it into a ConfigError with the key."""


def _int(value: object, text: bool) -> int:
    if text and isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise _Bad("expected an integer") from None
    if not isinstance(value, int) or isinstance(value, bool):
        raise _Bad("expected an integer")
    return value


def _float(value: object, text: bool) -> float:
    if text and isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            raise _Bad("expected a number") from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        if not is_finite_number(value):  # inf, NaN, or an integer past float's range
            raise _Bad("expected a finite number")
        number = float(value)
    else:
        raise _Bad("expected a number")
    if not math.isfinite(number):
        raise _Bad("expected a finite number")
    return number


def _bool(value: object, text: bool) -> bool:
    if isinstance(value, bool):
        return value
    if text and isinstance(value, str) and value.strip().lower() in (*_TRUE, *_FALSE):
        return value.strip().lower() in _TRUE
    raise _Bad("expected true or false" + (" (or 1/0, yes/no, on/off)" if text else ""))


def _choice(value: object, choices: tuple[str, ...]) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, bool) and "on" in choices:  # pinned = true / false
        return "on" if value else "off"
    if not isinstance(value, str) or value.strip() not in choices:
        raise _Bad(f"expected one of {', '.join(choices)}")
    return value.strip()


def _is_none(value: object, text: bool) -> bool:
    return value is None or (text and isinstance(value, str) and value.strip().lower() in _NONE)


def _mapping(value: object, text: bool) -> Mapping[str, Any]:
    if text and isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = parse_json(value, "JSON text")  # bounded: depth, numbers, duplicate keys
        except ConfigError as e:
            raise _Bad(f"expected a JSON object ({e})") from None
    if not isinstance(value, Mapping):
        raise _Bad("expected a mapping" + (" (a JSON object)" if text else ""))
    check_tree(value, "the mapping")  # bounded nesting, finite numbers, 64-bit integers
    return value


def _pool_map(key: Key, value: object, text: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pool, v in _mapping(value, text).items():
        if not isinstance(pool, str) or not pool:
            raise _Bad(f"expected pool names as keys, got {shown(pool)}")
        try:
            out[pool] = _choice(v, key.choices) if key.values is Kind.CHOICE else _int(v, False)
        except _Bad as e:
            raise _Bad(f"pool {shown(pool)}: {e}") from None
    return out


def _extra(value: object, text: bool, relative_to: str | None) -> Mapping[str, Any]:
    from pathlib import Path

    from hicache.bootstrap.config import load_extra_config

    if isinstance(value, str) and value.strip().startswith("@"):
        path = Path(value.strip()[1:]).expanduser()
        if relative_to is not None and not path.is_absolute():
            path = Path(relative_to).parent / path
        return load_extra_config(path)
    if isinstance(value, str):
        return load_extra_config(value)  # a JSON object
    return _mapping(value, text)


def _backend(key: Key, value: object, text: bool) -> str | dict[str, str]:
    if isinstance(value, str) and not value.strip().startswith("{"):
        return _choice(value, key.choices)
    if isinstance(value, str) and not text:
        raise _Bad(f"expected one of {', '.join(key.choices)}, or a mapping of pool to one")
    return _pool_map(attrs.evolve(key, values=Kind.CHOICE), value, text)


def _device(value: object) -> str:
    if not isinstance(value, str):
        raise _Bad("expected cpu, cuda[:N] or rocm[:N]")
    try:
        parse_device_name(value.strip().lower())
    except ConfigError:
        raise _Bad("expected cpu, cuda[:N] or rocm[:N]") from None
    return value.strip().lower()


def _parse(key: Key, value: object, text: bool, relative_to: str | None) -> Any:
    kind = key.kind
    optional = kind in (Kind.OPTIONAL_INT, Kind.OPTIONAL_CHOICE, Kind.OPTIONAL_TEXT, Kind.SIZE)
    if optional and _is_none(value, text):
        return None
    if kind in (Kind.INT, Kind.OPTIONAL_INT):
        return _int(value, text)
    if kind is Kind.FLOAT:
        return _float(value, text)
    if kind is Kind.BOOL:
        return _bool(value, text)
    if kind in (Kind.CHOICE, Kind.OPTIONAL_CHOICE):
        return _choice(value, key.choices)
    if kind in (Kind.TEXT, Kind.OPTIONAL_TEXT):
        if not isinstance(value, str) or not value.strip():
            raise _Bad("expected a non-empty text")
        return value.strip()
    if kind is Kind.SIZE:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise _Bad("expected a size such as 64GiB or a number of bytes")
        return parse_size(value)
    if kind is Kind.POOL_MAP:
        return _pool_map(key, value, text)
    if kind is Kind.EXTRA_CONFIG:
        return dict(_extra(value, text, relative_to))
    if kind is Kind.BACKEND:
        return _backend(key, value, text)
    return _device(value)


def parse_value(key: Key, value: object, source: Source) -> Any:
    """``value`` as ``key``'s value. Environment variables give text (converted here); files
    and mappings give typed values (an integer key refuses the text "64"). A ConfigError names
    the key, the value and the source."""
    text = source.kind == "env"
    relative_to = source.label if source.kind == "file" else None
    try:
        return _parse(key, value, text, relative_to)
    except _Bad as e:
        raise ConfigError(f"{key.name} = {_short(value)} (from {source}): {e}") from None
    except ConfigError as e:
        raise ConfigError(f"{key.name} = {_short(value)} (from {source}): {e}") from None


def suggest(name: str, known: Mapping[str, object]) -> str:
    """ ", did you mean 'x'?" for the closest known name, or ""."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.7)
    return f" (did you mean {close[0]!r}?)" if close else ""


__all__ = ["parse_value", "suggest"]
