"""hicache's metrics in a vLLM process: one IntegrationCounters("vllm") per process, exported as
the connector's extra config asks (docs/vllm.md, "Metrics").

- process_counters(): this process's IntegrationCounters (source ``vllm``), inside this
  process's HiCacheMetrics; every HiCacheConnector built in the process counts into it (the
  scheduler role: lookups and hits per tier; the worker role: loads, saves, store errors).
- export(settings, offset): ``metrics_port`` serves the process's metrics on
  127.0.0.1:(metrics_port + offset) (the scheduler passes 0, worker rank r passes 1 + r);
  ``metrics: register`` adds them to prometheus_client's global REGISTRY. Once per process: a
  second connector in the same process (vLLM without multiprocessing builds both roles in one)
  reuses what the first started. Returns the URL served, or None.

Counters live in the process that counts them: vLLM's API server (whose /metrics serves the
global REGISTRY) sees them only when the engine runs in its process.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from hicache.metrics import HiCacheMetrics, IntegrationCounters

if TYPE_CHECKING:
    from hicache.integrations.vllm.settings import ConnectorSettings

_lock = threading.Lock()
_metrics: HiCacheMetrics | None = None
_counters: IntegrationCounters | None = None
_url: str | None = None
_served = False
_registered = False


def process_metrics() -> HiCacheMetrics:
    """This process's HiCacheMetrics (holding process_counters())."""
    global _metrics, _counters
    with _lock:
        if _metrics is None:
            _metrics = HiCacheMetrics()
            _counters = IntegrationCounters("vllm")
            _metrics.add_source(_counters)
        return _metrics


def process_counters() -> IntegrationCounters:
    process_metrics()
    assert _counters is not None
    return _counters


def export(settings: ConnectorSettings, offset: int) -> str | None:
    """Serve and/or register this process's metrics as ``settings`` asks (once per process)."""
    global _url, _served, _registered
    if settings.metrics_port is None and settings.metrics != "register":
        return _url
    from hicache.metrics import prometheus  # the optional extra, only when asked for

    metrics = process_metrics()
    with _lock:
        if settings.metrics == "register" and not _registered:
            prometheus.register(metrics)
            _registered = True
        if settings.metrics_port is not None and not _served:
            server = prometheus.serve(metrics, settings.metrics_port + offset)
            _served, _url = True, server.url
        return _url
