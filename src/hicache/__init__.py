"""hicache: hierarchical KV-cache memory (host L2, storage L3) for LLM serving engines.

Importing hicache loads neither torch nor any adapter; see hicache.domain for the pure model,
hicache.bootstrap for building real pools, and hicache.engine for the async transfer engine.
"""

from hicache.domain import (
    HiCacheError,
    HostGroupPlan,
    ModelSpec,
    PlanSettings,
    StorageSettings,
    plan_stack,
)

__version__ = "0.1.0"

__all__ = [
    "HiCacheError",
    "HostGroupPlan",
    "ModelSpec",
    "PlanSettings",
    "StorageSettings",
    "__version__",
    "plan_stack",
]
