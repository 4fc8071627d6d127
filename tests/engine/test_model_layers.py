"""The forward pass asks by model layer id; the plan maps it to transfer layers and pool buffers."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from hicache.domain import ConfigError, GroupError, ModelSpec, PoolName, plan_stack
from tests.engine.fakes import Rig, hybrid_plan

KV, MAMBA = PoolName.KV, PoolName.MAMBA


def test_nemotron_h_maps_52_model_layers_onto_28_transfer_layers(fixtures_dir: Path) -> None:
    config = json.loads((fixtures_dir / "nemotron-h-8b-base-8k.json").read_text())
    plan = plan_stack(ModelSpec.from_hf_config(config))
    pattern = config["hybrid_override_pattern"]
    assert len(pattern) == 52
    assert plan.transfer_layers == 28
    seen = []
    for model_layer, kind in enumerate(pattern):
        transfer = plan.transfer_layer_of(model_layer)
        if kind == "-":  # MLP only: no cache
            assert transfer is None
            continue
        assert transfer is not None
        seen.append(transfer)
        assert plan.model_layer_of(transfer) == model_layer
        pool = PoolName.KV if kind == "*" else PoolName.MAMBA
        other = PoolName.MAMBA if kind == "*" else PoolName.KV
        index = plan.pool_layer_of(pool, model_layer)
        assert index == plan.pool(pool).binding.pool_layer(transfer)
        assert plan.pool_layer_of(other, model_layer) is None
    assert seen == list(range(28))
    assert plan.pool_layer_of(PoolName.KV, 7) == 0
    assert plan.pool_layer_of(PoolName.KV, 40) == 3
    with pytest.raises(ConfigError, match="transfer layer 28 is out of range"):
        plan.model_layer_of(28)
    with pytest.raises(ConfigError, match="non-negative integer"):
        plan.transfer_layer_of(-1)


def test_a_plan_without_model_layers_numbers_them_as_transfer_layers() -> None:
    plan = hybrid_plan()
    assert plan.cached_model_layers == tuple(range(plan.transfer_layers))
    assert plan.transfer_layer_of(3) == 3
    assert plan.transfer_layer_of(6) is None
    with pytest.raises(GroupError, match="names a model layer twice"):
        attrs.evolve(plan, model_layers=(0, 1, 1, 2, 3, 4))


@pytest.mark.asyncio
async def test_the_forward_pass_waits_and_reports_by_model_layer_id() -> None:
    # 6 transfer layers spread over 9 model layers (MLP-only layers 1, 4, 8 hold no cache).
    plan = attrs.evolve(hybrid_plan(), model_layers=(0, 2, 3, 5, 6, 7))
    rig = Rig(plan)
    try:
        async with rig.engine as engine:
            host = rig.host_prefix("m", {KV: 1, MAMBA: 1})
            handle = await engine.load(host)
            for model_layer in (0, 2, 3, 5, 6, 7):
                handle.wait_model_layer(model_layer)
                layer = plan.transfer_layer_of(model_layer)
                assert layer is not None
                assert rig.layer_ok(layer, host, handle.device_pages)
            with pytest.raises(ConfigError, match="model layer 4 holds no cache"):
                handle.wait_model_layer(4)
            await handle.wait_model_layer_ready(7)
            await handle.wait()
            backup = engine.prepare_backup(handle.device_pages, layerwise=True)
            engine.submit()
            for model_layer in plan.cached_model_layers:
                backup.model_layer_computed(model_layer)  # type: ignore[attr-defined]
            await backup.wait()
            assert rig.backed_up(handle.device_pages, backup.host_pages)
            engine.free_device(handle.device_pages)
    finally:
        rig.close_streams()
