"""Properties that hold for every input: budget splits, transfer-layer unions, group memory."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, reject, settings
from hypothesis import strategies as st

from hicache.domain import (
    AllocatorMismatchError,
    AttentionSpec,
    BudgetSizing,
    GatedDeltaNetSpec,
    HostGroupPlan,
    HostMemory,
    IndexerSpec,
    LayerBinding,
    LayerKind,
    Mamba2Spec,
    MemoryKind,
    ModelSpec,
    Pinning,
    PlanSettings,
    PoolDescription,
    PoolRole,
    RatioSizing,
    SizingError,
    plan_stack,
    split_budget,
    transfer_layer_count,
)
from hicache.domain.sizing import Demand
from tests.domain.builders import anchor, sidecar, state_pool

FAST = settings(max_examples=75, deadline=None)

demands = st.lists(
    st.tuples(st.integers(1, 10**12), st.integers(1, 10**7)), min_size=1, max_size=5
).map(lambda ds: [Demand(f"p{i}", w, bpp) for i, (w, bpp) in enumerate(ds)])


@FAST
@given(budget=st.integers(1, 10**13), ds=demands)
def test_budget_split_stays_within_budget_and_within_a_page_of_each_share(
    budget: int, ds: list[Demand]
) -> None:
    total = sum(d.device_bytes for d in ds)
    exact = {d.key: Fraction(budget * d.device_bytes, total * d.bytes_per_page) for d in ds}
    try:
        pages = split_budget(budget, ds)
    except SizingError:
        assert min(exact.values()) < 1  # only when some share is less than one page
        return
    assert sum(pages[d.key] * d.bytes_per_page for d in ds) <= budget
    for d in ds:
        assert exact[d.key] - 1 < pages[d.key] <= exact[d.key]


layer_sets = st.lists(st.sets(st.integers(0, 200), max_size=40), min_size=0, max_size=6)


@FAST
@given(sets=layer_sets)
def test_transfer_layer_count_is_the_size_of_the_union(sets: list[set[int]]) -> None:
    bindings = [LayerBinding.contiguous(sorted(s)) for s in sets]
    assert transfer_layer_count(bindings) == len(set().union(*sets))


memories = st.builds(
    HostMemory,
    st.sampled_from([MemoryKind("anonymous"), MemoryKind("shm"), MemoryKind("store:mooncake")]),
    st.sampled_from(list(Pinning)),
)


@FAST
@given(kinds=st.lists(memories, min_size=2, max_size=3), order=st.permutations([0, 1, 2]))
def test_a_group_from_mixed_host_memory_always_raises(
    kinds: list[HostMemory], order: list[int]
) -> None:
    pools = [anchor(), sidecar(), state_pool()]
    picked = [pools[i] for i in order[: len(kinds)]]
    if all(p.role is not PoolRole.ANCHOR for p in picked):
        picked[0] = pools[0]
    descriptions = [PoolDescription(p, m) for p, m in zip(picked, kinds, strict=True)]
    if len(set(kinds)) > 1:
        with pytest.raises(AllocatorMismatchError) as info:
            HostGroupPlan.assemble(descriptions)
        for d in descriptions:
            assert f"{d.pool.name.value}={d.host_memory}" in str(info.value)
    else:
        group = HostGroupPlan.assemble(descriptions)
        assert {group.memory_of(p) for p in group.pools} == {kinds[0]}


FULL, SLIDING = LayerKind.FULL_ATTENTION, LayerKind.SLIDING_ATTENTION
LINEAR, MAMBA, NONE = LayerKind.LINEAR_ATTENTION, LayerKind.MAMBA, LayerKind.NONE


@st.composite
def model_specs(draw: st.DrawFn) -> ModelSpec:
    state_kind = draw(st.sampled_from([None, LINEAR, MAMBA]))
    swa = draw(st.booleans())
    choices = [FULL, NONE] + ([SLIDING] if swa else []) + ([state_kind] if state_kind else [])
    kinds = draw(st.lists(st.sampled_from(choices), min_size=1, max_size=64))
    kinds[draw(st.integers(0, len(kinds) - 1))] = FULL
    swa = SLIDING in kinds  # a spec part that no layer uses is an error
    if state_kind not in kinds:
        state_kind = None
    state: Mamba2Spec | GatedDeltaNetSpec | None = None
    if state_kind is MAMBA:
        state = Mamba2Spec(
            heads=draw(st.sampled_from([4, 8, 16])),
            head_dim=draw(st.sampled_from([16, 64])),
            state_size=draw(st.sampled_from([16, 128])),
            n_groups=draw(st.sampled_from([1, 2, 8])),
            conv_kernel=4,
        )
    elif state_kind is LINEAR:
        state = GatedDeltaNetSpec(
            key_heads=draw(st.sampled_from([4, 16])),
            value_heads=draw(st.sampled_from([4, 32])),
            key_dim=128,
            value_dim=draw(st.sampled_from([64, 128])),
            conv_kernel=4,
        )
    indexer = None
    if state is None and not swa and draw(st.booleans()):
        indexer = IndexerSpec(heads=draw(st.sampled_from([1, 4])), head_dim=128)
    return ModelSpec(
        model_type="random",
        layer_kinds=kinds,
        attention=AttentionSpec(
            kv_heads=draw(st.sampled_from([1, 2, 4, 8])), head_dim=draw(st.sampled_from([64, 128]))
        ),
        sliding_window=128 if swa else None,
        state=state,
        indexer=indexer,
    )


@FAST
@given(
    spec=model_specs(),
    tp=st.sampled_from([1, 2, 4]),
    page_size=st.integers(1, 128),
    device_pages=st.integers(1, 2000),
    device_slots=st.integers(4, 512),
    ratio=st.floats(0.5, 4.0),
    budget_mode=st.booleans(),
)
def test_every_plan_has_whole_page_capacities_and_compact_transfer_layers(
    spec: ModelSpec,
    tp: int,
    page_size: int,
    device_pages: int,
    device_slots: int,
    ratio: float,
    budget_mode: bool,
) -> None:
    device_tokens = max(device_pages, 1024 // page_size + 1) * page_size  # whole pages only
    base = PlanSettings(
        tp_size=tp, page_size=page_size, device_tokens=device_tokens, device_slots=device_slots
    )
    if budget_mode:
        device_bytes = plan_stack(spec, base).nbytes // 2  # ratio 2.0 doubles the device bytes
        budget = max(1, int(device_bytes * ratio))
        s = PlanSettings(
            tp_size=tp,
            page_size=page_size,
            device_tokens=device_tokens,
            device_slots=device_slots,
            sizing=BudgetSizing(budget),
        )
    else:
        s = PlanSettings(
            tp_size=tp,
            page_size=page_size,
            device_tokens=device_tokens,
            device_slots=device_slots,
            sizing=RatioSizing(ratio),
        )
    try:
        plan = plan_stack(spec, s)
    except SizingError:
        reject()
    for p in plan.pools:
        assert p.capacity > 0
        assert p.capacity % p.page_size == 0
        if p.role is PoolRole.SIDECAR:
            assert (p.capacity, p.page_size) == (plan.anchor.capacity, plan.anchor.page_size)
    if budget_mode:
        assert plan.nbytes <= budget
    cached = [i for i, k in enumerate(spec.layer_kinds) if k is not NONE]
    assert plan.transfer_layers == len(cached)
    assert transfer_layer_count(p.binding for p in plan.pools) == plan.transfer_layers
    assert plan.model_layers == tuple(cached)
    pool_kind = {"kv": {FULL}, "indexer": {FULL}, "swa": {SLIDING}, "mamba": {LINEAR, MAMBA}}
    for p in plan.pools:
        # every pool layer is bound, to a transfer layer whose model layer has the pool's kind
        assert sorted(p.binding.as_dict().values()) == list(range(p.layers))
        model_kinds = {spec.layer_kinds[cached[t]] for t in p.binding.transfer_layers}
        assert model_kinds <= pool_kind[p.name.value]
