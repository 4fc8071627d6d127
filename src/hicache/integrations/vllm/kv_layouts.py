"""vLLM's KV cache layouts as the connector sees them (no vLLM, no torch import).

- BLOCK_RUN_LAYOUTS: the layouts of vLLM 0.32 (``vllm/v1/kv_cache_layout.py``, KVCacheLayout)
  in which each block of a layer is one dense run of bytes, the ones the connector copies
  (block_rows): layer-outermost LBHNC (the CPU backend's only one) and LBNHC (vLLM's pick where
  the backend states no preference, as FlashAttention does on CUDA), block-outermost BLHNC and
  BLNHC (a block holds every layer's page side by side). LHBNC and BHLNC keep the heads
  outside the blocks and are refused at start.
- LEGACY_NAMES: the older names vLLM still takes in ``VLLM_KV_CACHE_LAYOUT`` (NHD, HND:
  ``_LAYOUT_COMPAT_ALIASES`` in vllm/config/cache.py).
- check_layout_env(environ): ConfigError where ``VLLM_KV_CACHE_LAYOUT`` names a layout the
  connector cannot copy (LHBNC, BHLNC) or none vLLM knows; called from the connector's
  config-time hooks and ``hicache.integrations.vllm.check``, so the mistake is refused before
  the model loads rather than when the connector is built.
- block_bytes_order(name): the order of the bytes inside a block of a layout in
  BLOCK_RUN_LAYOUTS: "HNC" (heads, tokens, content) or "NHC"; where a layer's blocks lie
  (the L / B prefix) does not change them. The one mapping from a layout to what the store
  namespace records (tp_shape.block_order_of).
- HEADS_FIRST: the order of a block's bytes ("HNC": heads, tokens, content) that every page
  stored before the order was recorded has (vLLM's CPU layout, LBHNC); the store namespace
  leaves this order out, so those pages stay readable (tp_shape.namespace_ident).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from hicache.domain import ConfigError
from hicache.domain.errors import shown

BLOCK_RUN_LAYOUTS = ("LBHNC", "LBNHC", "BLHNC", "BLNHC")
HEADS_OUTSIDE_LAYOUTS = ("LHBNC", "BHLNC")
LEGACY_NAMES = {"NHD": "LBNHC", "HND": "LBHNC"}
HEADS_FIRST = "HNC"
ENV = "VLLM_KV_CACHE_LAYOUT"


def block_bytes_order(name: str) -> str:
    """ "HNC" or "NHC" for a layout in BLOCK_RUN_LAYOUTS (module docstring)."""
    return name[2:]


def check_layout_env(environ: Mapping[str, str] | None = None) -> None:
    """Refuse a ``VLLM_KV_CACHE_LAYOUT`` the connector cannot copy (module docstring)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV)
    if value is None or value == "":
        return
    name = LEGACY_NAMES.get(value, value)
    if name in BLOCK_RUN_LAYOUTS:
        return
    if name in HEADS_OUTSIDE_LAYOUTS:
        why = "keeps the heads outside the blocks (HiCacheConnector copies whole blocks)"
    else:
        why = "is no KV cache layout vLLM 0.32 names"
    raise ConfigError(
        f"{ENV}={shown(value)} {why}: expected one of {', '.join(BLOCK_RUN_LAYOUTS)} "
        f"(or {', '.join(LEGACY_NAMES)}), or leave it unset"
    )


__all__ = [
    "BLOCK_RUN_LAYOUTS",
    "ENV",
    "HEADS_FIRST",
    "HEADS_OUTSIDE_LAYOUTS",
    "LEGACY_NAMES",
    "block_bytes_order",
    "check_layout_env",
]
