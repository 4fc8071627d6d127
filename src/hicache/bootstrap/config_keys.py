"""The keys of hicache's one configuration (hicache.bootstrap.hicache_config), torch-free.

- Key: one setting: its dotted name ("plan.page_size"), its environment variable
  ("HICACHE_PLAN_PAGE_SIZE"), its default (read from the settings class that owns it), its kind
  and a one-line meaning.
- KEYS: every key, in the order ``hicache config --show`` prints them.
- Source: where a value came from: the defaults, a file, an environment variable or a mapping
  given by a caller (a label such as "kv_connector_extra_config").
- parse_value: a raw value (a file's or a mapping's typed value, or an environment variable's
  text) into the key's value, or a ConfigError naming the key, the value and the source.
- COPY_BACKENDS: the copy backend names (hicache.adapters.copy.BACKENDS, kept torch-free here;
  a test keeps the two equal).
- OTHER_ENV_VARS: HICACHE_* variables that are not configuration keys (set-up, tests, adapters).

Environment variable names are ``HICACHE_`` + the dotted name in capitals with "." as "_":
``copy.backend`` is ``HICACHE_COPY_BACKEND``, the variable the copy backends always read.
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.adapters.devices import parse_device_name
from hicache.domain import ConfigError, Layout, PlanSettings, WritePolicy
from hicache.domain.host_memory import KNOWN_BACKENDS, Pinning
from hicache.domain.hybrid import CheckpointPolicy
from hicache.domain.sizing import RatioSizing, parse_size
from hicache.domain.stages import PPSplit
from hicache.domain.tiers import WriteSettings
from hicache.engine.cache_values import CacheSettings
from hicache.engine.engine import DEVICE_OWNERSHIP
from hicache.engine.storage_settings import PrefetchPolicy, StorageTierSettings

ENV_PREFIX = "HICACHE_"
CONFIG_FILE_VAR = "HICACHE_CONFIG"  # the file load() reads when no path is given
COPY_BACKENDS = ("auto", "naive", "torch", "memcpy", "cuda_batch")
SECTIONS = ("plan", "cache", "storage", "copy", "runtime")
# HICACHE_* variables read elsewhere; never configuration keys, never an "unknown key" error.
OTHER_ENV_VARS = frozenset(
    {
        CONFIG_FILE_VAR,
        "HICACHE_SHM_DIR",  # hicache.adapters.host_memory.shm: the segment folder
        "HICACHE_NATIVE_DIR",  # hicache.adapters.copy.native: where the memcpy helper is built
        "HICACHE_TORCH",  # scripts/setup
        "HICACHE_TORCH_INDEX",  # scripts/setup
        "HICACHE_VENV",  # scripts/setup
        "HICACHE_MOONCAKE",  # scripts/setup
        "HICACHE_REQUIRE_MOONCAKE",  # tests
        "HICACHE_STATEFUL_EXAMPLES",  # tests
    }
)


class Kind(enum.Enum):
    INT = "integer"
    OPTIONAL_INT = "integer or none"
    FLOAT = "number"
    BOOL = "boolean"
    CHOICE = "choice"
    OPTIONAL_CHOICE = "choice or none"
    TEXT = "text"
    OPTIONAL_TEXT = "text or none"
    SIZE = "size or none"  # bytes: an integer or "64GiB"
    POOL_MAP = "mapping of pool to value"
    EXTRA_CONFIG = "mapping, JSON object or @file"
    BACKEND = "backend name, or mapping of pool to backend name"
    DEVICE = "device"


@attrs.frozen
class Source:
    """Where a value came from. ``kind``: default, file, env or mapping; ``label``: the file
    path, the variable's name, or the caller's label for a mapping."""

    kind: str
    label: str = ""

    def __str__(self) -> str:
        if self.kind == "default":
            return "default"
        if self.kind == "file":
            return f"file {self.label}"
        if self.kind == "env":
            return f"env {self.label}"
        return self.label


DEFAULT = Source("default")


@attrs.frozen
class Key:
    name: str
    kind: Kind
    default: Any
    meaning: str
    choices: tuple[str, ...] = ()
    values: Kind | None = None  # POOL_MAP: the kind of each value (CHOICE uses ``choices``)

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper().replace(".", "_")

    @property
    def section(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]


def _default(cls: type, field: str) -> Any:
    d: Any = attrs.fields_dict(cls)[field].default
    value = d.factory() if hasattr(d, "takes_self") else d  # an attrs.Factory: call it
    return value.value if isinstance(value, enum.Enum) else value


def _names(cls: type[enum.Enum]) -> tuple[str, ...]:
    return tuple(str(m.value) for m in cls)


def _plan(field: str, kind: Kind, meaning: str, choices: tuple[str, ...] = ()) -> Key:
    return Key(f"plan.{field}", kind, _default(PlanSettings, field), meaning, choices)


def _tier(field: str, kind: Kind, meaning: str, choices: tuple[str, ...] = ()) -> Key:
    return Key(
        f"storage.tier.{field}", kind, _default(StorageTierSettings, field), meaning, choices
    )


_I, _F, _C = Kind.INT, Kind.FLOAT, Kind.CHOICE

KEYS: tuple[Key, ...] = (
    _plan("tp_size", _I, "tensor-parallel size"),
    _plan("pp_size", _I, "pipeline-parallel size"),
    _plan("pp_rank", _I, "the pipeline stage to plan, in [0, pp_size)"),
    _plan("pp_split", _C, "how pp_size splits layers", _names(PPSplit)),
    _plan("pp_start", Kind.OPTIONAL_INT, "the stage's first layer (with pp_end)"),
    _plan("pp_end", Kind.OPTIONAL_INT, "one past the stage's last layer (with pp_start)"),
    _plan("page_size", _I, "tokens per page of the token pools"),
    _plan("layout", _C, "host layout of every pool", _names(Layout)),
    Key(
        "plan.pool_layouts",
        Kind.POOL_MAP,
        {},
        "a host layout per pool, e.g. {mamba: page_first}",
        _names(Layout),
        Kind.CHOICE,
    ),
    Key(
        "plan.host_ratio",
        _F,
        _default(RatioSizing, "ratio"),
        "host capacity = device capacity x ratio (unless host_size is set)",
    ),
    Key("plan.host_size", Kind.SIZE, None, "host bytes per rank for all pools, e.g. 64GiB"),
    Key(
        "plan.capacity_overrides",
        Kind.POOL_MAP,
        {},
        "a fixed host capacity per pool, in tokens or slots",
        (),
        Kind.INT,
    ),
    _plan("device_tokens", _I, "the anchor's device capacity in tokens"),
    _plan("device_slots", _I, "state slots on the device"),
    _plan("swa_tokens", Kind.OPTIONAL_INT, "the sliding-window pool's device tokens"),
    _plan("kv_dtype", Kind.OPTIONAL_TEXT, "KV dtype (none: the model's)"),
    _plan("ssm_dtype", Kind.TEXT, "recurrent temporal state dtype"),
    _plan("pinned", _C, "page-lock host memory", _names(Pinning)),
    Key(
        "cache.writes.host",
        _C,
        _default(WriteSettings, "host"),
        "when pages are copied device -> host",
        _names(WritePolicy),
    ),
    Key(
        "cache.writes.storage",
        Kind.OPTIONAL_CHOICE,
        _default(WriteSettings, "storage"),
        "when pages are copied host -> storage (none: write_through with a store)",
        _names(WritePolicy),
    ),
    Key("cache.writes.host_hits", _I, _default(WriteSettings, "host_hits"), "selective threshold"),
    Key(
        "cache.writes.storage_hits",
        _I,
        _default(WriteSettings, "storage_hits"),
        "selective threshold for storage",
    ),
    Key(
        "cache.checkpoints.every_pages",
        _I,
        _default(CheckpointPolicy, "every_pages"),
        "a state checkpoint every this many pages",
    ),
    Key(
        "cache.checkpoints.at_end",
        Kind.BOOL,
        _default(CheckpointPolicy, "at_end"),
        "a state checkpoint at a request's last full page",
    ),
    Key(
        "cache.sliding_window",
        Kind.OPTIONAL_INT,
        _default(CacheSettings, "sliding_window"),
        "tokens of a sliding-window pool (needed when the plan has one)",
    ),
    Key(
        "cache.prefetch_batch_pages",
        _I,
        _default(CacheSettings, "prefetch_batch_pages"),
        "pages per storage read batch",
    ),
    Key(
        "cache.prefetch_min_pages",
        _I,
        _default(CacheSettings, "prefetch_min_pages"),
        "a prefetch of fewer pages is not started",
    ),
    Key(
        "storage.backend",
        Kind.OPTIONAL_CHOICE,
        None,
        "the storage (L3) backend (none: no storage tier)",
        tuple(sorted(KNOWN_BACKENDS)),
    ),
    Key(
        "storage.extra_config",
        Kind.EXTRA_CONFIG,
        {},
        "the backend's extra config (its keys: docs/configuration.md)",
    ),
    _tier("prefetch_policy", _C, "how long a prefetch waits for storage", _names(PrefetchPolicy)),
    _tier("timeout_base_s", _F, "timeout policy: base seconds"),
    _tier("timeout_per_ki_token_s", _F, "timeout policy: seconds per 1024 tokens"),
    _tier("timeout_max_s", _F, "timeout policy: the longest wait"),
    _tier("batch_pages", _I, "pages per store call"),
    _tier("max_concurrency", _I, "store calls at once"),
    _tier("call_deadline_s", _F, "a store call's deadline"),
    _tier("write_queue", _I, "background writes queued at most"),
    _tier("breaker_threshold", _I, "failed calls that open the breaker"),
    _tier("breaker_cooldown_s", _F, "seconds the open breaker refuses calls"),
    Key(
        "copy.backend",
        Kind.BACKEND,
        "auto",
        "copy backend, one name or one per pool (auto: the measured default)",
        COPY_BACKENDS,
    ),
    Key("runtime.device", Kind.DEVICE, "cpu", "cpu, cuda[:N] or rocm[:N]"),
    Key("runtime.huge_pages", Kind.BOOL, False, "anonymous host memory on transparent huge pages"),
    Key("runtime.event_sets", _I, 3, "finished per-layer event sets kept for reuse"),
    Key(
        "runtime.device_ownership",
        _C,
        "engine",
        "who allocates device pages: the engine or the framework",
        DEVICE_OWNERSHIP,
    ),
)
BY_NAME: dict[str, Key] = {k.name: k for k in KEYS}
BY_ENV: dict[str, Key] = {k.env: k for k in KEYS}

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
_NONE = ("", "none", "null")


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


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
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise _Bad(f"expected a JSON object ({e.msg} at character {e.pos})") from None
    if not isinstance(value, Mapping):
        raise _Bad("expected a mapping" + (" (a JSON object)" if text else ""))
    return value


def _pool_map(key: Key, value: object, text: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pool, v in _mapping(value, text).items():
        if not isinstance(pool, str) or not pool:
            raise _Bad(f"expected pool names as keys, got {pool!r}")
        try:
            out[pool] = _choice(v, key.choices) if key.values is Kind.CHOICE else _int(v, False)
        except _Bad as e:
            raise _Bad(f"pool {pool!r}: {e}") from None
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


__all__ = [
    "BY_ENV",
    "BY_NAME",
    "CONFIG_FILE_VAR",
    "COPY_BACKENDS",
    "DEFAULT",
    "ENV_PREFIX",
    "KEYS",
    "OTHER_ENV_VARS",
    "SECTIONS",
    "Key",
    "Kind",
    "Source",
    "parse_value",
    "suggest",
]
