"""vLLM's KV cache layouts as the connector sees them (no vLLM, no torch import).

- BLOCK_RUN_LAYOUTS: the layouts of vLLM 0.32 (``vllm/v1/kv_cache_layout.py``, KVCacheLayout)
  in which each block of a layer is one dense run of bytes, the ones the connector copies
  (block_rows): layer-outermost LBHNC (the CPU backend's only one) and LBNHC (vLLM's pick where
  the backend states no preference, as FlashAttention does on CUDA), block-outermost BLHNC and
  BLNHC (a block holds every layer's page side by side). LHBNC and BHLNC keep the heads
  outside the blocks and are refused at start.
- HEADS_FIRST: the order of a block's bytes ("HNC": heads, tokens, content) that every page
  stored before the order was recorded has (vLLM's CPU layout, LBHNC); the store namespace
  leaves this order out, so those pages stay readable (tp_shape.namespace_ident).
"""

from __future__ import annotations

BLOCK_RUN_LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
HEADS_FIRST = "HNC"

__all__ = ["BLOCK_RUN_LAYOUTS", "HEADS_FIRST"]
