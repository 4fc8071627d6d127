"""Keys and namespaces of hicache's SGLang backend (torch-free; SGLang's config passed in).

- page_key(key): SGLang's 64-hex page key as the 32 bytes hicache keys pages by.
- pool_namespace(config, name, description): the namespace of one SGLang pool on one rank, and
  whether the pool's bytes are rank-replicated.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

NAMESPACE_VERSION = 1
_HEX = re.compile(r"^[0-9a-f]{64}$")
_SLUG = re.compile(r"[^0-9A-Za-z_.]+")
# SGLang's Mamba state is sharded per tp rank even where the model's KV is replicated
# (HiCacheFile._get_suffixed_key in python/sglang/srt/mem_cache/hicache_storage.py).
PER_RANK_POOLS = frozenset({"mamba"})


def page_key(key: str) -> bytes:
    """SGLang's page key (a 64-hex sha256 chain) as the 32 bytes hicache keys pages by; any
    other text (an engine's own key scheme, tests) is hashed to 32 bytes."""
    if _HEX.match(key):
        return bytes.fromhex(key)
    return hashlib.sha256(key.encode()).digest()


def _slug(model: str) -> str:
    return _SLUG.sub("_", model.strip()).strip("_")[:64] or "model"


def pool_namespace(config: Any, name: str, description: str) -> tuple[str, bool]:
    """The namespace of one SGLang pool on this rank, and whether it is rank-replicated.

    A sha256 over the model, the pool (name, class, layout, page size, page bytes, dtypes,
    layers), the pipeline, context-parallel and decode-context-parallel position and, unless
    the pool's bytes are the same on every tp rank (SGLang's ``is_mla_model``, never for Mamba
    state), ``tp_rank/tp_size``: a changed setting is another namespace, so a miss.
    """
    replicated = bool(config.is_mla_model) and name not in PER_RANK_POOLS
    parts = [
        f"sglang-v{NAMESPACE_VERSION}",
        f"model={config.model_name or ''}",
        f"pool={name}",
        description,
        f"pp={config.pp_rank}/{config.pp_size}",
        f"cp={config.attn_cp_rank}/{config.attn_cp_size}",
        f"dcp={config.dcp_rank}/{config.dcp_size}",
        f"heads={config.should_split_heads}/{config.tp_lcm_size}",
    ]
    if not replicated:
        parts.append(f"tp={config.tp_rank}/{config.tp_size}")
    digest = hashlib.sha256("|".join(parts).encode()).hexdigest()[:24]
    return f"{_slug(config.model_name or 'model')}-{digest}", replicated
