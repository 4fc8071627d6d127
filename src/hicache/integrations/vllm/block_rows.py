"""vLLM's registered caches as whole-block byte rows, and the copier of those rows (no vLLM import).

- block_rows: one attention layer's cache as ``(num_blocks, block_bytes)`` uint8 rows, a view
  of vLLM's own tensor (no copy): vLLM's CPU and GPU caches put the block first and are
  contiguous, so a block is one row whatever order its token rows have inside.
- state_rows: a hybrid model's state layer (Mamba / Gated DeltaNet: conv and recurrent state in
  one raw page per block, padded to vLLM's common page size) as ``(num_blocks, state_bytes)``
  rows of the bytes the state really uses (a strided view, no copy).
- choose_copier: the RowCopier (hicache.adapters.copy.rows) for the connector's
  ``copy_backend`` setting.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hicache.adapters.copy.rows import RowCopier, row_copier
from hicache.domain import ConfigError, DeviceError


def block_rows(name: str, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``cache`` as ``(num_blocks, block_bytes)`` uint8 rows (a view); DeviceError otherwise."""
    if cache.dim() < 2 or cache.shape[0] != num_blocks or not cache.is_contiguous():
        raise DeviceError(
            f"vLLM cache of layer {name!r}: shape {tuple(cache.shape)}, contiguous="
            f"{cache.is_contiguous()}; expected a contiguous tensor with the {num_blocks} "
            "blocks first (HiCacheConnector copies whole blocks)"
        )
    return cache.view(torch.uint8).view(num_blocks, -1)


def state_rows(name: str, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """A state layer's ``cache`` as ``(num_blocks, used_bytes)`` uint8 rows (a strided view
    skipping each block's padding); DeviceError where a block's bytes are not one run."""
    inner = cache.shape[1:]
    expected, step = [], 1
    for size in reversed(inner):
        expected.append(step)
        step *= size
    dense_inner = all(  # a dimension of size 1 may have any stride
        size == 1 or stride == want
        for size, stride, want in zip(inner, cache.stride()[1:], reversed(expected), strict=True)
    )
    if cache.dim() < 2 or cache.shape[0] != num_blocks or not dense_inner:
        raise DeviceError(
            f"vLLM state cache of layer {name!r}: shape {tuple(cache.shape)}, stride "
            f"{cache.stride()}; expected the {num_blocks} blocks first, each one run of bytes"
        )
    used = step * cache.element_size()
    row = cache.stride(0) * cache.element_size()
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else None
    if raw is None:
        raise DeviceError(
            f"vLLM state cache of layer {name!r} has dtype {cache.dtype}; expected vLLM's raw "
            "byte pages (int8 or uint8)"
        )
    return raw.as_strided((num_blocks, used), (row, 1), raw.storage_offset())


def choose_copier(
    backend: str, caches: Sequence[torch.Tensor], *, pinned: bool | None = None
) -> RowCopier:
    """The RowCopier the connector's ``copy_backend`` setting asks for, for caches on one
    device: ``auto`` (memcpy on CPU, cuda_batch on CUDA), ``native`` (hicache's memcpy, CPU
    only), ``cuda_batch`` or ``torch``. ``pinned``: whether the host pages are page-locked
    (default: on CUDA). DeviceError where the backend does not fit the device."""
    device = caches[0].device if caches else torch.device("cpu")
    if any(t.device != device for t in caches):
        raise DeviceError(
            f"vLLM's caches are on several devices ({sorted({str(t.device) for t in caches})}); "
            "expected one device per worker"
        )
    name = {"native": "memcpy"}.get(backend, backend)
    try:
        return row_copier(name, device, pinned=device.type == "cuda" if pinned is None else pinned)
    except ConfigError as exc:
        raise DeviceError(f"kv_connector_extra_config 'copy_backend' = {backend!r}: {exc}") from exc


__all__ = ["block_rows", "choose_copier", "state_rows"]
