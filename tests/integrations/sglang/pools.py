"""SGLang's real host pools built on CPU over plain tensors (pinning off), for the tests.

Each builder returns a pool of SGLang's own class; the geometry is small but complete (several
layers, heads, pages) so that every segment and layout path runs.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.mem_cache.device_pool_info import (
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
DEVICE_TOKENS = 64


def _ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def mha_pool(
    layout: str,
    *,
    layers: int = 3,
    heads: int = 2,
    head_dim: int = 8,
    page_size: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    allocator: str = "default",
    ratio: float = 2.0,
) -> Any:
    k = tuple(torch.zeros(DEVICE_TOKENS, heads, head_dim, dtype=dtype) for _ in range(layers))
    v = tuple(torch.zeros(DEVICE_TOKENS, heads, head_dim, dtype=dtype) for _ in range(layers))
    info = MHABufferInfo(
        buffers=KVBuffers(
            k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD
        ),
        page_size=page_size,
        head_num=heads,
        head_dim=head_dim,
        v_head_dim=head_dim,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MHATokenToKVPoolHost(
        info,
        ratio,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=layers,
    )


def mla_pool(
    layout: str,
    *,
    layers: int = 3,
    kv_lora_rank: int = 16,
    rope_dim: int = 8,
    page_size: int = 4,
    dtype: torch.dtype = torch.bfloat16,
    allocator: str = "default",
) -> Any:
    width = kv_lora_rank + rope_dim
    bufs = tuple(torch.zeros(DEVICE_TOKENS, 1, width, dtype=dtype) for _ in range(layers))
    info = MLABufferInfo(
        buffers=bufs,
        data_ptrs=_ptrs(bufs),
        layer_indices=tuple(range(layers)),
        device_layer_num=layers,
        page_size=page_size,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=rope_dim,
        kv_cache_dim=width,
        dtype=dtype,
        device=torch.device("cpu"),
    )
    return MLATokenToKVPoolHost(
        info,
        2.0,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
    )


def mamba_pool(
    layout: str = "page_first", *, layers: int = 2, slots: int = 16, allocator: str = "default"
) -> Any:
    from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    info = MambaStateBufferInfo(
        temporal=torch.zeros(layers, slots, 4, 8, dtype=torch.float32),
        conv=(torch.zeros(layers, slots, 6, 3, dtype=torch.bfloat16),),
    )
    return MambaPoolHost(
        info,
        2.0,
        0,
        device_capacity=slots,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        layout=layout,
    )


def minimax_index_pool(
    anchor: Any, layout: str, *, layers: int = 2, row_bytes: int = 48, allocator: str = "default"
) -> Any:
    """SGLang's MiniMax (M3, NVFP4) index-K side pool beside ``anchor`` (same pages)."""
    from sglang.srt.mem_cache.device_pool_info import PageRowBufferInfo
    from sglang.srt.mem_cache.pool_host.minimax_m3_nvfp4 import MiniMaxM3Nvfp4IndexKPoolHost

    pages = DEVICE_TOKENS // anchor.page_size
    slab = torch.zeros(layers, pages, row_bytes, dtype=torch.uint8)
    info = PageRowBufferInfo(
        slab=slab,
        rows=tuple(slab[i] for i in range(layers)),
        row_bytes=row_bytes,
        page_size=anchor.page_size,
        num_pages=pages,
    )
    return MiniMaxM3Nvfp4IndexKPoolHost(
        info,
        anchor,
        layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator,
        start_layer=0,
        end_layer=layers,
    )


def dsa_indexer_pool(
    anchor: Any, *, layers: int = 3, bytes_per_token: int = 20, allocator: str = "default"
) -> Any:
    """SGLang's DSA indexer side pool beside an MLA ``anchor``. Its device side is a minimal
    stand-in (the attributes the host pool reads: per-layer index buffers, layers, dtype): a real
    DSATokenToKVPool needs CUDA kernels; no device transfer runs in these tests."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost
    from sglang.srt.mem_cache.pool_host.host_pool_decl import HostPoolDecl, HostPoolStorageInfo

    page = anchor.page_size
    index = [
        torch.zeros(DEVICE_TOKENS // page, page * bytes_per_token, dtype=torch.uint8)
        for _ in range(layers)
    ]
    device = SimpleNamespace(
        store_dtype=torch.uint8,
        start_layer=0,
        end_layer=layers,
        layer_num=layers,
        device="cpu",
        layer_shard_enabled=False,
        index_k_with_scale_buffer=index,
        page_size=page,
    )
    decl = HostPoolDecl(
        pool_name=PoolName.INDEXER,
        device_pool=device,
        indices_from_pool=PoolName.KV,
        layout_source=PoolName.KV,
        storage_info=HostPoolStorageInfo(
            bytes_per_token_per_layer=bytes_per_token, dtype=torch.uint8
        ),
        host_pool_builder=None,
    )
    return DSAIndexerPoolHost(
        decl, anchor, pin_memory=False, device="cpu", allocator_type=allocator
    )


def fill_page(pool: Any, token: int, seed: int) -> bytes:
    """Write random bytes into the page at host token ``token`` through SGLang's own flat-page
    API; returns them."""
    dummy = pool.get_dummy_flat_data_page()
    nbytes = dummy.numel() * dummy.element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    pool.set_from_flat_data_page(token, raw.view(dummy.dtype))
    return page_bytes(pool, token)


def page_bytes(pool: Any, token: int) -> bytes:
    """SGLang's flat page at host token ``token``, as bytes."""
    flat = pool.get_data_page(token, flat=True).contiguous()
    return bytes(flat.reshape(-1).view(torch.uint8).numpy())


def tokens(pool: Any, first_page: int, pages: int) -> torch.Tensor:
    """Host token indices of ``pages`` pages from ``first_page`` (what SGLang passes)."""
    ps = pool.page_size
    return torch.arange(first_page * ps, (first_page + pages) * ps, dtype=torch.int64)


def keys(n: int, salt: str = "") -> list[str]:
    """SGLang-style page keys: 64-hex sha256 digests."""
    import hashlib

    return [hashlib.sha256(f"{salt}page{i}".encode()).hexdigest() for i in range(n)]


def minimax_k_only_pool(
    anchor: Any, layout: str, *, layers: int = 2, heads: int = 1, head_dim: int = 16
) -> Any:
    """SGLang's MiniMax sparse index-K side pool (K only, no V) beside an MHA ``anchor``. Its
    device side is a minimal stand-in (per-layer K buffers, geometry, dtype): no device transfer
    runs in these tests."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKOnlyPoolHost

    k = [torch.zeros(DEVICE_TOKENS, heads, head_dim, dtype=torch.bfloat16) for _ in range(layers)]
    device = SimpleNamespace(
        store_dtype=torch.bfloat16,
        start_layer=0,
        end_layer=layers,
        head_num=heads,
        head_dim=head_dim,
        layer_num=layers,
        k_buffer=k,
        device="cpu",
        layer_shard_enabled=False,
    )
    return MHATokenToKOnlyPoolHost(device, anchor, layout, pin_memory=False, device="cpu")
