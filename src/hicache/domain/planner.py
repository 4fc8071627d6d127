"""Stack planning: one function from (model spec, settings) to a host group plan.

- Archetype: DENSE_KV, MLA, KV_SWA, KV_STATE, KV_SWA_STATE, KV_INDEXER.
- DEFAULT_LAYOUT: page_first_direct, the layout the copy measurements favour (docs/copy.md).
- PlanSettings: parallelism, pipeline stage, page size, layouts, sizing, device capacities,
  storage, dtypes; every field checked on construction (ConfigError naming the field).
- archetype_of: which stack a model needs.
- plan_stack: the host group plan of one rank (tp rank geometry, pp stage layers).
- working_pp_sizes: the pp sizes whose every stage has a full-attention layer.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.domain.bindings import LayerBinding, stage_local
from hicache.domain.dtypes import DType
from hicache.domain.errors import ConfigError, shown
from hicache.domain.geometry import AnyGeometry
from hicache.domain.host_memory import Pinning, StorageSettings, resolve_host_memory
from hicache.domain.layouts import Layout, check_layout
from hicache.domain.models import Cache, MLASpec, ModelSpec
from hicache.domain.pools import HitPolicy, HostGroupPlan, PoolName, PoolPlan, PoolRole
from hicache.domain.sizing import (
    BudgetSizing,
    Demand,
    RatioSizing,
    Sizing,
    check_overrides,
    ratio_capacity,
    split_budget,
)
from hicache.domain.stages import PPSplit, check_stage, stage_range, stage_sizes
from hicache.domain.validators import nonneg_int, optional_positive_int, positive_int


class Archetype(enum.Enum):
    DENSE_KV = "dense_kv"
    MLA = "mla"
    KV_SWA = "kv_swa"
    KV_STATE = "kv_state"
    KV_SWA_STATE = "kv_swa_state"
    KV_INDEXER = "kv_indexer"


# page_first_direct: per-layer loads at page 64 ran at 1.23x of a contiguous copy where
# page_first ran at 0.53x, and a page of all layers stays one object for storage. Every pool
# kind can take it, recurrent state included (docs/copy.md, docs/plan.md).
DEFAULT_LAYOUT = Layout.PAGE_FIRST_DIRECT


def _mapping(value: object, field: str) -> Mapping[Any, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{field} must be a mapping of pool name to value, got {shown(value)}")
    return value


def _layouts(value: object) -> dict[PoolName, Layout]:
    return {PoolName.parse(k): _layout(v) for k, v in _mapping(value, "pool_layouts").items()}


def _overrides(value: object) -> dict[PoolName, int]:
    out: dict[PoolName, int] = {}
    for k, v in _mapping(value, "capacity_overrides").items():
        if not isinstance(v, int) or isinstance(v, bool):
            raise ConfigError(f"capacity_overrides[{shown(k)}] must be an integer, got {shown(v)}")
        out[PoolName.parse(k)] = v
    return out


def _layout(value: object) -> Layout:
    if not isinstance(value, (str, Layout)):
        raise ConfigError(f"layout must be a Layout or its name, got {shown(value)}")
    return Layout.parse(value)


def _pinning(value: object) -> Pinning:
    if value is not None and not isinstance(value, (bool, str, Pinning)):
        raise ConfigError(
            f"pinned must be a Pinning, a bool, 'on'/'off'/'auto' or None, got {shown(value)}"
        )
    return Pinning.parse(value)


def _as_dtype(field: str, value: object) -> DType:
    if not isinstance(value, (str, DType)):
        raise ConfigError(f"{field} must be a DType or its name, got {shown(value)}")
    return DType.parse(value)


def _kv_dtype(value: object) -> DType | None:
    return None if value is None else _as_dtype("kv_dtype", value)


def _ssm_dtype(value: object) -> DType:
    return _as_dtype("ssm_dtype", value)


def _sizing(value: object) -> Sizing:
    if not isinstance(value, (RatioSizing, BudgetSizing)):
        raise ConfigError(f"sizing must be a RatioSizing or a BudgetSizing, got {shown(value)}")
    return value


def _storage(value: object) -> StorageSettings:
    if value is None:
        return StorageSettings()
    if isinstance(value, str):  # a backend name alone: StorageSettings(backend=value)
        return StorageSettings(backend=value)
    if not isinstance(value, StorageSettings):
        raise ConfigError(
            f"storage must be a StorageSettings (backend, extra_config) or a backend name, got "
            f"{shown(value)}"
        )
    return value


def _pp_split(value: object) -> PPSplit:
    if not isinstance(value, (str, PPSplit)):
        raise ConfigError(f"pp_split must be 'vllm' or 'sglang', got {shown(value)}")
    return PPSplit.parse(value)


def _optional_nonneg(inst: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None:
        nonneg_int(inst, attribute, value)


def _nearest_pages(what: str, units: int, page: int) -> ConfigError:
    low = units // page * page
    high = low + page
    near = f"{low} or {high}" if low > 0 else f"{high}"
    return ConfigError(
        f"{what}={units} is not a whole number of pages of {page} tokens; use {near}"
    )


@attrs.frozen(kw_only=True)
class PlanSettings:
    """Everything the planner needs besides the model. Defaults match `hicache plan`.

    The stage: give ``pp_start``/``pp_end`` (the [start, end) the serving engine runs; what an
    embedder should pass) or let ``pp_size``/``pp_rank`` and ``pp_split`` derive it.
    """

    tp_size: int = attrs.field(default=1, validator=positive_int)
    pp_size: int = attrs.field(default=1, validator=positive_int)
    pp_rank: int = attrs.field(default=0, validator=nonneg_int)
    pp_split: PPSplit = attrs.field(default=PPSplit.VLLM, converter=_pp_split)
    pp_start: int | None = attrs.field(default=None, validator=_optional_nonneg)
    pp_end: int | None = attrs.field(default=None, validator=optional_positive_int)
    page_size: int = attrs.field(default=64, validator=positive_int)
    layout: Layout = attrs.field(default=DEFAULT_LAYOUT, converter=_layout)
    pool_layouts: Mapping[PoolName, Layout] = attrs.field(factory=dict, converter=_layouts)
    sizing: Sizing = attrs.field(factory=RatioSizing, converter=_sizing)
    capacity_overrides: Mapping[PoolName, int] = attrs.field(factory=dict, converter=_overrides)
    device_tokens: int = attrs.field(default=65536, validator=positive_int)
    device_slots: int = attrs.field(default=256, validator=positive_int)
    swa_tokens: int | None = attrs.field(default=None, validator=optional_positive_int)
    storage: StorageSettings = attrs.field(factory=StorageSettings, converter=_storage)
    kv_dtype: DType | None = attrs.field(default=None, converter=_kv_dtype)
    ssm_dtype: DType = attrs.field(default=DType.FP32, converter=_ssm_dtype)
    pinned: Pinning = attrs.field(default=Pinning.AUTO, converter=_pinning)

    def __attrs_post_init__(self) -> None:
        if self.pp_rank >= self.pp_size:
            raise ConfigError(
                f"pp_rank must be in [0, {self.pp_size}), got {self.pp_rank} (pp_size is "
                f"{self.pp_size})"
            )
        if (self.pp_start is None) != (self.pp_end is None):
            raise ConfigError(
                f"pp_start and pp_end come together (the stage's [start, end)); got "
                f"pp_start={shown(self.pp_start)}, pp_end={shown(self.pp_end)}"
            )
        if self.pp_start is not None and self.pp_end is not None and self.pp_start >= self.pp_end:
            raise ConfigError(
                f"pp_start must be below pp_end, got [{self.pp_start}, {self.pp_end})"
            )
        if self.device_tokens % self.page_size:
            raise _nearest_pages("device_tokens", self.device_tokens, self.page_size)
        if self.swa_tokens is not None and self.swa_tokens % self.page_size:
            raise _nearest_pages("swa_tokens", self.swa_tokens, self.page_size)

    def layout_of(self, pool: PoolName) -> Layout:
        return self.pool_layouts.get(pool, self.layout)

    def stage_of(self, num_layers: int) -> tuple[int, int]:
        """This rank's [start, end): the one given, or the pp split's."""
        if self.pp_start is not None and self.pp_end is not None:
            return check_stage(num_layers, self.pp_start, self.pp_end)
        return stage_range(num_layers, self.pp_size, self.pp_rank, self.pp_split)


def _check_spec(spec: object) -> None:
    if not isinstance(spec, ModelSpec):
        raise ConfigError(
            f"spec must be a ModelSpec (ModelSpec.from_hf_config or "
            f"hicache.bootstrap.load_model_spec), got {type(spec).__name__}"
        )


def archetype_of(spec: ModelSpec) -> Archetype:
    _check_spec(spec)
    caches = set().union(*spec.layer_caches)
    has_swa = Cache.SLIDING in caches
    has_state = Cache.STATE in caches
    if spec.indexer is not None:
        if has_swa or has_state:
            raise ConfigError(
                f"model {shown(spec.model_type)}: an indexer with sliding or state layers is no "
                f"supported archetype"
            )
        return Archetype.KV_INDEXER
    if has_swa and has_state:
        return Archetype.KV_SWA_STATE
    if has_state:
        return Archetype.KV_STATE
    if has_swa:
        return Archetype.KV_SWA
    if isinstance(spec.attention, MLASpec):
        return Archetype.MLA
    return Archetype.DENSE_KV


def working_pp_sizes(spec: ModelSpec, split: PPSplit | str = PPSplit.VLLM) -> list[int]:
    """The pp sizes under ``split`` whose every stage holds a full-attention layer."""
    _check_spec(spec)
    full = spec.layers_holding(Cache.FULL)
    out = []
    for pp in range(1, spec.num_layers + 1):
        start = 0
        ok = True
        for size in stage_sizes(spec.num_layers, pp, split):
            if not any(start <= f < start + size for f in full):
                ok = False
                break
            start += size
        if ok:
            out.append(pp)
    return out


@attrs.frozen
class _Draft:
    """A pool before sizing: everything but its capacity."""

    name: PoolName
    role: PoolRole
    geometry: AnyGeometry
    binding: LayerBinding
    page_size: int
    hit_policy: HitPolicy
    device_units: int


def _no_anchor(spec: ModelSpec, s: PlanSettings, start: int, end: int) -> ConfigError:
    if s.pp_start is not None:
        how = "the stage given by pp_start/pp_end"
    else:
        how = f"pp_size={s.pp_size} ({s.pp_split.value} split) rank {s.pp_rank}"
    sizes = working_pp_sizes(spec, s.pp_split)
    listed = ", ".join(str(n) for n in sizes[:12]) + (", ..." if len(sizes) > 12 else "")
    held = sorted({c.value for i in range(start, end) for c in spec.layer_caches[i]})
    if not held:
        return ConfigError(
            f"pipeline stage [{start}, {end}) of {shown(spec.model_type)} caches nothing ({how}); "
            f"pp "
            f"sizes whose every stage has a full-attention layer under the {s.pp_split.value} "
            f"split: {listed}"
        )
    return ConfigError(
        f"pipeline stage [{start}, {end}) of {shown(spec.model_type)} has no full-attention layer "
        f"to "
        f"anchor its host group ({how}; its layers hold {held or 'nothing'}); pp sizes whose "
        f"every stage has one under the {s.pp_split.value} split: {listed}"
    )


def _settings(value: object) -> PlanSettings:
    """PlanSettings, None (the defaults), a mapping of PlanSettings' keyword arguments, or a
    configuration object with a ``plan_settings()`` method (hicache.bootstrap.HiCacheConfig)."""
    if value is None:
        return PlanSettings()
    if isinstance(value, PlanSettings):
        return value
    from_config = getattr(value, "plan_settings", None)
    if callable(from_config) and not isinstance(value, Mapping):
        settings = from_config()
        if not isinstance(settings, PlanSettings):
            raise ConfigError(
                f"{type(value).__name__}.plan_settings() returned "
                f"{type(settings).__name__}, not PlanSettings"
            )
        return settings
    if isinstance(value, Mapping):
        names = {str(a.alias) for a in attrs.fields(PlanSettings) if a.init}
        unknown = sorted(str(k) for k in value if k not in names)
        if unknown:
            raise ConfigError(f"unknown plan settings {unknown}: expected some of {sorted(names)}")
        return PlanSettings(**value)
    raise ConfigError(
        f"settings must be a PlanSettings, a mapping of its fields, a HiCacheConfig or None, got "
        f"{type(value).__name__}"
    )


def plan_stack(
    spec: ModelSpec, settings: PlanSettings | Mapping[str, Any] | None = None
) -> HostGroupPlan:
    """The host group plan of one (tp, pp) rank of ``spec``.

    ``settings``: a PlanSettings, None for the defaults, a mapping of PlanSettings' fields
    (``{"tp_size": 2, "layout": "page_first"}``), checked the same way, or a HiCacheConfig
    (anything with a ``plan_settings()`` method).
    """
    _check_spec(spec)
    s = _settings(settings)
    archetype = archetype_of(spec)
    start, end = s.stage_of(spec.num_layers)
    geo = spec.rank_geometries(s.tp_size, kv_dtype=s.kv_dtype, ssm_dtype=s.ssm_dtype)
    host_memory = resolve_host_memory(s.storage, s.pinned)

    # Transfer layers: the stage's layers that keep any cache, numbered 0..n-1 in model order.
    cached = list(spec.cached_layers(start, end))
    if not spec.layers_holding(Cache.FULL, start, end):
        raise _no_anchor(spec, s, start, end)
    transfer_of = {g: t for t, g in enumerate(cached)}

    def binding(cache: Cache) -> LayerBinding:
        return LayerBinding.contiguous(
            [transfer_of[g] for g in spec.layers_holding(cache, start, end)]
        )

    if geo.kv is None:  # pragma: no cover - ModelSpec guarantees attention
        raise ConfigError(f"model {shown(spec.model_type)} has no attention geometry")
    drafts = [
        _Draft(
            PoolName.KV,
            PoolRole.ANCHOR,
            geo.kv,
            binding(Cache.FULL),
            s.page_size,
            HitPolicy.ALL_PAGES,
            s.device_tokens,
        )
    ]
    # Pools whose layers are all outside this stage are left out of its plan.
    if geo.indexer is not None and len(ix := binding(Cache.INDEXER)):
        drafts.append(
            _Draft(
                PoolName.INDEXER,
                PoolRole.SIDECAR,
                geo.indexer,
                ix,
                s.page_size,
                HitPolicy.ALL_PAGES,
                s.device_tokens,
            )
        )
    if geo.swa is not None and len(sw := binding(Cache.SLIDING)):
        drafts.append(
            _Draft(
                PoolName.SWA,
                PoolRole.INDEPENDENT,
                geo.swa,
                sw,
                s.page_size,
                HitPolicy.TRAILING_PAGES,
                s.swa_tokens or s.device_tokens,
            )
        )
    if geo.state is not None and len(st := binding(Cache.STATE)):
        drafts.append(
            _Draft(
                PoolName.MAMBA,
                PoolRole.INDEPENDENT,
                geo.state,
                st,
                1,
                HitPolicy.TRAILING_PAGES,
                s.device_slots,
            )
        )

    _check_pool_settings(spec, s, [d.name for d in drafts])
    for d in drafts:
        check_layout(
            s.layout_of(d.name), d.geometry, pool=d.name.value, storage_backend=s.storage.backend
        )
    capacities = _size(drafts, s)
    pools = [
        PoolPlan(
            name=d.name,
            role=d.role,
            geometry=d.geometry,
            binding=d.binding,
            layout=s.layout_of(d.name),
            page_size=d.page_size,
            capacity=capacities[d.name],
            hit_policy=d.hit_policy,
            device_capacity=d.device_units,
        )
        for d in drafts
    ]
    return HostGroupPlan(
        host_memory=host_memory,
        pools=pools,
        model_layers=stage_local(cached, start, end),
        model_type=spec.model_type,
        archetype=archetype.value,
        tp_size=s.tp_size,
        stage=(start, end),
        sliding_window=spec.sliding_window,
    )


_POOL_CACHES = {
    PoolName.KV: Cache.FULL,
    PoolName.INDEXER: Cache.INDEXER,
    PoolName.SWA: Cache.SLIDING,
    PoolName.MAMBA: Cache.STATE,
}


def _check_pool_settings(spec: ModelSpec, s: PlanSettings, planned: list[PoolName]) -> None:
    """Per-pool settings must name pools of the model; never ignore one silently.

    A pool of the model that this pipeline stage does not hold (all its layers are in other
    stages) is accepted: every stage may be given the same settings.
    """
    in_model = [n for n, cache in _POOL_CACHES.items() if spec.layers_holding(cache)]
    for what, names in (
        ("capacity override", s.capacity_overrides),
        ("pool layout", s.pool_layouts),
    ):
        unknown = [n.value for n in names if n not in in_model]
        if unknown:
            raise ConfigError(
                f"{what} names pools {unknown}, which model {shown(spec.model_type)} does not have "
                f"(its pools: {[n.value for n in in_model]}; this plan's: "
                f"{[n.value for n in planned]})"
            )


def _size(drafts: list[_Draft], s: PlanSettings) -> dict[PoolName, int]:
    """Capacities in units (whole pages) for every draft; sidecars follow the anchor.

    A capacity override for a pool of the model that this stage does not hold is not used here
    (``_check_pool_settings`` refused the ones that name no pool of the model).
    """
    present = {d.name: d.page_size for d in drafts}
    sidecars = [d for d in drafts if d.role is PoolRole.SIDECAR]
    for d in sidecars:
        if d.name in s.capacity_overrides:
            raise ConfigError(
                f"pool {shown(d.name.value)} is a sidecar and takes the anchor's capacity; "
                f"override 'kv' instead"
            )
    check_overrides(
        {n.value: u for n, u in s.capacity_overrides.items() if n in present},
        {n.value: p for n, p in present.items()},
    )
    owners = [d for d in drafts if d.role is not PoolRole.SIDECAR]
    anchor = next(d for d in drafts if d.role is PoolRole.ANCHOR)

    def unit_bytes(d: _Draft) -> int:
        """Bytes per unit over all layers; the anchor carries its sidecars' bytes too."""
        own = d.geometry.bytes_per_unit_per_layer * len(d.binding)
        if d is anchor:
            own += sum(c.geometry.bytes_per_unit_per_layer * len(c.binding) for c in sidecars)
        return own

    out: dict[PoolName, int] = {}
    free = [d for d in owners if d.name not in s.capacity_overrides]
    for d in owners:
        if d.name in s.capacity_overrides:
            out[d.name] = s.capacity_overrides[d.name]
    if isinstance(s.sizing, RatioSizing):
        for d in free:
            out[d.name] = ratio_capacity(d.device_units, s.sizing.ratio, d.page_size)
    elif isinstance(s.sizing, BudgetSizing):
        fixed = sum(out[d.name] * unit_bytes(d) for d in owners if d.name in out)
        budget = s.sizing.bytes_per_rank - fixed
        if free:
            if budget <= 0:
                raise ConfigError(
                    f"capacity overrides take {fixed} B, the whole budget of "
                    f"{s.sizing.bytes_per_rank} B, leaving nothing for "
                    f"{[d.name.value for d in free]}"
                )
            pages = split_budget(
                budget,
                [
                    Demand(
                        d.name.value, d.device_units * unit_bytes(d), d.page_size * unit_bytes(d)
                    )
                    for d in free
                ],
            )
            for d in free:
                out[d.name] = pages[d.name.value] * d.page_size
        elif fixed > s.sizing.bytes_per_rank:
            raise ConfigError(
                f"capacity overrides take {fixed} B, more than the budget of "
                f"{s.sizing.bytes_per_rank} B"
            )
    for d in sidecars:
        out[d.name] = out[anchor.name]
    return out
