"""Plans of today's hybrid models, at tp 1, 2, 4 and 8, against byte counts worked out by hand.

The CLI defaults hold (page 64, 65536 device tokens, 256 device slots, ratio 2.0): token pools
keep 131072 tokens and state pools 512 slots. Each per-layer figure is written out from the
model's config fields and the reference engine's formula (SGLang configs/mamba_utils.py,
configs/kimi_linear.py, configs/inkling.py, configs/falcon_h1.py; docs/models.md).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from hicache.cli import main
from hicache.domain import (
    Cache,
    ConfigError,
    DType,
    ModelSpec,
    PlanSettings,
    plan_stack,
    stage_range,
)
from tests.domain.fixture_expectations import EXPECTED

TOKENS = 131072
SLOTS = 512
BF16, FP32 = 2, 4


def bind(layers: Iterable[int]) -> dict[str, int]:
    return {str(t): i for i, t in enumerate(layers)}


def pool(role: str, unit: str, layers: Iterable[int], per_layer: int) -> dict[str, Any]:
    t = list(layers)
    return {
        "role": role,
        "unit": unit,
        "layers": len(t),
        "bytes_per_unit_per_layer": per_layer,
        "capacity": TOKENS if unit == "token" else SLOTS,
        "binding": bind(t),
    }


def kv_bytes(heads: int, k: int, v: int | None = None) -> int:
    return heads * (k + (k if v is None else v)) * BF16


def per_rank(heads: int, tp: int) -> int:
    return heads // tp if heads % tp == 0 else 1  # split, or one replicated head


# ---- MiniMax-M3: 60 full layers, 4 KV heads of 128; a plain bf16 K-only indexer of 128 on the
# layers sparse_attention_freq marks (3..59), one head on every rank.
def minimax(tp: int) -> dict[str, Any]:
    return {
        "kv": pool("anchor", "token", range(60), kv_bytes(per_rank(4, tp), 128)),
        "indexer": pool("sidecar", "token", range(3, 60), 1 * 128 * BF16),
    }


# ---- Inkling: 66 layers, local_layer_ids sliding (55), the other 11 full. Full KV 8 heads of
# 128, sliding KV 16 heads of 128; six bf16 short-conv states (3, d) on every layer.
INK_FULL = [5, 11, 17, 23, 29, 35, 41, 47, 53, 59, 65]
INK_LOCAL = [i for i in range(66) if i not in INK_FULL]


def inkling(tp: int) -> dict[str, Any]:
    full = max(1, 8 // tp) * 128
    local = max(1, 16 // tp) * 128
    conv = (2 * full + 2 * local + 2 * 6144) * 3 * BF16
    return {
        "kv": pool("anchor", "token", INK_FULL, kv_bytes(per_rank(8, tp), 128)),
        "swa": pool("independent", "token", INK_LOCAL, kv_bytes(per_rank(16, tp), 128)),
        "mamba": pool("independent", "slot", range(66), conv),
    }


# ---- Qwen3.5-35B-A3B: 40 layers, every 4th full (2 KV heads of 256); Gated DeltaNet 16 key and
# 32 value heads of 128, conv kernel 4.
QW_FULL = list(range(3, 40, 4))
QW_LIN = [i for i in range(40) if i not in QW_FULL]


def qwen35(tp: int) -> dict[str, Any]:
    kh, vh = 16 // tp, 32 // tp
    conv = (2 * kh * 128 + vh * 128) * 3 * BF16
    temporal = vh * 128 * 128 * FP32
    return {
        "kv": pool("anchor", "token", QW_FULL, kv_bytes(per_rank(2, tp), 256)),
        "mamba": pool("independent", "slot", QW_LIN, conv + temporal),
    }


# ---- Kimi-Linear-48B-A3B: 27 layers; full_attn_layers (1-based) 4, 8, ..., 24, 27 are MLA
# (512 + 64); the other 20 are KDA: 32 heads of 128, conv (3, 3 x 32/tp x 128) bf16, temporal
# (32/tp, 128, 128) fp32.
KIMI_FULL = [3, 7, 11, 15, 19, 23, 26]
KIMI_KDA = [i for i in range(27) if i not in KIMI_FULL]


def kimi(tp: int) -> dict[str, Any]:
    h = 32 // tp
    return {
        "kv": pool("anchor", "token", KIMI_FULL, (512 + 64) * BF16),
        "mamba": pool(
            "independent", "slot", KIMI_KDA, 3 * (3 * h * 128) * BF16 + h * 128 * 128 * FP32
        ),
    }


# ---- Falcon-H1-7B: 44 layers, each with attention (2 KV heads of 128) AND Mamba2 (24 heads of
# 128, d_ssm 3072, 1 group padded to tp, d_state 256, conv 4).
def falcon(tp: int) -> dict[str, Any]:
    groups = 1  # 1 group: split at tp 1, padded to one per rank beyond
    conv_dim = 3072 // tp + 2 * groups * 256
    state = conv_dim * 3 * BF16 + (24 // tp) * 128 * 256 * FP32
    return {
        "kv": pool("anchor", "token", range(44), kv_bytes(per_rank(2, tp), 128)),
        "mamba": pool("independent", "slot", range(44), state),
    }


# ---- granitemoehybrid (transformers' documented example config): 8 layers, attention at 3 and
# 7 (8 KV heads of 512 / 8 = 64); Mamba2 8 heads of 128, d_ssm 2 x 512, 1 group, d_state 128.
def granite(tp: int) -> dict[str, Any]:
    conv_dim = 1024 // tp + 2 * 1 * 128
    state = conv_dim * 3 * BF16 + (8 // tp) * 128 * 128 * FP32
    return {
        "kv": pool("anchor", "token", [3, 7], kv_bytes(per_rank(8, tp), 64)),
        "mamba": pool("independent", "slot", [0, 1, 2, 4, 5, 6], state),
    }


# ---- MiMo-V2-Flash: 48 layers, hybrid_layer_pattern 0 (full) at 0, 5, 11, ..., 47: 4 KV heads,
# K 192 / V 128; sliding layers: 8 KV heads, K 192 / V 128.
MIMO_FULL = [0, 5, 11, 17, 23, 29, 35, 41, 47]
MIMO_SWA = [i for i in range(48) if i not in MIMO_FULL]


def mimo(tp: int) -> dict[str, Any]:
    return {
        "kv": pool("anchor", "token", MIMO_FULL, kv_bytes(per_rank(4, tp), 192, 128)),
        "swa": pool("independent", "token", MIMO_SWA, kv_bytes(per_rank(8, tp), 192, 128)),
    }


# ---- GLM-5: 78 MLA layers (512 + 64 bf16) and the DeepSeek-V3.2 indexer: one fp8 K head of 128
# plus a float32 scale per 128 elements: 128 + 4 = 132 bytes.
def glm5(tp: int) -> dict[str, Any]:
    return {
        "kv": pool("anchor", "token", range(78), (512 + 64) * BF16),
        "indexer": pool("sidecar", "token", range(78), 128 + 4),
    }


HYBRID_FIXTURES = {
    "minimax-m3": ("minimax_m3_vl", 60, minimax),
    "inkling": ("inkling_mm_model", 66, inkling),
    "qwen3.5-35b-a3b": ("qwen3_5_moe", 40, qwen35),
    "kimi-linear-48b-a3b-instruct": ("kimi_linear", 27, kimi),
    "falcon-h1-7b-instruct": ("falcon_h1", 44, falcon),
    "granitemoehybrid-docs-example": ("granitemoehybrid", 8, granite),
    "mimo-v2-flash": ("mimo_v2", 48, mimo),
    "glm-5": ("glm_moe_dsa", 78, glm5),
}

POOL_KEYS = ("role", "unit", "layers", "bytes_per_unit_per_layer", "capacity", "binding")


def plan_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict[str, Any]:
    assert main(["plan", *args, "--json"]) == 0
    doc: dict[str, Any] = json.loads(capsys.readouterr().out)
    return doc


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("name", sorted(HYBRID_FIXTURES))
def test_hicache_plan_gives_the_reference_engines_pool_geometry(
    capsys: pytest.CaptureFixture[str], name: str, tp: int
) -> None:
    model_type, transfer, expected = HYBRID_FIXTURES[name]
    doc = plan_json(capsys, "--model", name, "--tp", str(tp))
    pools = {p["name"]: {k: p[k] for k in POOL_KEYS} for p in doc["pools"]}
    assert (doc["model_type"], doc["transfer_layers"]) == (model_type, transfer)
    assert pools == expected(tp)
    assert doc["host_bytes_total"] == sum(
        p["bytes_per_unit_per_layer"] * p["layers"] * p["capacity"] for p in pools.values()
    )
    anchor = pools["kv"]
    for p in pools.values():
        if p["role"] == "sidecar":
            assert p["capacity"] == anchor["capacity"]
    # every pool in the layout the measurements favour
    assert {p["layout"] for p in doc["pools"]} == {"page_first_direct"}


def test_minimax_indexer_keeps_the_model_dtype_under_an_fp8_kv_cache(fixtures_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(json.loads((fixtures_dir / "minimax-m3.json").read_text()))
    plan = plan_stack(spec, PlanSettings(tp_size=8, kv_dtype="fp8_e4m3"))
    assert plan.pool("kv").bytes_per_unit_per_layer == 1 * 256 * 1  # 1 head, K+V 128 each, fp8
    ix = plan.pool("indexer")
    assert (ix.geometry.buffers[0].dtype, ix.bytes_per_unit_per_layer) == (DType.BF16, 256)


def test_falcon_layers_hold_attention_and_state_together(fixtures_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(
        json.loads((fixtures_dir / "falcon-h1-7b-instruct.json").read_text())
    )
    assert set(spec.layer_caches) == {frozenset({Cache.FULL, Cache.STATE})}
    plan = plan_stack(spec, PlanSettings(pp_size=4, pp_rank=1))
    # both pools bind every layer of the stage, and transfer layer t is the same layer for both
    assert plan.pool("kv").binding == plan.pool("mamba").binding
    assert plan.transfer_layers == 11


def test_inkling_state_binds_every_layer_beside_full_or_sliding_attention(
    fixtures_dir: Path,
) -> None:
    spec = ModelSpec.from_hf_config(json.loads((fixtures_dir / "inkling.json").read_text()))
    assert spec.layer_caches[5] == {Cache.FULL, Cache.STATE}
    assert spec.layer_caches[0] == {Cache.SLIDING, Cache.STATE}
    state = spec.rank_geometries(4).state
    assert state is not None
    assert [(t.name, t.shape, t.dtype) for t in state.tensors] == [
        ("k_full", (3, 256), DType.BF16),
        ("v_full", (3, 256), DType.BF16),
        ("k_sliding", (3, 512), DType.BF16),
        ("v_sliding", (3, 512), DType.BF16),
        ("attn_out", (3, 6144), DType.BF16),
        ("mlp_out", (3, 6144), DType.BF16),
    ]


def test_kimi_layer_ids_are_one_based(fixtures_dir: Path) -> None:
    config = json.loads((fixtures_dir / "kimi-linear-48b-a3b-instruct.json").read_text())
    spec = ModelSpec.from_hf_config(config)
    assert spec.layers_holding(Cache.FULL) == tuple(KIMI_FULL)
    bad = {**config, "linear_attn_config": {**config["linear_attn_config"], "kda_layers": [0, 1]}}
    with pytest.raises(ConfigError, match="1-based ids"):
        ModelSpec.from_hf_config(bad)


# ---- pipeline stages -------------------------------------------------------------------------


def vllm_sizes(n: int, pp: int) -> list[int]:
    """vLLM's rule restated: pp equal parts, the remainder one each before the last stage."""
    base, extra = divmod(n, pp)
    return [base + (1 if pp - 1 - extra <= r < pp - 1 else 0) for r in range(pp)]


