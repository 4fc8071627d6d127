"""Stack planning: every archetype, specs built in Python, pipeline stages, layouts per pool."""

from __future__ import annotations

import attrs
import pytest

from hicache.domain import (
    Archetype,
    AttentionSpec,
    BudgetSizing,
    ConfigError,
    DType,
    GatedDeltaNetSpec,
    HitPolicy,
    IndexerSpec,
    LayerKind,
    Layout,
    LayoutError,
    Mamba2Spec,
    MLASpec,
    ModelSpec,
    PlanSettings,
    PoolName,
    PoolRole,
    RatioSizing,
    StorageSettings,
    Unit,
    archetype_of,
    plan_stack,
)

FULL = LayerKind.FULL_ATTENTION
SLIDING = LayerKind.SLIDING_ATTENTION
LINEAR = LayerKind.LINEAR_ATTENTION
MAMBA = LayerKind.MAMBA
NONE = LayerKind.NONE

DENSE = ModelSpec(
    model_type="dense",
    layer_kinds=[FULL] * 4,
    attention=AttentionSpec(kv_heads=8, head_dim=128),
)
MLA = ModelSpec(
    model_type="mla",
    layer_kinds=[FULL] * 3,
    attention=MLASpec(kv_lora_rank=512, qk_rope_head_dim=64),
)
SWA = ModelSpec(
    model_type="swa",
    layer_kinds=[SLIDING, FULL] * 2,
    attention=AttentionSpec(kv_heads=8, head_dim=64),
    sliding_window=128,
)
KV_MAMBA = ModelSpec(
    model_type="kv_mamba",
    layer_kinds=[MAMBA, NONE, FULL, MAMBA],
    attention=AttentionSpec(kv_heads=8, head_dim=128),
    state=Mamba2Spec(heads=128, head_dim=64, state_size=128, n_groups=8, conv_kernel=4),
)
# Qwen3.5-style: Gated DeltaNet, sliding-window and full-attention layers in one stack.
QWEN35_LIKE = ModelSpec(
    model_type="qwen3_5_like",
    layer_kinds=[LINEAR, SLIDING, LINEAR, FULL] * 2,
    attention=AttentionSpec(kv_heads=2, head_dim=256),
    sliding_window=4096,
    state=GatedDeltaNetSpec(
        key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv_kernel=4
    ),
)
# MiniMax-style sparse attention: MHA plus a K-only indexer in a plain dtype on every layer.
MINIMAX_LIKE = ModelSpec(
    model_type="minimax_like",
    layer_kinds=[FULL] * 4,
    attention=AttentionSpec(kv_heads=8, head_dim=128),
    indexer=IndexerSpec(heads=4, head_dim=128, dtype=DType.BF16),
)
# DeepSeek-V3.2-style: MLA plus an fp8 block-scaled indexer.
MLA_INDEXER = ModelSpec(
    model_type="mla_indexer",
    layer_kinds=[FULL] * 3,
    attention=MLASpec(kv_lora_rank=512, qk_rope_head_dim=64),
    indexer=IndexerSpec(heads=1, head_dim=128, dtype=DType.FP8_E4M3, scale_block=128),
)

SMALL = PlanSettings(page_size=16, device_tokens=1024, device_slots=8)


def summary(spec: ModelSpec, settings: PlanSettings = SMALL) -> dict[str, tuple]:
    plan = plan_stack(spec, settings)
    return {
        p.name.value: (p.role.value, p.layers, p.bytes_per_unit_per_layer, p.binding.as_dict())
        for p in plan.pools
    }


@pytest.mark.parametrize(
    ("spec", "archetype"),
    [
        (DENSE, Archetype.DENSE_KV),
        (MLA, Archetype.MLA),
        (SWA, Archetype.KV_SWA),
        (KV_MAMBA, Archetype.KV_STATE),
        (QWEN35_LIKE, Archetype.KV_SWA_STATE),
        (MINIMAX_LIKE, Archetype.KV_INDEXER),
        (MLA_INDEXER, Archetype.KV_INDEXER),
    ],
)
def test_archetype_of_each_stack(spec: ModelSpec, archetype: Archetype) -> None:
    assert archetype_of(spec) is archetype
    assert plan_stack(spec, SMALL).archetype == archetype.value


