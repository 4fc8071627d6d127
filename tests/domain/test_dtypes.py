"""DType: item sizes and the names a config or a command line may use."""

from __future__ import annotations

import pytest

from hicache.domain import ConfigError, DType, HiCacheError


@pytest.mark.parametrize(
    ("dtype", "itemsize"),
    [
        (DType.BF16, 2),
        (DType.FP16, 2),
        (DType.FP32, 4),
        (DType.FP8_E4M3, 1),
        (DType.FP8_E5M2, 1),
        (DType.INT8, 1),
        (DType.UINT8, 1),
    ],
)
def test_itemsize_of_every_dtype(dtype: DType, itemsize: int) -> None:
    assert dtype.itemsize == itemsize


def test_only_the_two_fp8_formats_are_fp8() -> None:
    assert {d for d in DType if d.is_fp8} == {DType.FP8_E4M3, DType.FP8_E5M2}


@pytest.mark.parametrize(
    ("text", "dtype"),
    [
        ("bfloat16", DType.BF16),
        ("torch.bfloat16", DType.BF16),
        ("BF16", DType.BF16),
        (" float16 ", DType.FP16),
        ("half", DType.FP16),
        ("float32", DType.FP32),
        ("float8_e4m3fn", DType.FP8_E4M3),
        ("fp8", DType.FP8_E4M3),
        ("float8_e5m2", DType.FP8_E5M2),
        ("int8", DType.INT8),
        ("uint8", DType.UINT8),
    ],
)
def test_parse_accepts_hf_torch_and_short_names(text: str, dtype: DType) -> None:
    assert DType.parse(text) is dtype


def test_parse_passes_a_dtype_through() -> None:
    assert DType.parse(DType.FP32) is DType.FP32


def test_unknown_dtype_is_a_config_error_naming_it_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"unknown dtype 'float64'.*bf16") as info:
        DType.parse("float64")
    assert isinstance(info.value, HiCacheError)
