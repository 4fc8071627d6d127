"""The SGLang backend's statistics: SGLang's per-call window and hicache's per-pool figures.

- CallWindow: the pages and GB/s of each prefetch (get) and backup (set) call since SGLang last
  asked; ``drain()`` hands them over as SGLang's ``StorageMetrics`` (what ``get_stats`` returns)
  and starts a new window. Thread-safe (SGLang's controller threads note, its scheduler drains).
- backend_statistics(tiers, skipped_non_writer): hicache's statistics of a backend: per pool, its
  namespace, zero-copy state and its StorageTier's statistics (pages, bytes, calls, statuses,
  breaker), and the bounded storage's timed-out and refused calls.

Importing this module does not import SGLang: ``drain`` imports StorageMetrics when called.
"""

from __future__ import annotations

import enum
import threading
from typing import Any

import attrs

from hicache.integrations.sglang.tiers import BackendTiers


def _plain(_inst: object, _field: object, value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


class CallWindow:
    """SGLang's statistics of the calls since the last ``drain`` (module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._metrics: dict[str, list[float]] = {
            "prefetch_pgs": [],
            "backup_pgs": [],
            "prefetch_bandwidth": [],
            "backup_bandwidth": [],
        }

    def note(self, kind: str, pages: int, page_bytes: int, seconds: float) -> None:
        """One call of ``kind`` ("prefetch" or "backup") moved ``pages`` in ``seconds``."""
        if not pages:
            return
        with self._lock:
            self._metrics[f"{kind}_pgs"].append(pages)
            gbs = pages * page_bytes / max(seconds, 1e-9) / 1e9
            self._metrics[f"{kind}_bandwidth"].append(gbs)

    def drain(self) -> Any:
        """SGLang's StorageMetrics of the window, which starts anew."""
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            drained = {k: list(v) for k, v in self._metrics.items()}
            for v in self._metrics.values():
                v.clear()
        return StorageMetrics(
            prefetch_pgs=[int(x) for x in drained["prefetch_pgs"]],
            backup_pgs=[int(x) for x in drained["backup_pgs"]],
            prefetch_bandwidth=drained["prefetch_bandwidth"],
            backup_bandwidth=drained["backup_bandwidth"],
        )


def backend_statistics(tiers: BackendTiers, skipped_non_writer: int) -> dict[str, Any]:
    """hicache's statistics of a backend (module docstring)."""
    pools = {
        name: {
            "namespace": p.namespace,
            "replicated": p.replicated,
            "zero_copy": p.pages.zero_copy,
            "copy_reason": p.pages.copy_reason,
            "page_bytes": p.pages.flat_nbytes,
            "tier": attrs.asdict(p.tier.statistics(), value_serializer=_plain),
        }
        for name, p in list(tiers.pools.items())
    }
    bounded = tiers.bounded.statistics()
    return {
        "store": tiers.store.name,
        "pools": pools,
        "timed_out_calls": bounded.timed_out_calls,
        "refused_while_stuck": bounded.refused_while_stuck,
        "skipped_non_writer": skipped_non_writer,
    }
