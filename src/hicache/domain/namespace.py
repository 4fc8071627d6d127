"""Namespaces: what makes two copies of the same page's bytes incompatible, kept beside its key.

- RankIdentity: the model name and this process's tp and pp ranks.
- rank_replicated: whether a pool's bytes are the same on every tp rank (latent attention, MLA).
- pool_namespace: the namespace of one pool of a host group on one rank (a StoreKey token).
- group_namespaces: the namespace of every pool of a group.
- store_keys: the StoreKeys of a pool for a run of page keys.

A namespace is ``<model slug>-<24 hex digits>``: the digits are a sha256 over a canonical text
of the format version, the model name and type, the pool's name, geometry kind, buffers (name,
shape, dtype), layout, page size, layer count and model layer ids, the pipeline stage, and, unless
the pool is rank-replicated, ``tp_rank/tp_size``. The page key (hicache.domain.keys) never
includes any of this, so one token prefix has one key in every deployment and the namespace
alone separates incompatible bytes. SGLang's file store does the same with a key suffix
(``_{model}_{tp_rank}_{tp_size}``, no rank for MLA, ``_{pp_size}_{pp_rank}`` under pp; see
python/sglang/srt/mem_cache/hicache_storage.py, HiCacheFile).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence

import attrs

from hicache.domain.errors import ConfigError
from hicache.domain.geometry import MLAGeometry
from hicache.domain.keys import PageKey
from hicache.domain.pools import HostGroupPlan, PoolName, PoolPlan
from hicache.domain.storage import StoreKey
from hicache.domain.validators import nonneg_int

NAMESPACE_VERSION = 1
_SLUG = re.compile(r"[^0-9A-Za-z_.]+")


@attrs.frozen(kw_only=True)
class RankIdentity:
    """Who writes the bytes: the served model's name and this rank's position."""

    model: str
    tp_rank: int = attrs.field(default=0, validator=nonneg_int)
    pp_rank: int = attrs.field(default=0, validator=nonneg_int)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError(f"model name {self.model!r}: expected a non-empty string")


def rank_replicated(pool: PoolPlan) -> bool:
    """True when every tp rank holds the same bytes for this pool (MLA latents)."""
    return isinstance(pool.geometry, MLAGeometry)


def _slug(model: str) -> str:
    return _SLUG.sub("_", model.strip()).strip("_")[:64] or "model"


def _describe(plan: HostGroupPlan, pool: PoolPlan, rank: RankIdentity) -> str:
    model_layers = plan.model_layers
    layers = (
        [model_layers[t] for t in pool.binding.transfer_layers]
        if model_layers is not None
        else list(pool.binding.transfer_layers)
    )
    buffers = ";".join(
        f"{b.name}:{'x'.join(map(str, b.shape))}:{b.dtype.value}" for b in pool.geometry.buffers
    )
    parts = [
        f"v{NAMESPACE_VERSION}",
        f"model={rank.model}",
        f"type={plan.model_type}",
        f"pool={pool.name.value}",
        f"kind={pool.geometry.kind}",
        f"buffers={buffers}",
        f"layout={pool.layout.value}",
        f"page={pool.page_size}",
        f"layers={len(layers)}:{','.join(map(str, layers))}",
        f"stage={plan.stage}",
        f"pp_rank={rank.pp_rank}",
    ]
    if not rank_replicated(pool):
        parts.append(f"tp={rank.tp_rank}/{plan.tp_size}")
    return "|".join(parts)


def pool_namespace(plan: HostGroupPlan, pool: PoolName | str, rank: RankIdentity) -> str:
    """The namespace of ``pool`` of ``plan`` on ``rank``; ConfigError for a rank out of range."""
    if rank.tp_rank >= plan.tp_size:
        raise ConfigError(f"tp_rank {rank.tp_rank} is out of range for tp_size {plan.tp_size}")
    p = plan.pool(pool)
    # A sidecar borrows the anchor's indices but its bytes are its own: it gets its own namespace.
    digest = hashlib.sha256(_describe(plan, p, rank).encode()).hexdigest()[:24]
    return f"{_slug(rank.model)}-{digest}"


def group_namespaces(plan: HostGroupPlan, rank: RankIdentity) -> dict[PoolName, str]:
    """The namespace of every pool of ``plan`` (anchor, sidecars, independent pools)."""
    return {p.name: pool_namespace(plan, p.name, rank) for p in plan.pools}


def store_keys(namespace: str, pool: PoolName, keys: Sequence[PageKey]) -> list[StoreKey]:
    """One StoreKey per page key for ``pool`` under ``namespace``."""
    return [StoreKey(namespace, pool.value, k.hex()) for k in keys]