@pytest.mark.parametrize(("n", "pp"), [(36, 10), (61, 4), (7, 4), (5, 4), (48, 5), (27, 2)])
def test_default_stage_is_vllm_get_pp_indices(n: int, pp: int) -> None:
    sizes = vllm_sizes(n, pp)
    starts = [sum(sizes[:r]) for r in range(pp)]
    assert [stage_range(n, pp, r) for r in range(pp)] == [
        (s, s + z) for s, z in zip(starts, sizes, strict=True)
    ]


def test_gpt_oss_120b_shape_at_pp_10_runs_rank_3_on_layers_9_to_13() -> None:
    assert stage_range(36, 10, 3) == (9, 13)
    assert stage_range(36, 10, 3, "sglang") == (9, 12)  # SGLang gives the rest to the last stages
    assert [stage_range(7, 4, r, "sglang") for r in range(4)] == [(0, 1), (1, 3), (3, 5), (5, 7)]


def test_every_pp_rank_plans_the_vllm_stage(capsys: pytest.CaptureFixture[str]) -> None:
    for rank in range(4):
        doc = plan_json(
            capsys, "--model", "mimo-v2-flash", "--pp-size", "4", "--pp-rank", str(rank)
        )
        assert tuple(doc["stage"]) == stage_range(48, 4, rank)


