"""Frozen snapshots the engine and its handles report.

- OperationState: queued, running, done, failed, cancelled (one load or backup as its handle sees it).
- OperationStatistics: one handle's figures (bytes, copy time, time its consumer waited).
- EngineStatistics: the engine's totals (operations by outcome, bytes, GB/s, exposed wait time,
  histograms of load latency and of each forward-pass wait).
"""

from __future__ import annotations

import enum

import attrs

from hicache.engine.histogram import HistogramSnapshot


class OperationState(enum.Enum):
    QUEUED = "queued"  # prepared, waiting for engine.submit()
    RUNNING = "running"  # submitted to the copy stream
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (OperationState.DONE, OperationState.FAILED, OperationState.CANCELLED)


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


@attrs.frozen(kw_only=True)
class OperationStatistics:
    """One load or backup as one handle sees it.

    ``copy_s`` is the stream time of the steps that carried this operation's pages (shared with
    the operations merged into the same submission); ``waited_s`` is the time this handle's
    consumer spent in ``wait_layer`` and the async waits.
    """

    op: int
    kind: str
    state: OperationState
    pages: int
    layers: int
    bytes: int
    copy_s: float
    waited_s: float
    waits: int
    joined: bool

    @property
    def gbps(self) -> float:
        return _gbps(self.bytes, self.copy_s)

    def as_json(self) -> dict[str, object]:
        return {
            "op": self.op,
            "kind": self.kind,
            "state": self.state.value,
            "pages": self.pages,
            "layers": self.layers,
            "bytes": self.bytes,
            "copy_s": self.copy_s,
            "waited_s": self.waited_s,
            "waits": self.waits,
            "joined": self.joined,
            "gbps": self.gbps,
        }


@attrs.frozen(kw_only=True)
class EngineStatistics:
    """The engine's totals since it was created.

    Operations count once however many handles share them; ``loads_joined`` counts the handles
    that joined a load already in flight. ``exposed_wait_s`` is the time consumers spent waiting
    for layers (``wait_layer`` and the async waits): copy time that compute did not hide.
    ``load_seconds``: per successful load, the time from its prepare to the engine settling it
    (queueing, the copies, and up to one reaper poll, 1 ms). ``wait_seconds``: per forward-pass
    wait on a load (``wait_layer``, ``wait_layer_ready``, ``wait``), the time it blocked (0 when
    the layer was already there); its sum is ``exposed_wait_s``.
    """

    loads: int
    loads_failed: int
    loads_cancelled: int
    loads_joined: int
    backups: int
    backups_failed: int
    backups_cancelled: int
    submissions: int
    bytes_loaded: int
    bytes_backed_up: int
    load_copy_s: float
    backup_copy_s: float
    exposed_wait_s: float
    layer_waits: int
    queued: int
    in_flight: int
    event_sets_created: int
    event_sets_reused: int
    load_seconds: HistogramSnapshot
    wait_seconds: HistogramSnapshot

    @property
    def load_gbps(self) -> float:
        return _gbps(self.bytes_loaded, self.load_copy_s)

    @property
    def backup_gbps(self) -> float:
        return _gbps(self.bytes_backed_up, self.backup_copy_s)

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = attrs.asdict(self, recurse=False)
        out["load_seconds"] = self.load_seconds.as_json()
        out["wait_seconds"] = self.wait_seconds.as_json()
        out["load_gbps"] = self.load_gbps
        out["backup_gbps"] = self.backup_gbps
        return out
