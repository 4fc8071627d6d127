"""Pool geometries: bytes per unit per layer of every pool kind, computed by hand."""

from __future__ import annotations

import pytest

from hicache.domain import (
    BufferSpec,
    ConfigError,
    DType,
    IndexerGeometry,
    KVGeometry,
    MLAGeometry,
    StateGeometry,
    StateTensor,
    Unit,
    gated_deltanet_state,
    mamba2_state,
)


def test_mha_bytes_are_k_plus_v() -> None:
    g = KVGeometry(kv_heads=8, head_dim=128)
    # K and V: 2 x 8 heads x 128 x 2 bytes (bf16)
    assert g.bytes_per_unit_per_layer == 2 * 8 * 128 * 2 == 4096
    assert g.unit is Unit.TOKEN
    assert [(b.name, b.shape, b.dtype) for b in g.buffers] == [
        ("k", (8, 128), DType.BF16),
        ("v", (8, 128), DType.BF16),
    ]


def test_mha_with_different_k_and_v_head_dims() -> None:
    g = KVGeometry(kv_heads=4, head_dim=192, v_head_dim=128, dtype=DType.FP16)
    # K: 4 x 192 x 2, V: 4 x 128 x 2
    assert g.bytes_per_unit_per_layer == 4 * 192 * 2 + 4 * 128 * 2 == 2560
    assert g.buffers[0].shape == (4, 192)
    assert g.buffers[1].shape == (4, 128)
    assert g.value_dim == 128


def test_mha_dtype_scales_the_bytes() -> None:
    assert KVGeometry(kv_heads=8, head_dim=128, dtype=DType.FP8_E4M3).bytes_per_unit_per_layer == (
        2 * 8 * 128 * 1
    )
    assert KVGeometry(kv_heads=8, head_dim=128, dtype=DType.FP32).bytes_per_unit_per_layer == (
        2 * 8 * 128 * 4
    )


def test_mla_is_one_latent_row() -> None:
    g = MLAGeometry(kv_lora_rank=512, qk_rope_head_dim=64)
    # (512 + 64) x 2 bytes
    assert g.bytes_per_unit_per_layer == (512 + 64) * 2 == 1152
    assert [b.shape for b in g.buffers] == [(576,)]
    assert not g.buffers[0].head_axis


def test_mla_row_width_overrides_the_row() -> None:
    # An fp8 row that packs 512 fp8 latents, 4 float32 scales and 64 bf16 rope dims: 656 bytes.
    g = MLAGeometry(kv_lora_rank=512, qk_rope_head_dim=64, dtype=DType.FP8_E4M3, row_width=656)
    assert g.width == 656
    assert g.bytes_per_unit_per_layer == 656


def test_plain_indexer_is_k_only_heads_by_dim() -> None:
    g = IndexerGeometry(heads=4, head_dim=128, dtype=DType.BF16)
    # K only, no V: 4 x 128 x 2
    assert g.bytes_per_unit_per_layer == 4 * 128 * 2 == 1024
    assert [b.name for b in g.buffers] == ["k"]
    assert g.buffers[0].head_axis


def test_fp8_indexer_adds_a_float32_scale_per_block() -> None:
    g = IndexerGeometry(heads=1, head_dim=128, dtype=DType.FP8_E4M3, scale_block=128)
    # 128 fp8 bytes + one float32 scale for the one block of 128
    assert g.bytes_per_unit_per_layer == 128 * 1 + 1 * 4 == 132
    assert g.buffers[0].dtype is DType.UINT8


def test_fp8_indexer_rounds_a_partial_block_up() -> None:
    g = IndexerGeometry(heads=2, head_dim=192, dtype=DType.FP8_E5M2, scale_block=128)
    # per head: 192 fp8 bytes + ceil(192 / 128) = 2 scales x 4 bytes
    assert g.bytes_per_unit_per_layer == 2 * (192 + 2 * 4) == 400


def test_block_scales_need_fp8() -> None:
    with pytest.raises(ConfigError, match="scale_block=128 needs an fp8 dtype, got bf16"):
        IndexerGeometry(heads=1, head_dim=128, dtype=DType.BF16, scale_block=128)


