"""Element types of cached tensors and their item sizes.

- DType: the element types hicache stores (bf16, fp16, fp32, fp8 e4m3/e5m2, int8, uint8).
- DType.parse: accepts hicache names and common aliases ("bfloat16", "float8_e4m3fn", ...).
"""

from __future__ import annotations

import enum

from hicache.domain.errors import ConfigError, shown


class DType(enum.Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"
    INT8 = "int8"
    UINT8 = "uint8"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_fp8(self) -> bool:
        return self in (DType.FP8_E4M3, DType.FP8_E5M2)

    @classmethod
    def parse(cls, value: str | DType) -> DType:
        if isinstance(value, DType):
            return value
        key = str(value).strip().lower().removeprefix("torch.")
        found = _ALIASES.get(key)
        if found is None:
            raise ConfigError(
                f"unknown dtype {shown(value)}: expected one of {', '.join(sorted(_ALIASES))}"
            )
        return found


_ITEMSIZE = {
    DType.BF16: 2,
    DType.FP16: 2,
    DType.FP32: 4,
    DType.FP8_E4M3: 1,
    DType.FP8_E5M2: 1,
    DType.INT8: 1,
    DType.UINT8: 1,
}

_ALIASES: dict[str, DType] = {
    "bf16": DType.BF16,
    "bfloat16": DType.BF16,
    "fp16": DType.FP16,
    "float16": DType.FP16,
    "half": DType.FP16,
    "fp32": DType.FP32,
    "float32": DType.FP32,
    "float": DType.FP32,
    "fp8_e4m3": DType.FP8_E4M3,
    "fp8": DType.FP8_E4M3,
    "float8_e4m3fn": DType.FP8_E4M3,
    "fp8_e5m2": DType.FP8_E5M2,
    "float8_e5m2": DType.FP8_E5M2,
    "int8": DType.INT8,
    "uint8": DType.UINT8,
}
