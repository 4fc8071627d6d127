"""hicache as an SGLang HiCache storage backend (``--hicache-storage-backend dynamic``).

SGLang's factory loads it with extra config ``{"backend_name": "hicache", "module_path":
"hicache.integrations.sglang", "class_name": "HiCacheBackend", ...}`` (docs/sglang.md).

- backend: HiCacheBackend, SGLang's HiCacheStorage calls (legacy, v1, v2) over one read path
  and one write path.
- tiers: the backend's store, its bounded per-pool tiers and metrics exports; close.
- moves: the one read path and one write path (zero-copy, staged or flat pages), lookups.
- v2: the v2 calls of hybrid side pools (hit policies, per-pool transfers).
- stats: SGLang's get_stats window and hicache's statistics() of a backend.
- arguments: the calls' arguments (keys, host indices, flat pages) checked; ConfigError else.
- pages: a registered SGLang host pool's pages, zero-copy segments or flat copies.
- keys: SGLang's page keys as hicache store keys; a pool's namespace.
- settings: the ``storage_extra_config`` keys, parsed and checked.
- metrics: hicache's metrics of a backend.
- sglang_imports: importing SGLang's host-pool modules where torchvision is absent.
- bench, soak: ``hicache bench sglang`` and the SGLang path of ``hicache bench soak``.

Importing this package imports neither SGLang nor torch: ``HiCacheBackend`` is imported from
``backend`` (which imports SGLang) on first access, so ``sglang_imports`` can be used before
SGLang is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hicache.integrations.sglang.backend import HiCacheBackend

__all__ = ["HiCacheBackend"]


def __getattr__(name: str) -> Any:
    if name == "HiCacheBackend":
        return importlib.import_module("hicache.integrations.sglang.backend").HiCacheBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
