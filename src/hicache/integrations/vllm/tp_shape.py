"""Whether a model's saved pages can be read at another tensor parallel size, and the namespace
that then leaves the size out.

- tp_heads(vllm_config, kv_cache_config, attn_group, has_state): the model's TpHeads (hicache.integrations.vllm.
  tp_plan) where a rank's block is its KV heads' bytes and nothing else: one attention group
  (dense models), vLLM's plain K/V cells (no padded page, no packed head slots or content), no
  decode context parallelism. MLA (latent KV every rank holds whole) is ``replicated``. None
  otherwise: hybrid models (Mamba / linear attention states are split by TP in ways a head
  slice does not describe) and sliding-window groups beside full attention (their window
  pages are read at the size that saved them; ``has_state`` covers both) keep the TP size in
  their namespace, so a server of another size never reads their pages (a miss, recomputed).
- namespace_ident(model, dtype, block_size, layout, kv, tp, heads, block_order): what the
  store namespace hashes: model, dtype, block size and the layers; then either the TP size
  (heads None) or the bytes per KV head of each layer and the model's KV heads (the same at
  every size); and the order of a block's bytes where it is not heads-first.
- block_order_of(vllm_config, kv_cache_config): the order of the bytes inside an attention
  block under vLLM's resolved KV cache layout: "HNC" (heads, tokens, content: LBHNC, BLHNC),
  "NHC" (LBNHC, BLNHC), None where vLLM has not resolved one; ConfigError for the layouts with
  heads outside the blocks (LHBNC, BHLNC), whose blocks are not one run of bytes.

Reference: vllm/v1/kv_cache_interface.py (AttentionSpec: num_kv_heads, page_size_padded,
num_head_slots, state_content_bytes; MLAAttentionSpec), vllm/config/model.py
(get_total_num_kv_heads, get_num_kv_heads), vllm/v1/kv_cache_layout.py (KVCacheLayout),
vllm/v1/attention/backends/utils.py (resolve_kv_cache_layout, recorded on
KVCacheConfig.kv_cache_layout by vllm/v1/engine/core.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import AttentionSpec, MLAAttentionSpec

from hicache.domain import ConfigError
from hicache.domain.errors import shown
from hicache.integrations.vllm.kv_layouts import (
    BLOCK_RUN_LAYOUTS,
    HEADS_FIRST,
    block_bytes_order,
)
from hicache.integrations.vllm.tp_plan import TpHeads, compatible

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig


def tp_heads(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, attn_group: int, has_state: bool
) -> TpHeads | None:
    """The model's TpHeads (``attn_group``: the saved attention group; ``has_state``: a hybrid
    model), or None where its pages are not read across TP sizes."""
    if has_state:
        return None
    spec = kv_cache_config.kv_cache_groups[attn_group].kv_cache_spec
    if not isinstance(spec, AttentionSpec):
        return None
    if any(
        getattr(spec, name, None) is not None
        for name in ("page_size_padded", "num_head_slots", "state_content_bytes")
    ):
        return None
    par = vllm_config.parallel_config
    if int(getattr(par, "decode_context_parallel_size", 1)) != 1:
        return None
    if isinstance(spec, MLAAttentionSpec) or vllm_config.model_config.use_mla:
        return TpHeads(1, replicated=True)
    tp = int(par.tensor_parallel_size)
    total = int(vllm_config.model_config.get_total_num_kv_heads())
    if not compatible(total, tp):
        return None
    heads = TpHeads(total)
    return heads if int(spec.num_kv_heads) == heads.per_rank(tp) else None


def namespace_ident(
    model: str,
    dtype: str,
    block_size: int,
    layout: object,
    kv: Sequence[tuple[str, int]],
    tp: int,
    heads: TpHeads | None,
    block_order: str | None = None,
) -> str:
    """The text the store namespace hashes (see the module docstring): ``layout`` (the
    connector's Layout, by its repr) with the TP size, or each ``kv`` layer's (name, bytes per
    block) as bytes per KV head; ``block_order`` where it is not heads-first (pages whose bytes
    lie in another order are other pages)."""
    if heads is None:
        ident: tuple[object, ...] = (model, dtype, block_size, layout, tp)
    else:
        per = heads.per_rank(tp)
        per_head = tuple((name, nbytes // per) for name, nbytes in kv)
        ident = (model, dtype, block_size, per_head, heads, "any tp")
    if block_order is not None and block_order != HEADS_FIRST:
        ident = (*ident, f"block bytes {block_order}")
    return repr(ident)


def block_order_of(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> str | None:
    """The order of an attention block's bytes under vLLM's resolved layout (module docstring)."""
    name = getattr(kv_cache_config, "kv_cache_layout", None) or getattr(
        vllm_config.cache_config, "kv_cache_layout", None
    )
    if name is None:
        return None
    from vllm.v1.kv_cache_layout import KVCacheLayout

    try:
        layout = KVCacheLayout[str(name)]
    except KeyError:
        raise ConfigError(
            f"HiCacheConnector: vLLM's KV cache layout {shown(name)} is not one this vLLM "
            f"names ({', '.join(m.name for m in KVCacheLayout)})"
        ) from None
    if layout.name not in BLOCK_RUN_LAYOUTS:  # the same list VLLM_KV_CACHE_LAYOUT is checked on
        raise ConfigError(
            f"HiCacheConnector: vLLM's KV cache layout {layout.name} keeps the heads outside "
            "the blocks (a block is not one run of bytes, which the connector copies whole); "
            f"set VLLM_KV_CACHE_LAYOUT to one of {', '.join(BLOCK_RUN_LAYOUTS)}"
        )
    return block_bytes_order(layout.name)


__all__ = ["block_order_of", "namespace_ident", "tp_heads"]