def test_mamba2_state_geometry() -> None:
    g = mamba2_state(heads=128, head_dim=64, state_size=128, n_groups=8, conv_kernel=4)
    conv_dim = 128 * 64 + 2 * 8 * 128  # 10240
    assert {t.name: t.shape for t in g.tensors} == {
        "conv": (conv_dim, 3),
        "temporal": (128, 64, 128),
    }
    # conv in bf16, temporal (SSM) state in float32 by default
    assert g.bytes_per_unit_per_layer == conv_dim * 3 * 2 + 128 * 64 * 128 * 4 == 4255744
    assert g.unit is Unit.SLOT
    assert g.family == "mamba2"


def test_mamba2_temporal_dtype_is_overridable() -> None:
    g = mamba2_state(
        heads=16, head_dim=64, state_size=128, n_groups=1, conv_kernel=4, ssm_dtype=DType.BF16
    )
    conv_dim = 16 * 64 + 2 * 1 * 128
    assert g.bytes_per_unit_per_layer == conv_dim * 3 * 2 + 16 * 64 * 128 * 2


def test_gated_deltanet_state_geometry() -> None:
    g = gated_deltanet_state(
        key_heads=16, value_heads=32, key_dim=128, value_dim=128, conv_kernel=4
    )
    conv_dim = 2 * 16 * 128 + 32 * 128  # 8192
    assert {t.name: t.shape for t in g.tensors} == {
        "conv": (conv_dim, 3),
        "temporal": (32, 128, 128),
    }
    assert g.bytes_per_unit_per_layer == conv_dim * 3 * 2 + 32 * 128 * 128 * 4 == 2146304
    assert g.family == "gated_deltanet"


@pytest.mark.parametrize("factory", [mamba2_state, gated_deltanet_state])
def test_state_needs_a_conv_kernel_of_at_least_two(factory: object) -> None:
    kwargs = (
        {"heads": 4, "head_dim": 8, "state_size": 8, "n_groups": 1, "conv_kernel": 1}
        if factory is mamba2_state
        else {"key_heads": 2, "value_heads": 2, "key_dim": 8, "value_dim": 8, "conv_kernel": 1}
    )
    with pytest.raises(ConfigError, match="conv_kernel must be at least 2, got 1"):
        factory(**kwargs)  # type: ignore[operator]


def test_state_geometry_from_named_tensors() -> None:
    g = StateGeometry(
        tensors=[StateTensor("a", (3, 4), DType.FP32), StateTensor("b", [5], DType.INT8)]
    )
    assert g.bytes_per_unit_per_layer == 3 * 4 * 4 + 5
    assert [b.name for b in g.buffers] == ["a", "b"]


def test_state_geometry_rejects_no_tensors_and_duplicate_names() -> None:
    with pytest.raises(ConfigError, match="at least one state tensor"):
        StateGeometry(tensors=())
    with pytest.raises(ConfigError, match="names must be unique"):
        StateGeometry(
            tensors=(StateTensor("x", (1,), DType.FP32), StateTensor("x", (2,), DType.FP32))
        )


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_geometry_dimensions_must_be_positive_integers(bad: object) -> None:
    with pytest.raises(ConfigError, match="kv_heads must be a positive integer"):
        KVGeometry(kv_heads=bad, head_dim=128)  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [(), (0, 4), (4, -1), "abc"])
def test_buffer_shapes_must_be_non_empty_positive(shape: object) -> None:
    with pytest.raises(ConfigError):
        BufferSpec("x", shape, DType.BF16)  # type: ignore[arg-type]


def test_geometries_are_frozen_values() -> None:
    a = KVGeometry(kv_heads=8, head_dim=128)
    assert a == KVGeometry(kv_heads=8, head_dim=128)
    assert hash(a) == hash(KVGeometry(kv_heads=8, head_dim=128))
    with pytest.raises(AttributeError):
        a.kv_heads = 4  # type: ignore[misc]
