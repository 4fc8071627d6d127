"""vLLM's registered caches as whole-block byte rows, and the copier of those rows (no vLLM import).

- block_rows: one attention layer's cache as ``(num_blocks, block_bytes)`` uint8 rows, a view
  of vLLM's own tensor (no copy): vLLM's layouts put the block first and make each block one
  dense run of bytes (in any inner order; the block stride may span other layers' pages), so
  a block is one row. block_order: that inner order; heads_tokens_order: it as the store
  namespace records it ("HNC", "NHC"). manager_blocks: a cache that the attention kernel
  splits into smaller blocks, viewed over vLLM's own blocks (where that keeps their bytes).
  whole_pages: every attention layer's block as one row, where vLLM's layout puts a block's
  layers side by side (block-outermost layouts): a page is then one copy, not one per layer.
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


def block_order(cache: torch.Tensor) -> tuple[int, ...] | None:
    """The dimensions after the first, from the outermost to the innermost in memory, where
    each block of ``cache`` (dimension 0) is one dense run of bytes; None where it is not
    (another dimension lies outside the blocks, or a block has holes). Dimensions of size 1
    may have any stride and come first (where they lie does not move a byte)."""
    if cache.dim() < 2:
        return None
    inner = [(int(cache.stride(d)), int(cache.shape[d]), d) for d in range(1, cache.dim())]
    # physical order: larger strides outside; a size-1 dimension has no stride that matters,
    # so it goes outermost (then the innermost dimension has stride 1, viewable as bytes)
    order = sorted(inner, key=lambda t: (t[1] > 1, -t[0], t[2]))
    step = 1
    for stride, size, _ in reversed(order):
        if size > 1 and stride != step:
            return None
        step *= size
    if cache.shape[0] > 1 and int(cache.stride(0)) < step:
        return None  # blocks overlap: the block dimension is not the outermost
    return tuple(d for _, _, d in order)


def heads_tokens_order(cache: torch.Tensor) -> str | None:
    """For vLLM's ``[blocks, heads, tokens, content]`` attention views, the order of a block's
    bytes: "HNC" or "NHC"; None where both read the same (one head or one token per block) or
    the view is not that shape."""
    if cache.dim() != 4 or cache.shape[1] == 1 or cache.shape[2] == 1:
        return None
    orders: dict[tuple[int, ...], str] = {(1, 2, 3): "HNC", (2, 1, 3): "NHC"}
    return orders.get(block_order(cache) or ())


def manager_blocks(name: str, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``cache`` as ``[num_blocks, heads, tokens, content]`` over vLLM's blocks (a view).

    Where the attention kernel takes smaller blocks than vLLM's manager, vLLM registers
    ``[num_blocks * r, heads, block_size / r, content]`` (``compute_layer_kv_cache_shape_bytes``
    and ``create_kv_cache_views`` in vllm/v1/kv_cache_interface.py; ``r`` kernel blocks make
    one block, adjacent). With the tokens outermost in each kernel block (NHC, or one head)
    the ``r`` kernel blocks continue one another's tokens: the block is the same bytes as an
    unsplit one, and this is its unsplit view. With the heads outermost (HNC) each kernel
    block restarts the heads, bytes that depend on a kernel size the scheduler never sees:
    DeviceError naming a layout that works."""
    if cache.dim() != 4 or cache.shape[0] == num_blocks or num_blocks <= 0:
        return cache
    ratio, rest = divmod(int(cache.shape[0]), num_blocks)
    if ratio < 2 or rest:
        return cache  # not kernel blocks: block_rows says what is wrong
    tokens = int(cache.shape[2])
    if int(cache.stride(0)) != tokens * int(cache.stride(2)):
        raise DeviceError(
            f"vLLM cache of layer {name!r}: shape {tuple(cache.shape)}, strides "
            f"{cache.stride()}: vLLM splits each of its {num_blocks} blocks into {ratio} kernel "
            f"blocks of {tokens} tokens with the heads outermost in each, bytes that depend on "
            "the kernel's block size (HiCacheConnector copies whole blocks): set "
            "VLLM_KV_CACHE_LAYOUT=LBNHC, or a --block-size the attention kernel takes whole"
        )
    return cache.as_strided(
        (num_blocks, int(cache.shape[1]), tokens * ratio, int(cache.shape[3])),
        (
            int(cache.stride(0)) * ratio,
            int(cache.stride(1)),
            int(cache.stride(2)),
            int(cache.stride(3)),
        ),
        cache.storage_offset(),
    )


