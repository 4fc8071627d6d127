"""What the engine reports (private): its statistics, its summary, the forward pass's waits.

- Reporting: the part of TransferEngine that answers ``statistics()`` (counts, bytes, copy and
  exposed-wait time, operations queued and in flight, event-set reuse, the histograms of load
  latency and of each forward-pass wait), the summary logged at
  close, and ``note_wait`` (called from forward-pass threads, under a lock).
"""

from __future__ import annotations

import threading
from typing import Any

from hicache.engine._ops import Batch, EventSets, Op
from hicache.engine.histogram import Histogram
from hicache.engine.stats import EngineStatistics, OperationState


class Reporting:
    """Statistics; TransferEngine sets the state declared here."""

    _counts: dict[str, int]
    _running: list[Batch]
    _queued: list[Op]
    _wait_lock: threading.Lock
    _waited_s: float
    _load_seconds: Histogram
    _wait_seconds: Histogram
    _load_copy_s: float
    _backup_copy_s: float
    _event_sets: EventSets

    # ---------------------------------------------------------------------------------------
    # statistics
    # ---------------------------------------------------------------------------------------
    def statistics(self) -> EngineStatistics:
        c = self._counts
        in_flight = sum(
            1 for b in self._running for op in b.ops if op.state is OperationState.RUNNING
        )
        with self._wait_lock:
            waited = self._waited_s
            waits = c["layer_waits"]
        return EngineStatistics(
            loads=c["loads"],
            loads_failed=c["loads_failed"],
            loads_cancelled=c["loads_cancelled"],
            loads_joined=c["loads_joined"],
            backups=c["backups"],
            backups_failed=c["backups_failed"],
            backups_cancelled=c["backups_cancelled"],
            submissions=c["submissions"],
            bytes_loaded=c["bytes_loaded"],
            bytes_backed_up=c["bytes_backed_up"],
            load_copy_s=self._load_copy_s,
            backup_copy_s=self._backup_copy_s,
            exposed_wait_s=waited,
            layer_waits=waits,
            queued=len(self._queued),
            in_flight=in_flight,
            event_sets_created=self._event_sets.created,
            event_sets_reused=self._event_sets.reused,
            load_seconds=self._load_seconds.snapshot(),
            wait_seconds=self._wait_seconds.snapshot(),
        )

    def _summary(self) -> dict[str, Any]:
        s = self.statistics()
        return {
            "loads": s.loads,
            "backups": s.backups,
            "bytes_loaded": s.bytes_loaded,
            "bytes_backed_up": s.bytes_backed_up,
            "load_gbps": round(s.load_gbps, 3),
            "exposed_wait_ms": round(s.exposed_wait_s * 1e3, 3),
        }

    def note_wait(self, seconds: float) -> None:
        with self._wait_lock:
            self._waited_s += seconds
            self._counts["layer_waits"] += 1
        self._wait_seconds.observe(seconds)
