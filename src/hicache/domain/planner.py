"""Stack planning: one function from (model spec, settings) to a host group plan.

- Archetype: DENSE_KV, MLA, KV_SWA, KV_STATE, KV_SWA_STATE, KV_INDEXER.
- PlanSettings: parallelism, page size, layouts, sizing, device capacities, storage, dtypes.
- archetype_of: which stack a model needs.
- plan_stack: the host group plan of one rank (tp rank geometry, pp stage layers).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

from hicache.domain.bindings import LayerBinding, stage_local
from hicache.domain.dtypes import DType
from hicache.domain.errors import ConfigError
from hicache.domain.geometry import AnyGeometry
from hicache.domain.host_memory import Pinning, StorageSettings, resolve_host_memory
from hicache.domain.layouts import Layout, check_layout
from hicache.domain.models import LayerKind, MLASpec, ModelSpec, stage_range
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
from hicache.domain.validators import optional_positive_int, positive_int


class Archetype(enum.Enum):
    DENSE_KV = "dense_kv"
    MLA = "mla"
    KV_SWA = "kv_swa"
    KV_STATE = "kv_state"
    KV_SWA_STATE = "kv_swa_state"
    KV_INDEXER = "kv_indexer"


def _layouts(value: Mapping[PoolName, Layout] | Mapping[str, str]) -> dict[PoolName, Layout]:
    return {PoolName.parse(k): Layout.parse(v) for k, v in value.items()}


def _overrides(value: Mapping[PoolName, int] | Mapping[str, int]) -> dict[PoolName, int]:
    return {PoolName.parse(k): int(v) for k, v in value.items()}


def _layout(value: Layout | str) -> Layout:
    return Layout.parse(value)


def _pinning(value: bool | str | Pinning | None) -> Pinning:
    return Pinning.parse(value)


@attrs.frozen(kw_only=True)
class PlanSettings:
    """Everything the planner needs besides the model. Defaults match `hicache plan`."""

    tp_size: int = attrs.field(default=1, validator=positive_int)
    pp_size: int = attrs.field(default=1, validator=positive_int)
    pp_rank: int = 0
    page_size: int = attrs.field(default=64, validator=positive_int)
    layout: Layout = attrs.field(default=Layout.PAGE_FIRST, converter=_layout)
    pool_layouts: Mapping[PoolName, Layout] = attrs.field(factory=dict, converter=_layouts)
    sizing: Sizing = attrs.field(factory=RatioSizing)
    capacity_overrides: Mapping[PoolName, int] = attrs.field(factory=dict, converter=_overrides)
    device_tokens: int = attrs.field(default=65536, validator=positive_int)
    device_slots: int = attrs.field(default=256, validator=positive_int)
    swa_tokens: int | None = attrs.field(default=None, validator=optional_positive_int)
    storage: StorageSettings = attrs.field(factory=StorageSettings)
    kv_dtype: DType | None = None
    ssm_dtype: DType = DType.FP32
    pinned: Pinning = attrs.field(default=Pinning.AUTO, converter=_pinning)

    def layout_of(self, pool: PoolName) -> Layout:
        return self.pool_layouts.get(pool, self.layout)


def archetype_of(spec: ModelSpec) -> Archetype:
    kinds = set(spec.layer_kinds)
    has_swa = LayerKind.SLIDING_ATTENTION in kinds
    has_state = bool(kinds & {LayerKind.MAMBA, LayerKind.LINEAR_ATTENTION})
    if spec.indexer is not None:
        if has_swa or has_state:
            raise ConfigError(
                f"model {spec.model_type!r}: an indexer with sliding or state layers is no "
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


def plan_stack(spec: ModelSpec, settings: PlanSettings | None = None) -> HostGroupPlan:
    """The host group plan of one (tp, pp) rank of ``spec``."""
    s = settings or PlanSettings()
    archetype = archetype_of(spec)
    start, end = stage_range(spec.num_layers, s.pp_size, s.pp_rank)
    geo = spec.rank_geometries(s.tp_size, kv_dtype=s.kv_dtype, ssm_dtype=s.ssm_dtype)
    host_memory = resolve_host_memory(s.storage, s.pinned)

    # Transfer layers: the stage's layers that keep any cache, numbered 0..n-1 in model order.
    cached = [i for i in range(start, end) if spec.layer_kinds[i].has_cache]
    if not cached:
        raise ConfigError(f"pipeline stage [{start}, {end}) of {spec.model_type!r} caches nothing")
    transfer_of = {g: t for t, g in enumerate(cached)}

    def binding(kind: LayerKind) -> LayerBinding:
        return LayerBinding.contiguous([transfer_of[g] for g in spec.layers_of(kind, start, end)])

    drafts: list[_Draft] = []
    full = binding(LayerKind.FULL_ATTENTION)
    if len(full) == 0:
        raise ConfigError(
            f"pipeline stage [{start}, {end}) of {spec.model_type!r} has no full-attention layer "
            f"to anchor its host group; choose another pp split"
        )
    if geo.kv is None:  # pragma: no cover - ModelSpec guarantees attention
        raise ConfigError(f"model {spec.model_type!r} has no attention geometry")
    drafts.append(
        _Draft(
            PoolName.KV,
            PoolRole.ANCHOR,
            geo.kv,
            full,
            s.page_size,
            HitPolicy.ALL_PAGES,
            s.device_tokens,
        )
    )
    if geo.indexer is not None:
        drafts.append(
            _Draft(
                PoolName.INDEXER,
                PoolRole.SIDECAR,
                geo.indexer,
                full,
                s.page_size,
                HitPolicy.ALL_PAGES,
                s.device_tokens,
            )
        )
    if geo.swa is not None:
        sw = binding(LayerKind.SLIDING_ATTENTION)
        if len(sw):
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
    if geo.state is not None:
        kind = (
            LayerKind.MAMBA if LayerKind.MAMBA in spec.layer_kinds else LayerKind.LINEAR_ATTENTION
        )
        st = binding(kind)
        if len(st):
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
    )


def _size(drafts: list[_Draft], s: PlanSettings) -> dict[PoolName, int]:
    """Capacities in units (whole pages) for every draft; sidecars follow the anchor."""
    present = {d.name: d.page_size for d in drafts}
    unknown = [n.value for n in s.capacity_overrides if n not in present]
    if unknown:
        raise ConfigError(
            f"capacity override names pools {unknown}, which this plan does not have "
            f"(pools: {[n.value for n in present]})"
        )
    sidecars = [d for d in drafts if d.role is PoolRole.SIDECAR]
    for d in sidecars:
        if d.name in s.capacity_overrides:
            raise ConfigError(
                f"pool {d.name.value!r} is a sidecar and takes the anchor's capacity; "
                f"override 'kv' instead"
            )
    check_overrides(
        {n.value: u for n, u in s.capacity_overrides.items()},
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
