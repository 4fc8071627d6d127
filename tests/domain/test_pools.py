"""Pool plans and the host group plan: one host memory per group, its invariants, assemble()."""

from __future__ import annotations

import attrs
import pytest

from hicache.domain import (
    AllocatorMismatchError,
    ConfigError,
    GroupError,
    HiCacheError,
    HostGroupPlan,
    HostMemory,
    LayerBinding,
    Layout,
    LayoutError,
    MemoryKind,
    Pinning,
    PoolDescription,
    PoolName,
    PoolPlan,
    PoolRole,
)
from tests.domain.builders import ANON, KV, MOONCAKE, SHM, STATE, anchor, pool, sidecar, state_pool


def test_a_pool_plan_has_no_way_to_name_a_memory_kind() -> None:
    fields = attrs.fields_dict(PoolPlan)
    assert not any("memory" in name or "alloc" in name for name in fields)
    with pytest.raises(TypeError):
        PoolPlan(  # type: ignore[call-arg]
            name=PoolName.KV,
            role=PoolRole.ANCHOR,
            geometry=KV,
            binding=LayerBinding.contiguous([0]),
            layout=Layout.PAGE_FIRST,
            page_size=16,
            capacity=64,
            host_memory=SHM,
        )


def test_pool_plan_sizes() -> None:
    p = anchor(transfer=[0, 1, 2], page_size=16, capacity=64)
    per_layer = 2 * 2 * 64 * 2  # K and V, 2 heads, head_dim 64, bf16
    assert p.bytes_per_unit_per_layer == per_layer
    assert p.layers == 3
    assert p.pages == 4
    assert p.bytes_per_unit == per_layer * 3
    assert p.bytes_per_page == per_layer * 3 * 16
    assert p.nbytes == per_layer * 3 * 64
    assert p.host_buffer_shapes() == {"k": (64, 3, 2, 64), "v": (64, 3, 2, 64)}
    assert p.with_capacity(128).nbytes == 2 * p.nbytes


def test_state_pools_have_page_size_one() -> None:
    with pytest.raises(ConfigError, match="page size is 1; got page_size=16"):
        state_pool(page_size=16, capacity=64)


def test_capacity_must_be_whole_pages() -> None:
    with pytest.raises(ConfigError, match="capacity 70 is not a whole number of pages of 16"):
        anchor(capacity=70)


def test_a_pool_plan_checks_its_layout() -> None:
    with pytest.raises(LayoutError, match="recurrent state"):
        state_pool(layout=Layout.LAYER_FIRST)


def test_pool_name_parse() -> None:
    assert PoolName.parse("SWA") is PoolName.SWA
    with pytest.raises(ConfigError, match=r"unknown pool name 'ssm'.*kv, swa, mamba, indexer"):
        PoolName.parse("ssm")


def test_the_group_holds_one_host_memory_that_every_pool_answers() -> None:
    g = HostGroupPlan(host_memory=SHM, pools=[anchor(), sidecar(), state_pool()])
    assert {g.memory_of(p) for p in g.pools} == {SHM}
    assert g.memory_of("mamba") == SHM
    assert all(p["host_memory"] == {"kind": "shm", "pinned": "auto"} for p in g.as_json()["pools"])


def test_exactly_one_anchor() -> None:
    with pytest.raises(GroupError, match="exactly one anchor pool, got 0"):
        HostGroupPlan(host_memory=ANON, pools=[state_pool(transfer=[0, 1])])
    two = pool(PoolName.SWA, PoolRole.ANCHOR, transfer=[2])
    with pytest.raises(GroupError, match=r"exactly one anchor pool, got 2: \['kv', 'swa'\]"):
        HostGroupPlan(host_memory=ANON, pools=[anchor(), two])


def test_pool_names_are_unique() -> None:
    again = pool(PoolName.KV, PoolRole.INDEPENDENT, transfer=[2])
    with pytest.raises(GroupError, match=r"unique in a group, got \['kv'\] more than once"):
        HostGroupPlan(host_memory=ANON, pools=[anchor(), again])


def test_the_anchor_holds_tokens() -> None:
    slots = pool(PoolName.KV, PoolRole.ANCHOR, geometry=STATE, page_size=1, capacity=8)
    with pytest.raises(GroupError, match="anchor pool 'kv' must hold tokens"):
        HostGroupPlan(host_memory=ANON, pools=[slots])


