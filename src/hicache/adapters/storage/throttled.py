"""A directory store whose reads are throttled: a slow storage tier for benches and tests.

- ThrottledStore(config): hicache's DirectoryStore (its extra config keys) whose ``get``
  sleeps, after reading, long enough that the call takes at least ``bytes read /
  read_mib_s`` seconds (writes, ``exists`` and the rest run at full speed). A "dynamic" store
  plug-in: ``{"module_path": "hicache.adapters.storage.throttled", "class_name":
  "ThrottledStore", "root": ..., "read_mib_s": 4}`` (``hicache bench vllm --slow-store``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from hicache.adapters.storage.delegating import DelegatingStore
from hicache.adapters.storage.directory import DirectoryStore
from hicache.domain import ConfigError
from hicache.domain.storage import PageBuffer, StoreKey, StoreStatus, buffer_nbytes

PLUGIN_KEYS = ("module_path", "class_name", "backend_name")


class ThrottledStore(DelegatingStore):
    """DirectoryStore whose reads run at no more than ``read_mib_s`` MiB/s."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        config = dict(config)
        rate = config.pop("read_mib_s", None)
        if (
            isinstance(rate, bool)
            or not isinstance(rate, int | float)
            or not math.isfinite(rate)
            or rate <= 0
        ):
            raise ConfigError(
                f"ThrottledStore 'read_mib_s' = {rate!r}: expected a positive number of MiB/s"
            )
        self.read_bytes_per_s = float(rate) * (1 << 20)
        for key in PLUGIN_KEYS:
            config.pop(key, None)
        super().__init__(DirectoryStore.from_config(config))

    @property
    def name(self) -> str:
        return "throttled-directory"

    def get(
        self,
        keys: Sequence[StoreKey],
        buffers: Sequence[PageBuffer],
        *,
        deadline: float | None = None,
    ) -> list[StoreStatus]:
        t0 = time.perf_counter()
        out = self.inner.get(keys, buffers, deadline=deadline)
        nbytes = sum(buffer_nbytes(b) for b, s in zip(buffers, out, strict=True) if s.ok)
        rest = nbytes / self.read_bytes_per_s - (time.perf_counter() - t0)
        if rest > 0:
            time.sleep(rest)
        return out
