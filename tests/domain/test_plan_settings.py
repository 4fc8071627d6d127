"""PlanSettings checks every field's type and value, converts the strings the CLI accepts, and
refuses device capacities that are not whole pages; model specs refuse parts no layer uses."""

from __future__ import annotations

from typing import Any

import pytest

from hicache.domain import (
    AttentionSpec,
    BudgetSizing,
    ConfigError,
    DType,
    GatedDeltaNetSpec,
    IndexerSpec,
    KimiDeltaSpec,
    LayerKind,
    Layout,
    Mamba2Spec,
    ModelSpec,
    Pinning,
    PlanSettings,
    PoolName,
    PPSplit,
    StorageSettings,
    plan_stack,
)

FULL, SLIDING = LayerKind.FULL_ATTENTION, LayerKind.SLIDING_ATTENTION
LINEAR, MAMBA = LayerKind.LINEAR_ATTENTION, LayerKind.MAMBA
ATTN = AttentionSpec(kv_heads=2, head_dim=8)
GDN = GatedDeltaNetSpec(key_heads=2, value_heads=2, key_dim=8, value_dim=8, conv_kernel=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kv_dtype": "fp7"}, "unknown dtype 'fp7'"),
        ({"kv_dtype": 8}, "kv_dtype must be a DType or its name, got 8"),
        ({"ssm_dtype": None}, "ssm_dtype must be a DType or its name, got None"),
        ({"sizing": 2.0}, "sizing must be a RatioSizing or a BudgetSizing, got 2.0"),
        ({"storage": 5}, "storage must be a StorageSettings"),
        ({"tp_size": 2.0}, "tp_size must be a positive integer, got 2.0"),
        ({"tp_size": True}, "tp_size must be a positive integer, got True"),
        ({"pp_rank": -1}, "pp_rank must be a non-negative integer"),
        ({"pp_size": 2, "pp_rank": 2}, r"pp_rank must be in \[0, 2\), got 2"),
        ({"pp_split": "megatron"}, "pp_split must be 'vllm' or 'sglang', got 'megatron'"),
        ({"pp_start": 3}, "pp_start and pp_end come together"),
        ({"pp_start": 4, "pp_end": 4}, r"pp_start must be below pp_end, got \[4, 4\)"),
        ({"pp_end": "8", "pp_start": 0}, "pp_end must be a positive integer"),
        ({"layout": 3}, "layout must be a Layout or its name, got 3"),
        ({"pool_layouts": ["kv"]}, "pool_layouts must be a mapping"),
        ({"capacity_overrides": {"kv": "64"}}, r"capacity_overrides\['kv'\] must be an integer"),
        ({"pinned": 1.5}, "pinned must be a Pinning"),
        ({"device_slots": "8"}, "device_slots must be a positive integer"),
        (
            {"device_tokens": 1000},
            "device_tokens=1000 is not a whole number of pages of 64 tokens; use 960 or 1024",
        ),
        (
            {"device_tokens": 48},
            "device_tokens=48 is not a whole number of pages of 64 tokens; use 64",
        ),
        (
            {"page_size": 16, "swa_tokens": 100},
            "swa_tokens=100 .* pages of 16 tokens; use 96 or 112",
        ),
    ],
)
def test_every_field_is_checked_with_its_name(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        PlanSettings(**kwargs)


def test_strings_convert_where_the_command_line_takes_strings() -> None:
    s = PlanSettings(
        kv_dtype="fp8_e4m3",
        ssm_dtype="bfloat16",
        layout="page_head",
        pool_layouts={"mamba": "page_first"},
        pinned="off",
        pp_split="SGLang",
        capacity_overrides={"kv": 128},
    )
    assert (s.kv_dtype, s.ssm_dtype, s.layout, s.pinned, s.pp_split) == (
        DType.FP8_E4M3,
        DType.BF16,
        Layout.PAGE_HEAD,
        Pinning.OFF,
        PPSplit.SGLANG,
    )
    assert s.pool_layouts == {PoolName.MAMBA: Layout.PAGE_FIRST}
    assert s.capacity_overrides == {PoolName.KV: 128}
    assert PlanSettings(storage=None).storage == StorageSettings()
    kv = PlanSettings(kv_dtype="fp8").kv_dtype  # a string became a DType: no AttributeError later
    assert kv is DType.FP8_E4M3
    assert PlanSettings(sizing=BudgetSizing(1 << 30)).sizing == BudgetSizing(1 << 30)


def test_the_engine_given_stage_overrides_the_split() -> None:
    spec = ModelSpec(model_type="dense", layer_kinds=[FULL] * 10, attention=ATTN)
    plan = plan_stack(spec, PlanSettings(pp_size=4, pp_rank=0, pp_start=3, pp_end=9))
    assert plan.stage == (3, 9)
    with pytest.raises(ConfigError, match=r"\[3, 12\) is not a non-empty range of the model's 10"):
        plan_stack(spec, PlanSettings(pp_start=3, pp_end=12))


# ---- spec parts that no layer uses -----------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"layer_kinds": [FULL, FULL], "state": GDN},
            "has a state spec .* but no layer holds state",
        ),
        (
            {
                "layer_kinds": [FULL, FULL],
                "indexer": IndexerSpec(heads=1, head_dim=8),
                "indexer_layers": [],
            },
            "has an indexer spec but no layer holds an indexer",
        ),
        ({"layer_kinds": [FULL], "indexer_layers": [0]}, "names indexer_layers but has no indexer"),
        ({"layer_kinds": [FULL], "state_layers": [0]}, "names state_layers but has no state spec"),
        ({"layer_kinds": [FULL], "sliding_window": 128}, "sliding-attention spec or window but no"),
        (
            {"layer_kinds": [FULL], "sliding_attention": ATTN},
            "sliding-attention spec or window but no",
        ),
        (
            {
                "layer_kinds": [FULL, SLIDING],
                "sliding_window": 4,
                "indexer": IndexerSpec(heads=1, head_dim=8),
                "indexer_layers": [1],
            },
            r"indexer layers \[1\] are not full-attention layers",
        ),
        (
            {"layer_kinds": [FULL, LINEAR], "state": GDN, "state_layers": [0]},
            r"state layers \[1\] are missing",
        ),
        (
            {"layer_kinds": [FULL], "state": GDN, "state_layers": [3]},
            r"state_layers \[3\] are not layers",
        ),
        (
            {
                "layer_kinds": [FULL, MAMBA],
                "state": KimiDeltaSpec(heads=2, head_dim=8, conv_kernel=4),
            },
            "has Mamba layers but no Mamba2Spec",
        ),
        (
            {
                "layer_kinds": [FULL, LINEAR],
                "state": Mamba2Spec(heads=2, head_dim=4, state_size=4, n_groups=1, conv_kernel=4),
            },
            "linear-attention layers but no GatedDeltaNetSpec or KimiDeltaSpec",
        ),
    ],
)
def test_a_spec_part_no_layer_uses_is_an_error(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        ModelSpec(model_type="custom", attention=ATTN, **kwargs)


def test_state_beside_attention_is_planned_in_one_pool_per_cache() -> None:
    spec = ModelSpec(
        model_type="parallel",
        layer_kinds=[FULL, FULL, LINEAR, FULL],
        attention=ATTN,
        state=GDN,
        state_layers=[1, 2, 3],
    )
    plan = plan_stack(spec, PlanSettings(page_size=16, device_tokens=1024))
    assert plan.pool("kv").binding.as_dict() == {0: 0, 1: 1, 3: 2}
    assert plan.pool("mamba").binding.as_dict() == {1: 0, 2: 1, 3: 2}
    assert plan.transfer_layers == 4


def test_mamba_groups_are_padded_to_tp_when_tp_does_not_divide_them() -> None:
    spec = ModelSpec(
        model_type="groups",
        layer_kinds=[FULL, MAMBA],
        attention=AttentionSpec(kv_heads=6, head_dim=8),
        state=Mamba2Spec(heads=12, head_dim=4, state_size=8, n_groups=3, conv_kernel=4),
    )
    # 3 groups over 2 ranks: SGLang pads to 2 groups, one per rank; over 3 ranks they split
    conv = {tp: spec.rank_geometries(tp).state.tensors[0].shape for tp in (1, 2, 3)}  # type: ignore[union-attr]
    assert conv == {1: (48 + 2 * 3 * 8, 3), 2: (24 + 2 * 1 * 8, 3), 3: (16 + 2 * 1 * 8, 3)}


def test_storage_may_be_a_backend_name() -> None:
    from hicache.domain import StorageSettings

    assert PlanSettings(storage="shm").storage == StorageSettings(backend="shm")
