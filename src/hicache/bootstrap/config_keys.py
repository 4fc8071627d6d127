"""The keys of hicache's one configuration (hicache.bootstrap.hicache_config), torch-free.

- Key: one setting: its dotted name ("plan.page_size"), its environment variable
  ("HICACHE_PLAN_PAGE_SIZE"), its default (read from the settings class that owns it), its kind
  and a one-line meaning.
- KEYS: every key, in the order ``hicache config --show`` prints them.
- Source: where a value came from: the defaults, a file, an environment variable or a mapping
  given by a caller (a label such as "kv_connector_extra_config").
- COPY_BACKENDS: the copy backend names (hicache.adapters.copy.BACKENDS, kept torch-free here;
  a test keeps the two equal).
- OTHER_ENV_VARS: HICACHE_* variables that are not configuration keys (set-up, tests, adapters).

Environment variable names are ``HICACHE_`` + the dotted name in capitals with "." as "_":
``copy.backend`` is ``HICACHE_COPY_BACKEND``, the variable the copy backends always read.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

from hicache.cache.values import CacheSettings
from hicache.domain import Layout, PlanSettings, WritePolicy
from hicache.domain.host_memory import KNOWN_BACKENDS, Pinning
from hicache.domain.hybrid import CheckpointPolicy
from hicache.domain.sizing import RatioSizing
from hicache.domain.stages import PPSplit
from hicache.domain.tiers import WriteSettings
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
        "HICACHE_ENGINES",  # scripts/setup
        "HICACHE_VLLM",  # scripts/setup
        "HICACHE_WHEELS",  # scripts/gpu-check, scripts/gpu-wheels: carried wheels
        "HICACHE_REQUIRE_MOONCAKE",  # tests
        "HICACHE_REQUIRE_VLLM",  # tests
        "HICACHE_REQUIRE_SGLANG",  # tests
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
]