def test_the_engine_given_stage_wins(capsys: pytest.CaptureFixture[str]) -> None:
    doc = plan_json(capsys, "--model", "qwen3.5-35b-a3b", "--pp-start", "10", "--pp-end", "17")
    assert doc["stage"] == [10, 17]
    # full layers 11 and 15 are stage-local 1 and 5
    assert doc["model_layers"] == list(range(7))
    kv = next(p for p in doc["pools"] if p["name"] == "kv")
    assert kv["binding"] == {"1": 0, "5": 1}


def test_a_state_only_stage_is_refused_with_the_pp_sizes_that_work(fixtures_dir: Path) -> None:
    spec = ModelSpec.from_hf_config(json.loads((fixtures_dir / "qwen3.5-35b-a3b.json").read_text()))
    with pytest.raises(ConfigError) as err:
        plan_stack(spec, PlanSettings(pp_size=20, pp_rank=0))
    message = str(err.value)
    assert "stage [0, 2) of 'qwen3_5_moe' has no full-attention layer" in message
    assert "its layers hold ['state']" in message
    listed = message.split("under the vllm split: ")[1]
    assert listed.startswith("1, 2, 3, 4, 5, 6, 7, 8, 9, 10")  # stages of 4+ layers hold one
    sizes = [int(x) for x in listed.split(", ") if x.isdigit()]
    assert 20 not in sizes
    for pp in sizes:
        for rank in range(pp):
            plan_stack(spec, PlanSettings(pp_size=pp, pp_rank=rank))