@pytest.mark.parametrize(("page_size", "capacity"), [(32, 64), (16, 128)])
def test_sidecars_take_the_anchors_page_size_and_capacity(page_size: int, capacity: int) -> None:
    odd = sidecar(page_size=page_size, capacity=capacity)
    with pytest.raises(GroupError, match=r"sidecar 'indexer' borrows.*\(16, 64\)"):
        HostGroupPlan(host_memory=ANON, pools=[anchor(), odd])


def test_a_sidecar_cannot_hold_slots() -> None:
    slots = pool(PoolName.DRAFT, PoolRole.SIDECAR, geometry=STATE, page_size=1, capacity=8)
    with pytest.raises(GroupError, match="sidecar 'draft' must hold tokens"):
        HostGroupPlan(host_memory=ANON, pools=[anchor(), slots])


def test_transfer_layers_are_numbered_over_the_union() -> None:
    with pytest.raises(GroupError, match=r"numbered 0..n-1 .* got \[0, 1, 5\]"):
        HostGroupPlan(host_memory=ANON, pools=[anchor(), state_pool(transfer=[5])])
    g = HostGroupPlan(
        host_memory=ANON, pools=[anchor(transfer=[1, 3]), state_pool(transfer=[0, 2])]
    )
    assert g.transfer_layers == 4


def test_model_layers_map_every_transfer_layer() -> None:
    with pytest.raises(GroupError, match="model_layers has 3 entries for 2 transfer layers"):
        HostGroupPlan(host_memory=ANON, pools=[anchor()], model_layers=(0, 1, 2))


def test_group_lookups_and_order() -> None:
    g = HostGroupPlan(host_memory=ANON, pools=[sidecar(), state_pool(), anchor()])
    assert g.anchor.name is PoolName.KV
    assert g.pool("indexer").role is PoolRole.SIDECAR
    assert [p.name for p in g.independent_pools()] == [PoolName.KV, PoolName.MAMBA]
    assert g.nbytes == sum(p.nbytes for p in g.pools)
    with pytest.raises(GroupError, match=r"no pool 'swa' in this group"):
        g.pool(PoolName.SWA)


def test_assemble_with_one_kind_keeps_it() -> None:
    descriptions = [PoolDescription(p, SHM) for p in (anchor(), sidecar(), state_pool())]
    g = HostGroupPlan.assemble(descriptions, model_layers=[0, 2, 4, 6], model_type="x")
    assert g.host_memory == SHM
    assert [p.name for p in g.pools] == [PoolName.KV, PoolName.INDEXER, PoolName.MAMBA]
    assert g.model_layers == (0, 2, 4, 6)


def test_assemble_with_mixed_kinds_lists_every_pool_and_its_kind() -> None:
    # The reference engine's bug: the anchor on shm, the side pools on anonymous memory.
    descriptions = [
        PoolDescription(anchor(), SHM),
        PoolDescription(sidecar(), ANON),
        PoolDescription(state_pool(), MOONCAKE),
    ]
    with pytest.raises(AllocatorMismatchError) as info:
        HostGroupPlan.assemble(descriptions)
    msg = str(info.value)
    assert "kv=shm" in msg
    assert "indexer=anonymous" in msg
    assert "mamba=store:mooncake" in msg
    assert isinstance(info.value, GroupError)
    assert isinstance(info.value, HiCacheError)


def test_assemble_rejects_the_same_kind_pinned_differently() -> None:
    pinned = HostMemory(MemoryKind("shm"), Pinning.ON)
    with pytest.raises(AllocatorMismatchError, match=r"kv=shm\(pinned=on\)"):
        HostGroupPlan.assemble([PoolDescription(anchor(), pinned), PoolDescription(sidecar(), SHM)])


def test_assemble_needs_a_pool() -> None:
    with pytest.raises(GroupError, match="at least one pool"):
        HostGroupPlan.assemble([])


def test_assemble_still_checks_the_group_invariants() -> None:
    with pytest.raises(GroupError, match="exactly one anchor"):
        HostGroupPlan.assemble([PoolDescription(state_pool(transfer=[0, 1]), SHM)])
