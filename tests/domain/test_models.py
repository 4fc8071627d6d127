"""Model specs from HuggingFace configs, per-rank geometry under TP, pipeline stage ranges."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hicache.domain import (
    SUPPORTED_MODEL_TYPES,
    AttentionSpec,
    ConfigError,
    DType,
    GatedDeltaNetSpec,
    IndexerSpec,
    KVGeometry,
    LayerKind,
    Mamba2Spec,
    MLAGeometry,
    MLASpec,
    ModelSpec,
    UnsupportedModelError,
    stage_range,
)

FULL = LayerKind.FULL_ATTENTION
SLIDING = LayerKind.SLIDING_ATTENTION
LINEAR = LayerKind.LINEAR_ATTENTION
MAMBA = LayerKind.MAMBA
NONE = LayerKind.NONE


def fixture(fixtures_dir: Path, name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((fixtures_dir / f"{name}.json").read_text())
    return data


# Synthetic configs for supported types without a bundled fixture. The numbers are those of the
# public checkpoints named in each comment; keys the readers do not use are left out.
MISTRAL_7B = {  # mistralai/Mistral-7B-v0.1: no head_dim key, 4096 / 32 = 128
    "model_type": "mistral",
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "sliding_window": 4096,
    "torch_dtype": "bfloat16",
}
QWEN2_7B = {  # Qwen/Qwen2.5-7B-Instruct: 3584 / 28 = 128; sliding window present but unused
    "model_type": "qwen2",
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "hidden_size": 3584,
    "sliding_window": 131072,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}
QWEN3_8B = {  # Qwen/Qwen3-8B
    "model_type": "qwen3",
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "hidden_size": 4096,
    "torch_dtype": "bfloat16",
}
QWEN3_30B_A3B = {  # Qwen/Qwen3-30B-A3B: head_dim 128 although 2048 / 32 = 64
    "model_type": "qwen3_moe",
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_size": 2048,
    "torch_dtype": "bfloat16",
}
DEEPSEEK_V2_LITE = {  # deepseek-ai/DeepSeek-V2-Lite
    "model_type": "deepseek_v2",
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "hidden_size": 2048,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "torch_dtype": "bfloat16",
}
GEMMA3_27B = {  # google/gemma-3-27b-it style: multimodal wrapper, pattern of 5 sliding + 1 full
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 62,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "hidden_size": 5376,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
    },
    "vision_config": {"model_type": "siglip_vision_model"},
}
GEMMA3_12B = {  # google/gemma-3-12b-it: its text_config leaves out keys at transformers' defaults
    "model_type": "gemma3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "hidden_size": 3840,
        "intermediate_size": 15360,
        "model_type": "gemma3_text",
        "num_attention_heads": 16,
        "num_hidden_layers": 48,
        "num_key_value_heads": 8,
        "sliding_window": 1024,
    },
}
GEMMA3_1B = {  # google/gemma-3-1b-it (text only)
    "model_type": "gemma3_text",
    "num_hidden_layers": 26,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_size": 1152,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "torch_dtype": "bfloat16",
}


def test_every_supported_type_is_listed() -> None:
    assert set(SUPPORTED_MODEL_TYPES) == {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "qwen3_moe",
        "deepseek_v2",
        "deepseek_v3",
        "deepseek_v32",
        "glm_moe_dsa",
        "gpt_oss",
        "gemma3",
        "gemma3_text",
        "qwen3_next",
        "qwen3_5",
        "qwen3_5_text",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "nemotron_h",
        "minimax_m3_vl",
        "minimax_m3",
        "inkling_mm_model",
        "inkling_model",
        "inkling_text",
        "kimi_linear",
        "falcon_h1",
        "granitemoehybrid",
        "mimo_v2",
    }


@pytest.mark.parametrize(
    ("config", "layers", "kv_heads", "head_dim"),
    [
        (MISTRAL_7B, 32, 8, 128),
        (QWEN2_7B, 28, 4, 128),
        (QWEN3_8B, 36, 8, 128),
        (QWEN3_30B_A3B, 48, 4, 128),
    ],
    ids=["mistral", "qwen2", "qwen3", "qwen3_moe"],
)
def test_dense_types(config: dict[str, Any], layers: int, kv_heads: int, head_dim: int) -> None:
    spec = ModelSpec.from_hf_config(config)
    assert spec.model_type == config["model_type"]
    assert spec.layer_kinds == (FULL,) * layers
    assert spec.attention == AttentionSpec(kv_heads=kv_heads, head_dim=head_dim)
    assert spec.dtype is DType.BF16
    assert spec.sliding_window is None


def test_a_window_without_layer_types_is_kept_as_full_attention() -> None:
    # Mistral-7B-v0.1 slides on every layer; keeping full attention holds a superset of the
    # window and leaves a full-attention anchor, so the plan stays correct.
    spec = ModelSpec.from_hf_config(MISTRAL_7B)
    assert set(spec.layer_kinds) == {FULL}


def test_dense_layer_types_with_sliding_layers_make_a_swa_model() -> None:
    config = {**QWEN3_8B, "num_hidden_layers": 4, "sliding_window": 2048}
    config["layer_types"] = ["sliding_attention", "full_attention"] * 2
    spec = ModelSpec.from_hf_config(config)
    assert spec.layer_kinds == (SLIDING, FULL, SLIDING, FULL)
    assert spec.sliding_window == 2048
    del config["sliding_window"]
    with pytest.raises(ConfigError, match="sliding_window is not set"):
        ModelSpec.from_hf_config(config)


def test_qwen3_with_all_full_layer_types() -> None:
    config = {**QWEN3_8B, "layer_types": ["full_attention"] * 36, "sliding_window": None}
    assert ModelSpec.from_hf_config(config).layer_kinds == (FULL,) * 36


def test_deepseek_v2_is_mla() -> None:
    spec = ModelSpec.from_hf_config(DEEPSEEK_V2_LITE)
    assert spec.layer_kinds == (FULL,) * 27
    assert spec.attention == MLASpec(kv_lora_rank=512, qk_rope_head_dim=64)
    assert spec.indexer is None


def test_deepseek_mtp_layers_get_no_pool_layer(fixtures_dir: Path) -> None:
    config = fixture(fixtures_dir, "deepseek-v3")
    assert config["num_nextn_predict_layers"] == 1
    assert ModelSpec.from_hf_config(config).num_layers == 61  # not 62


def test_deepseek_v32_has_an_fp8_block_scaled_indexer(fixtures_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(fixture(fixtures_dir, "deepseek-v3.2-exp"))
    assert spec.indexer == IndexerSpec(heads=1, head_dim=128, dtype=DType.FP8_E4M3, scale_block=128)
    assert spec.num_layers == 61


def test_gemma3_multimodal_with_text_config_and_sliding_pattern() -> None:
    spec = ModelSpec.from_hf_config(GEMMA3_27B)
    full = [i for i, k in enumerate(spec.layer_kinds) if k is FULL]
    assert full == [5, 11, 17, 23, 29, 35, 41, 47, 53, 59]  # every 6th layer
    assert spec.layer_kinds.count(SLIDING) == 52
    assert spec.attention == AttentionSpec(kv_heads=16, head_dim=128)
    assert spec.sliding_window == 1024
    assert spec.model_type == "gemma3"
    assert spec.dtype is DType.BF16  # from the wrapper's torch_dtype


def test_gemma3_text_config_relying_on_transformers_defaults() -> None:
    spec = ModelSpec.from_hf_config(GEMMA3_12B)
    # head_dim defaults to 256 (not 3840 / 16 = 240); the pattern defaults to 6
    assert spec.attention == AttentionSpec(kv_heads=8, head_dim=256)
    assert [i for i, k in enumerate(spec.layer_kinds) if k is FULL] == [
        5,
        11,
        17,
        23,
        29,
        35,
        41,
        47,
    ]


def test_gemma3_text() -> None:
    spec = ModelSpec.from_hf_config(GEMMA3_1B)
    assert [i for i, k in enumerate(spec.layer_kinds) if k is FULL] == [5, 11, 17, 23]
    assert spec.attention == AttentionSpec(kv_heads=1, head_dim=256)
    assert spec.sliding_window == 512


def test_gemma3_text_from_layer_types() -> None:
    types = ["sliding_attention", "sliding_attention", "full_attention"]
    spec = ModelSpec.from_hf_config({**GEMMA3_1B, "num_hidden_layers": 3, "layer_types": types})
    assert spec.layer_kinds == (SLIDING, SLIDING, FULL)


def test_gpt_oss_alternates_sliding_and_full(fixtures_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(fixture(fixtures_dir, "gpt-oss-20b"))
    assert spec.layer_kinds == (SLIDING, FULL) * 12
    assert spec.sliding_window == 128
    assert spec.attention == AttentionSpec(kv_heads=8, head_dim=64)
    assert spec.dtype is DType.BF16  # the config names no dtype


def test_qwen3_next_from_the_full_attention_interval(fixtures_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(fixture(fixtures_dir, "qwen3-next-80b-a3b-instruct"))
    assert spec.layers_of(FULL) == tuple(range(3, 48, 4))
    assert len(spec.layers_of(LINEAR)) == 36
    assert spec.state == GatedDeltaNetSpec(
        key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv_kernel=4
    )


def test_qwen3_next_from_layer_types(fixtures_dir: Path) -> None:
    config = fixture(fixtures_dir, "qwen3-next-80b-a3b-instruct")
    config["num_hidden_layers"] = 4
    config["layer_types"] = ["full_attention"] + ["linear_attention"] * 3
    assert ModelSpec.from_hf_config(config).layer_kinds == (FULL, LINEAR, LINEAR, LINEAR)


def test_nemotron_h_mlp_only_layers_get_no_pool_layer(fixtures_dir: Path) -> None:
    config = fixture(fixtures_dir, "nemotron-h-8b-base-8k")
    spec = ModelSpec.from_hf_config(config)
    pattern = config["hybrid_override_pattern"]
    assert spec.num_layers == len(pattern) == 52
    assert spec.layer_kinds.count(NONE) == pattern.count("-") == 24
    assert spec.layer_kinds.count(MAMBA) == 24
    assert spec.layers_of(FULL) == (7, 18, 29, 40)
    assert spec.attention == AttentionSpec(kv_heads=8, head_dim=128)  # attention_head_dim
    assert spec.state == Mamba2Spec(
        heads=128, head_dim=64, state_size=128, n_groups=8, conv_kernel=4
    )


def test_nemotron_h_moe_layers_and_pattern_errors(fixtures_dir: Path) -> None:
    config = fixture(fixtures_dir, "nemotron-h-8b-base-8k")
    config.update(num_hidden_layers=4, hybrid_override_pattern="ME*-")
    assert ModelSpec.from_hf_config(config).layer_kinds == (MAMBA, NONE, FULL, NONE)
    config.update(hybrid_override_pattern="M*")
    with pytest.raises(ConfigError, match="must be a string of 4 characters, got 'M\\*'"):
        ModelSpec.from_hf_config(config)
    config.update(hybrid_override_pattern="M*X-")
    with pytest.raises(ConfigError, match=r"unknown layer symbols \['X'\]"):
        ModelSpec.from_hf_config(config)


def test_unknown_model_type_lists_the_supported_ones() -> None:
    with pytest.raises(UnsupportedModelError) as info:
        ModelSpec.from_hf_config({"model_type": "bert", "num_hidden_layers": 12})
    msg = str(info.value)
    assert "'bert'" in msg
    for name in SUPPORTED_MODEL_TYPES:
        assert name in msg


def test_missing_and_malformed_keys_are_config_errors_naming_them() -> None:
    config = {k: v for k, v in QWEN3_8B.items() if k != "num_hidden_layers"}
    with pytest.raises(ConfigError, match="qwen3 config is missing key 'num_hidden_layers'"):
        ModelSpec.from_hf_config(config)
    with pytest.raises(ConfigError, match="'num_hidden_layers' must be an integer, got '36'"):
        ModelSpec.from_hf_config({**QWEN3_8B, "num_hidden_layers": "36"})
    with pytest.raises(ConfigError, match="'num_key_value_heads' must be an integer, got 'eight'"):
        ModelSpec.from_hf_config({**QWEN3_8B, "num_key_value_heads": "eight"})
    with pytest.raises(ConfigError, match="unknown dtype"):
        ModelSpec.from_hf_config({**QWEN3_8B, "torch_dtype": "float64"})
    with pytest.raises(ConfigError, match="unknown layer type 'chunked'"):
        ModelSpec.from_hf_config({**QWEN3_8B, "layer_types": ["chunked"] * 36})
    with pytest.raises(ConfigError, match="must be a mapping, got list"):
        ModelSpec.from_hf_config([])  # type: ignore[arg-type]


# ---- per-rank geometry -----------------------------------------------------------------------

LLAMA = ModelSpec(
    model_type="llama", layer_kinds=[FULL] * 2, attention=AttentionSpec(kv_heads=8, head_dim=128)
)


@pytest.mark.parametrize(("tp", "heads"), [(1, 8), (2, 4), (8, 1), (16, 1), (32, 1)])
def test_kv_heads_split_or_replicated(tp: int, heads: int) -> None:
    kv = LLAMA.rank_geometries(tp).kv
    assert kv == KVGeometry(kv_heads=heads, head_dim=128)


@pytest.mark.parametrize("tp", [3, 6, 12])
def test_kv_heads_that_neither_split_nor_replicate(tp: int) -> None:
    with pytest.raises(ConfigError, match=f"8 heads can be neither split over nor .* tp={tp}"):
        LLAMA.rank_geometries(tp)


@pytest.mark.parametrize("tp", [0, -1, 2.0])
def test_tp_size_must_be_a_positive_integer(tp: int) -> None:
    with pytest.raises(ConfigError, match="tp_size must be a positive integer"):
        LLAMA.rank_geometries(tp)


def test_kv_dtype_overrides_the_model_dtype() -> None:
    kv = LLAMA.rank_geometries(1, kv_dtype=DType.FP8_E4M3).kv
    assert kv is not None
    assert kv.bytes_per_unit_per_layer == 2 * 8 * 128 * 1


@pytest.mark.parametrize("tp", [1, 2, 8, 16, 3])
def test_mla_is_replicated_on_every_rank(tp: int) -> None:
    spec = ModelSpec.from_hf_config(DEEPSEEK_V2_LITE)
    assert spec.rank_geometries(tp).kv == MLAGeometry(kv_lora_rank=512, qk_rope_head_dim=64)


def test_mamba_heads_split_and_groups_replicate(fixtures_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(fixture(fixtures_dir, "nemotron-h-8b-base-8k"))
    state = spec.rank_geometries(16).state
    assert state is not None
    # 128 / 16 = 8 heads per rank; 8 groups over 16 ranks: one group, replicated
    conv_dim = 8 * 64 + 2 * 1 * 128
    assert {t.name: t.shape for t in state.tensors} == {
        "conv": (conv_dim, 3),
        "temporal": (8, 64, 128),
    }
    odd = ModelSpec(
        model_type="odd_mamba",
        layer_kinds=[FULL, MAMBA],
        attention=AttentionSpec(kv_heads=8, head_dim=128),
        state=Mamba2Spec(heads=24, head_dim=64, state_size=16, n_groups=1, conv_kernel=4),
    )
    # Mamba heads are split, never replicated: 24 heads over 16 ranks is an error
    with pytest.raises(ConfigError, match="odd_mamba Mamba: 24 heads cannot be split over tp=16"):
        odd.rank_geometries(16)


def test_linear_attention_heads_split(fixtures_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(fixture(fixtures_dir, "qwen3-next-80b-a3b-instruct"))
    state = spec.rank_geometries(4).state
    assert state is not None
    # 16 / 4 key heads, 32 / 4 value heads
    assert {t.name: t.shape for t in state.tensors} == {
        "conv": (2 * 4 * 128 + 8 * 128, 3),
        "temporal": (8, 128, 128),
    }
    with pytest.raises(
        ConfigError, match="linear-attention key: 16 heads cannot be split over tp=32"
    ):
        spec.rank_geometries(32)


def test_ssm_dtype_sets_the_temporal_state_dtype(fixtures_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(fixture(fixtures_dir, "qwen3-next-80b-a3b-instruct"))
    state = spec.rank_geometries(1, ssm_dtype=DType.BF16).state
    assert state is not None
    assert {t.name: t.dtype for t in state.tensors} == {"conv": DType.BF16, "temporal": DType.BF16}


def test_indexer_dtype_defaults_to_the_kv_dtype() -> None:
    spec = ModelSpec(
        model_type="minimax_like",
        layer_kinds=[FULL] * 2,
        attention=AttentionSpec(kv_heads=8, head_dim=128),
        indexer=IndexerSpec(heads=4, head_dim=64),
    )
    ix = spec.rank_geometries(2, kv_dtype=DType.FP16).indexer
    assert ix is not None
    assert (ix.heads, ix.dtype, ix.bytes_per_unit_per_layer) == (2, DType.FP16, 2 * 64 * 2)


# ---- pipeline stages -------------------------------------------------------------------------


def test_stage_ranges_cover_the_model_once() -> None:
    # vLLM's get_pp_indices: 61 = 4 x 15 + 1, the extra layer goes to the second-to-last stage
    ranges = [stage_range(61, 4, r) for r in range(4)]
    assert ranges == [(0, 15), (15, 30), (30, 46), (46, 61)]
    assert stage_range(48, 1, 0) == (0, 48)


@pytest.mark.parametrize(
    ("pp_size", "pp_rank", "message"),
    [
        (0, 0, "pp_size must be a positive integer"),
        (2, 2, r"pp_rank must be in \[0, 2\), got 2"),
        (2, -1, r"pp_rank must be in \[0, 2\)"),
        (5, 0, "pp_size=5 is larger than the model's 4 layers"),
    ],
)
def test_bad_stages(pp_size: int, pp_rank: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        stage_range(4, pp_size, pp_rank)


# ---- specs built in Python -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"layer_kinds": []}, "has no layers"),
        ({"layer_kinds": [FULL], "attention": None}, "no attention spec"),
        ({"layer_kinds": [FULL, SLIDING]}, "sliding layers but no window"),
        (
            {
                "layer_kinds": [FULL, SLIDING],
                "attention": MLASpec(kv_lora_rank=8, qk_rope_head_dim=8),
                "sliding_window": 4,
            },
            "sliding layers need an MHA spec",
        ),
        (
            {
                "layer_kinds": [FULL, MAMBA, LINEAR],
                "state": Mamba2Spec(heads=2, head_dim=4, state_size=4, n_groups=1, conv_kernel=4),
            },
            "mixes Mamba2 and linear-attention",
        ),
        ({"layer_kinds": [FULL, MAMBA]}, "Mamba layers but no Mamba2Spec"),
        ({"layer_kinds": [FULL, LINEAR]}, "linear-attention layers but no GatedDeltaNetSpec"),
        ({"layer_kinds": [SLIDING], "sliding_window": 4}, "no full-attention layer"),
    ],
)
def test_model_spec_invariants(kwargs: dict[str, Any], message: str) -> None:
    base: dict[str, Any] = {
        "model_type": "custom",
        "attention": AttentionSpec(kv_heads=2, head_dim=8),
    }
    base.update(kwargs)
    with pytest.raises(ConfigError, match=message):
        ModelSpec(**base)