def test_glm_shared_indexer_layers_keep_no_indexer(fixtures_dir: Path) -> None:
    config = json.loads((fixtures_dir / "glm-5.json").read_text())
    types = ["full" if i % 4 == 0 else "shared" for i in range(78)]
    spec = ModelSpec.from_hf_config({**config, "indexer_types": types})
    assert spec.layers_holding(Cache.INDEXER) == tuple(range(0, 78, 4))
    plan = plan_stack(spec)
    assert plan.pool("indexer").binding.as_dict() == {t: i for i, t in enumerate(range(0, 78, 4))}
    assert plan.pool("indexer").capacity == plan.anchor.capacity
    with pytest.raises(ConfigError, match="indexer_types must list 78"):
        ModelSpec.from_hf_config({**config, "indexer_types": ["full"] * 3})


def test_text_config_is_unwrapped_and_the_outer_dtype_applies() -> None:
    text = {
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "hidden_size": 256,
    }
    spec = ModelSpec.from_hf_config(
        {"model_type": "minimax_m3_vl", "torch_dtype": "float16", "text_config": text}
    )
    assert (spec.model_type, spec.dtype, spec.num_layers) == ("minimax_m3_vl", DType.FP16, 2)
    assert spec.indexer is None  # no sparse_attention_config: no indexer, and none dropped
    with pytest.raises(
        ConfigError, match="minimax_m3_vl config is missing key 'num_hidden_layers'"
    ):
        ModelSpec.from_hf_config({"model_type": "minimax_m3_vl", "text_config": {}})


def test_inkling_conv_state_is_bf16_whatever_the_model_dtype(fixtures_dir: Path) -> None:
    config = json.loads((fixtures_dir / "inkling.json").read_text())
    config["text_config"]["torch_dtype"] = "float16"
    spec = ModelSpec.from_hf_config(config)
    assert spec.dtype is DType.FP16
    state = spec.rank_geometries(2).state
    assert state is not None
    assert {t.dtype for t in state.tensors} == {DType.BF16}


def test_every_fixture_is_covered(fixtures_dir: Path) -> None:
    names = {p.stem for p in fixtures_dir.glob("*.json")}
    assert names == {name for name, _ in EXPECTED} | set(HYBRID_FIXTURES)