def block_rows(name: str, cache: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """``cache`` as ``(num_blocks, block_bytes)`` uint8 rows (a view, no copy); DeviceError
    where the blocks are not first or a block is not one dense run of bytes.

    vLLM 0.32 registers each attention layer as a logical ``[blocks, heads, tokens, content]``
    view whose strides follow the resolved KV cache layout (``vllm/v1/kv_cache_layout.py``,
    ``create_kv_cache_views`` in ``vllm/v1/kv_cache_interface.py``): a block is one run for the
    layer-outermost layouts (LBNHC, LBHNC) and the block-outermost ones (BLNHC, BLHNC, whose
    block stride spans every layer's page); a row holds the block's bytes in memory order."""
    order = block_order(cache) if cache.shape[0] == num_blocks else None
    if order is None:
        raise DeviceError(
            f"vLLM cache of layer {name!r}: shape {tuple(cache.shape)}, strides "
            f"{cache.stride()}; expected the {num_blocks} blocks first, each one dense run of "
            "bytes (HiCacheConnector copies whole blocks; vLLM's layouts with heads outside "
            "the blocks, LHBNC and BHLNC, are not supported: set VLLM_KV_CACHE_LAYOUT=LBHNC)"
        )
    width = cache.element_size()
    for d in range(1, cache.dim()):
        width *= int(cache.shape[d])
    size = cache.element_size()
    # the inner dimensions in memory order: the innermost has stride 1, so the bytes can be
    # viewed as uint8; then one row of `width` bytes per block at the block stride
    physical = cache.permute(0, *order)
    try:
        flat = physical.view(torch.uint8)
    except RuntimeError as exc:  # an innermost dimension of size 1 with a stride > 1
        raise DeviceError(
            f"vLLM cache of layer {name!r}: shape {tuple(cache.shape)}, strides "
            f"{cache.stride()} cannot be viewed as bytes: {exc}"
        ) from exc
    return flat.as_strided(
        (num_blocks, width), (int(cache.stride(0)) * size, 1), flat.storage_offset()
    )


def whole_pages(rows: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The attention layers' block rows (``block_rows``, in the host page's column order) as
    one ``(num_blocks, page_bytes)`` row per block, where a block's every layer is one run
    in that order (vLLM's block-outermost layouts, BLHNC and BLNHC: the block stride spans
    every layer's page); None where it is not (the layer-outermost layouts: each layer's
    blocks lie apart). A view, no copy: one copy per page moves what one per layer did."""
    if len(rows) < 2:
        return None
    first = rows[0]
    nb, stride = int(first.shape[0]), int(first.stride(0))
    storage = first.untyped_storage()
    at = first.storage_offset()
    for r in rows:
        if (
            r.dtype != torch.uint8
            or r.dim() != 2
            or int(r.shape[0]) != nb
            or int(r.stride(0)) != stride
            or int(r.stride(1)) != 1
            or r.untyped_storage() is not storage
            or r.storage_offset() != at
        ):
            return None
        at += int(r.shape[1])
    width = at - first.storage_offset()
    if nb > 1 and width > stride:
        return None  # the pages would overlap
    return first.as_strided((nb, width), (stride, 1), first.storage_offset())


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


__all__ = [
    "block_order",
    "block_rows",
    "choose_copier",
    "heads_tokens_order",
    "manager_blocks",
    "state_rows",
    "whole_pages",
]