def test_dense_kv() -> None:
    assert summary(DENSE) == {
        "kv": ("anchor", 4, 2 * 8 * 128 * 2, {0: 0, 1: 1, 2: 2, 3: 3}),
    }


def test_mla() -> None:
    assert summary(MLA) == {"kv": ("anchor", 3, (512 + 64) * 2, {0: 0, 1: 1, 2: 2})}


def test_kv_swa() -> None:
    assert summary(SWA) == {
        "kv": ("anchor", 2, 2 * 8 * 64 * 2, {1: 0, 3: 1}),
        "swa": ("independent", 2, 2 * 8 * 64 * 2, {0: 0, 2: 1}),
    }
    plan = plan_stack(SWA, SMALL)
    assert plan.pool("swa").hit_policy is HitPolicy.TRAILING_PAGES
    assert plan.pool("kv").hit_policy is HitPolicy.ALL_PAGES


def test_kv_state_skips_layers_without_cache() -> None:
    conv = (128 * 64 + 2 * 8 * 128) * 3 * 2
    temporal = 128 * 64 * 128 * 4
    # model layers 0, 2, 3 keep a cache; layer 1 (MLP only) gets no transfer layer
    assert summary(KV_MAMBA) == {
        "kv": ("anchor", 1, 2 * 8 * 128 * 2, {1: 0}),
        "mamba": ("independent", 2, conv + temporal, {0: 0, 2: 1}),
    }
    plan = plan_stack(KV_MAMBA, SMALL)
    assert plan.transfer_layers == 3
    assert plan.model_layers == (0, 2, 3)
    mamba = plan.pool("mamba")
    assert (mamba.unit, mamba.page_size, mamba.capacity) == (Unit.SLOT, 1, 16)
    assert mamba.hit_policy is HitPolicy.TRAILING_PAGES


