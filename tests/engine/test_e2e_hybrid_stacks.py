"""Byte-exact round trips of today's hybrid stacks on the real CPU adapters.

A parallel hybrid (Falcon-H1's shape: attention and Mamba2 state on the same layers), Inkling's
shape (short-conv state on every layer beside full or sliding attention) and an indexer on a
subset of the layers (MiniMax-M3's shape) are planned, materialised, backed up, poisoned on the
device and loaded back layer by layer; every byte of every pool comes back.
"""

from __future__ import annotations

import pytest

from hicache.bootstrap.runtime import open_runtime
from hicache.domain import (
    AttentionSpec,
    DType,
    HostGroupPlan,
    IndexerSpec,
    LayerKind,
    Mamba2Spec,
    ModelSpec,
    PlanSettings,
    PoolName,
    ShortConvSpec,
    plan_stack,
)
from hicache.engine import OperationState
from tests.engine.device_bytes import layer_matches, poison, write_device

FULL, SLIDING = LayerKind.FULL_ATTENTION, LayerKind.SLIDING_ATTENTION
SMALL = PlanSettings(page_size=4, device_tokens=32, device_slots=4)

PARALLEL_HYBRID = ModelSpec(
    model_type="parallel_hybrid",
    layer_kinds=[FULL] * 4,
    attention=AttentionSpec(kv_heads=2, head_dim=8),
    state=Mamba2Spec(heads=2, head_dim=4, state_size=4, n_groups=1, conv_kernel=4),
    state_layers=range(4),
)
CONV_ON_EVERY_LAYER = ModelSpec(
    model_type="sliding_and_conv",
    layer_kinds=[SLIDING, FULL, SLIDING, SLIDING, FULL],
    attention=AttentionSpec(kv_heads=2, head_dim=8),
    sliding_window=8,
    sliding_attention=AttentionSpec(kv_heads=4, head_dim=8),
    state=ShortConvSpec(
        kv_heads=2, head_dim=8, swa_kv_heads=4, swa_head_dim=8, hidden_size=16, conv_kernel=4
    ),
    state_layers=range(5),
)
INDEXER_SUBSET = ModelSpec(
    model_type="indexer_subset",
    layer_kinds=[FULL] * 5,
    attention=AttentionSpec(kv_heads=2, head_dim=8),
    indexer=IndexerSpec(heads=1, head_dim=16, dtype=DType.BF16),
    indexer_layers=[2, 3, 4],
)
PLANS = {
    "parallel_hybrid": plan_stack(PARALLEL_HYBRID, SMALL),
    "conv_on_every_layer": plan_stack(CONV_ON_EVERY_LAYER, SMALL),
    "indexer_subset": plan_stack(INDEXER_SUBSET, SMALL),
}


def test_the_plans_bind_what_each_layer_holds() -> None:
    p = PLANS["parallel_hybrid"]
    assert p.pool("kv").binding == p.pool("mamba").binding
    ix = PLANS["indexer_subset"].pool("indexer")
    assert ix.binding.as_dict() == {2: 0, 3: 1, 4: 2}
    assert ix.capacity == PLANS["indexer_subset"].anchor.capacity
    c = PLANS["conv_on_every_layer"]
    assert c.pool("mamba").binding.as_dict() == {t: t for t in range(5)}
    assert c.pool("swa").binding.as_dict() == {0: 0, 2: 1, 3: 2}


@pytest.mark.asyncio
@pytest.mark.parametrize("name", sorted(PLANS))
async def test_back_up_evict_and_load_back_every_byte(name: str) -> None:
    plan: HostGroupPlan = PLANS[name]
    owners = {p.name for p in plan.independent_pools()}
    counts = {n: (1 if n is PoolName.MAMBA else 2) for n in owners}
    async with open_runtime(plan, device="cpu", backend="torch") as rt:
        engine = rt.engine
        device = rt.device_slots.allocate(counts).pages
        written = write_device(rt, device, seed=7)
        backup = await engine.backup(device)
        await backup.wait()
        host = backup.host_pages
        engine.free_device(device)
        poison(rt)
        async with await engine.load(host) as handle:
            for layer in range(plan.transfer_layers):
                handle.wait_layer(layer)
                assert layer_matches(rt, layer, written, device, handle.device_pages), layer
        assert handle.state is OperationState.DONE
        engine.free_device(handle.device_pages)
        engine.free_host(host)
        assert len(engine.host_pins) == len(engine.device_pins) == 0
        # every written byte was compared: each pool's buffers over each of its layers
        assert {k[0] for k in written} == {p.name for p in plan.pools}
    assert rt.closed
