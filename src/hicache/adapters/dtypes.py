"""Domain element types to torch dtypes.

- torch_dtype: the torch dtype hicache STORES a DType as (fp8 kinds are stored as torch.uint8).
- accepted_dtypes: the torch dtypes a framework's tensor may carry for a DType when wrapped.
- as_storage: a zero-copy view of a framework tensor in the storage dtype (fp8 -> uint8 bytes).

fp8 values are moved as raw bytes: every fp8 buffer is a torch.uint8 view, so copies never
interpret (and never canonicalise) a NaN or a negative zero; round trips are byte-exact.
"""

from __future__ import annotations

import torch

from hicache.domain import ConfigError, DType

_STORAGE: dict[DType, torch.dtype] = {
    DType.BF16: torch.bfloat16,
    DType.FP16: torch.float16,
    DType.FP32: torch.float32,
    DType.FP8_E4M3: torch.uint8,
    DType.FP8_E5M2: torch.uint8,
    DType.INT8: torch.int8,
    DType.UINT8: torch.uint8,
}

_FP8_NATIVE: dict[DType, str] = {
    DType.FP8_E4M3: "float8_e4m3fn",
    DType.FP8_E5M2: "float8_e5m2",
}


def torch_dtype(dtype: DType) -> torch.dtype:
    """The torch dtype a DType is stored as (fp8 -> torch.uint8, raw bytes)."""
    if not isinstance(dtype, DType):
        raise ConfigError(f"expected a hicache DType, got {dtype!r}")
    return _STORAGE[dtype]


def accepted_dtypes(dtype: DType) -> tuple[torch.dtype, ...]:
    """Torch dtypes a wrapped framework tensor may have for ``dtype``.

    fp8 buffers may come as the matching torch float8 dtype (where this torch has it) or as
    uint8 bytes; every other DType must match exactly.
    """
    stored = torch_dtype(dtype)
    native = _FP8_NATIVE.get(dtype)
    if native is not None and hasattr(torch, native):
        return (getattr(torch, native), stored)
    return (stored,)


def as_storage(tensor: torch.Tensor, dtype: DType) -> torch.Tensor:
    """``tensor`` viewed (no copy) in the storage dtype of ``dtype``: float8 -> uint8."""
    stored = torch_dtype(dtype)
    if tensor.dtype == stored:
        return tensor
    if tensor.dtype not in accepted_dtypes(dtype):
        raise ConfigError(
            f"a tensor of dtype {tensor.dtype} cannot hold {dtype.value}: expected one of "
            f"{[str(d) for d in accepted_dtypes(dtype)]}"
        )
    return tensor.view(stored)


__all__ = ["accepted_dtypes", "as_storage", "torch_dtype"]