def test_kv_swa_state_from_a_python_spec() -> None:
    assert summary(QWEN35_LIKE) == {
        "kv": ("anchor", 2, 2 * 2 * 256 * 2, {3: 0, 7: 1}),
        "swa": ("independent", 2, 2 * 2 * 256 * 2, {1: 0, 5: 1}),
        "mamba": (
            "independent",
            4,
            (2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4,
            {0: 0, 2: 1, 4: 2, 6: 3},
        ),
    }
    tp2 = summary(QWEN35_LIKE, PlanSettings(tp_size=2, page_size=16, device_tokens=1024))
    assert tp2["kv"][2] == 2 * 1 * 256 * 2
    assert tp2["mamba"][2] == (2 * 8 * 128 + 16 * 128) * 3 * 2 + 16 * 128 * 128 * 4


def test_mha_plus_k_only_plain_indexer_from_a_python_spec() -> None:
    s = summary(MINIMAX_LIKE)
    layers = {0: 0, 1: 1, 2: 2, 3: 3}
    assert s == {
        "kv": ("anchor", 4, 2 * 8 * 128 * 2, layers),
        "indexer": ("sidecar", 4, 4 * 128 * 2, layers),  # K only: no V
    }
    plan = plan_stack(MINIMAX_LIKE, SMALL)
    kv, ix = plan.pool("kv"), plan.pool("indexer")
    assert (ix.page_size, ix.capacity) == (kv.page_size, kv.capacity)


def test_mla_plus_fp8_indexer() -> None:
    s = summary(MLA_INDEXER)
    assert s["kv"] == ("anchor", 3, 1152, {0: 0, 1: 1, 2: 2})
    assert s["indexer"] == ("sidecar", 3, 128 + 4, {0: 0, 1: 1, 2: 2})


def test_sidecar_bytes_count_in_the_budget_split() -> None:
    plan = plan_stack(MINIMAX_LIKE, PlanSettings(page_size=16, sizing=BudgetSizing(10_000_000)))
    per_token = (4096 + 1024) * 4
    assert plan.pool("kv").capacity == 10_000_000 // (16 * per_token) * 16
    assert plan.nbytes <= 10_000_000


def test_indexer_with_state_is_no_archetype() -> None:
    spec = ModelSpec(
        model_type="odd",
        layer_kinds=[FULL, MAMBA],
        attention=AttentionSpec(kv_heads=2, head_dim=8),
        state=Mamba2Spec(heads=2, head_dim=4, state_size=4, n_groups=1, conv_kernel=4),
        indexer=IndexerSpec(heads=1, head_dim=8),
    )
    with pytest.raises(ConfigError, match="an indexer with sliding or state layers"):
        archetype_of(spec)


def test_ratio_capacities_and_device_capacities() -> None:
    plan = plan_stack(
        QWEN35_LIKE,
        PlanSettings(page_size=16, device_tokens=1008, device_slots=5, swa_tokens=208),
    )
    # 1008 x 2 / 16 = 126 pages; 208 x 2 / 16 = 26 pages; 5 x 2 slots
    assert plan.pool("kv").capacity == 2016
    assert plan.pool("swa").capacity == 416
    assert plan.pool("mamba").capacity == 10
    assert plan.pool("kv").device_capacity == 1008
    assert plan.pool("swa").device_capacity == 208
    assert plan.pool("mamba").device_capacity == 5
    plan3 = plan_stack(QWEN35_LIKE, PlanSettings(page_size=16, sizing=RatioSizing(3.0)))
    assert plan3.pool("kv").capacity == 65536 * 3


def test_defaults_match_the_command_line() -> None:
    s = PlanSettings()
    assert (s.tp_size, s.pp_size, s.page_size, s.layout) == (1, 1, 64, Layout.PAGE_FIRST_DIRECT)
    assert (s.device_tokens, s.device_slots, s.sizing) == (65536, 256, RatioSizing(2.0))
    plan = plan_stack(DENSE)
    assert plan.pool("kv").capacity == 131072
    assert plan.host_memory.kind.name == "anonymous"


def test_pipeline_stage_uses_stage_local_ids() -> None:
    spec = ModelSpec(
        model_type="hybrid",
        layer_kinds=[LINEAR, LINEAR, LINEAR, FULL] * 4,
        attention=AttentionSpec(kv_heads=2, head_dim=64),
        state=GatedDeltaNetSpec(key_heads=2, value_heads=2, key_dim=8, value_dim=8, conv_kernel=4),
    )
    plan = plan_stack(spec, PlanSettings(pp_size=2, pp_rank=1, page_size=16))
    assert plan.stage == (8, 16)
    # global full-attention layers 11 and 15 are stage-local 3 and 7
    assert plan.pool("kv").binding.as_dict() == {3: 0, 7: 1}
    assert plan.pool("mamba").binding.as_dict() == {0: 0, 1: 1, 2: 2, 4: 3, 5: 4, 6: 5}
    assert plan.model_layers == tuple(range(8))
    assert plan.transfer_layers == 8


def test_a_stage_without_full_attention_cannot_anchor_a_group() -> None:
    with pytest.raises(ConfigError, match=r"stage \[0, 2\) of 'kv_mamba' has no full-attention"):
        plan_stack(KV_MAMBA, PlanSettings(pp_size=2, pp_rank=0))
    spec = ModelSpec(
        model_type="sparse",
        layer_kinds=[FULL, NONE, NONE],
        attention=AttentionSpec(kv_heads=2, head_dim=8),
    )
    with pytest.raises(ConfigError, match=r"stage \[1, 2\) of 'sparse' caches nothing"):
        plan_stack(spec, PlanSettings(pp_size=3, pp_rank=1))


def test_a_second_stage_of_a_model_with_mlp_only_layers() -> None:
    plan = plan_stack(KV_MAMBA, PlanSettings(pp_size=2, pp_rank=1, page_size=16))
    # stage [2, 4) holds FULL, MAMBA: stage-local ids 0 and 1
    assert plan.model_layers == (0, 1)
    assert plan.pool("kv").binding.as_dict() == {0: 0}
    assert plan.pool("mamba").binding.as_dict() == {1: 0}


def test_one_layout_for_all_pools_or_one_per_pool() -> None:
    with pytest.raises(LayoutError, match="pool 'mamba' holds recurrent state"):
        plan_stack(QWEN35_LIKE, PlanSettings(layout="page_head"))
    plan = plan_stack(
        QWEN35_LIKE, PlanSettings(layout="page_head", pool_layouts={"mamba": "page_first_direct"})
    )
    assert {p.name.value: p.layout for p in plan.pools} == {
        "kv": Layout.PAGE_HEAD,
        "swa": Layout.PAGE_HEAD,
        "mamba": Layout.PAGE_FIRST_DIRECT,
    }
    assert plan.as_json()["layout"] == "page_head"


@pytest.mark.parametrize(
    "settings",
    [
        PlanSettings(pool_layouts={"mamba": "page_first"}),
        PlanSettings(capacity_overrides={"swa": 128}, page_size=64),
    ],
)
def test_per_pool_settings_for_a_pool_the_model_lacks_are_refused(settings: PlanSettings) -> None:
    with pytest.raises(ConfigError, match=r"names pools \['(mamba|swa)'\], which model 'dense'"):
        plan_stack(DENSE, settings)


def test_per_pool_settings_for_a_pool_only_other_stages_hold_are_accepted() -> None:
    """Every pipeline stage may be given the same settings; a stage uses what it holds."""
    spec = ModelSpec(
        model_type="late_swa",
        layer_kinds=[FULL, FULL, SLIDING, FULL],
        attention=AttentionSpec(kv_heads=2, head_dim=64),
        sliding_window=128,
    )
    settings = PlanSettings(
        pp_size=2,
        page_size=16,
        pool_layouts={"swa": "layer_first"},
        capacity_overrides={"swa": 64},
    )
    first = plan_stack(spec, attrs.evolve(settings, pp_rank=0))
    assert [p.name.value for p in first.pools] == ["kv"]
    second = plan_stack(spec, attrs.evolve(settings, pp_rank=1))
    assert second.pool("swa").layout is Layout.LAYER_FIRST
    assert second.pool("swa").capacity == 64


def test_page_head_cannot_hold_mla() -> None:
    with pytest.raises(LayoutError, match=r"pool 'kv' \(mla\) has buffers \['kv'\] without a head"):
        plan_stack(MLA, PlanSettings(layout=Layout.PAGE_HEAD))


def test_layer_first_with_mooncake_is_an_error_not_a_rewrite() -> None:
    settings = PlanSettings(layout="layer_first", storage=StorageSettings("mooncake"))
    with pytest.raises(LayoutError, match="storage backend 'mooncake' moves whole pages"):
        plan_stack(DENSE, settings)
    plan = plan_stack(DENSE, PlanSettings(layout="layer_first"))
    assert plan.pool("kv").layout is Layout.LAYER_FIRST


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tp_size": 0}, "tp_size must be a positive integer"),
        ({"page_size": 0}, "page_size must be a positive integer"),
        ({"device_tokens": -1}, "device_tokens must be a positive integer"),
        ({"swa_tokens": 0}, "swa_tokens must be a positive integer"),
        ({"layout": "diagonal"}, "unknown layout 'diagonal'"),
        ({"pool_layouts": {"ssm": "page_first"}}, "unknown pool name 'ssm'"),
        ({"pinned": "maybe"}, "unknown pinning 'maybe'"),
    ],
)
def test_bad_settings(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PlanSettings(**kwargs)  # type: ignore[arg-type]


def test_sidecars_cannot_be_overridden() -> None:
    with pytest.raises(ConfigError, match="'indexer' is a sidecar and takes the anchor's capacity"):
        plan_stack(MINIMAX_LIKE, PlanSettings(capacity_overrides={"indexer": 64}))


def test_the_plan_records_where_it_came_from() -> None:
    plan = plan_stack(QWEN35_LIKE, PlanSettings(tp_size=2, pinned=False))
    assert (plan.model_type, plan.tp_size, plan.stage) == ("qwen3_5_like", 2, (0, 8))
    assert plan.host_memory.as_json() == {"kind": "anonymous", "pinned": False}
    assert [p.role for p in plan.pools] == [
        PoolRole.ANCHOR,
        PoolRole.INDEPENDENT,
        PoolRole.INDEPENDENT,
    ]
    assert [p.name for p in plan.pools] == [PoolName.KV, PoolName.SWA, PoolName.MAMBA]
