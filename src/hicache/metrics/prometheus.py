"""hicache's metrics for Prometheus: the one module that imports prometheus_client.

Needs the optional extra (``pip install 'hicache[metrics]'``); importing this module without it
raises ConfigError naming the extra. Nothing else in hicache imports it, so the library runs
without prometheus-client.

- PrometheusCollector(metrics): a custom collector; at each scrape it reads the sources of a
  HiCacheMetrics (hicache.metrics.families) and yields Prometheus metric families. Register it
  in the framework's own CollectorRegistry (``register``) or serve it (``serve``).
- register(metrics, registry=None): adds a PrometheusCollector to ``registry`` (default
  prometheus_client's global REGISTRY, the one vLLM and SGLang expose) and returns it.
- serve(metrics, port, addr="127.0.0.1", registry=None): an HTTP endpoint of its own (a daemon
  thread, prometheus_client.start_http_server); port 0 picks a free one. Returns a
  MetricsServer (``port``, ``url``, ``close()``).
- unregister(collector, registry=None): undoes ``register``.
- exposition(metrics): the text format of one scrape (what a file or a test reads).

See docs/metrics.md.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Iterator

from hicache.domain.errors import ConfigError
from hicache.domain.exc_info import ExcTraceback, ExcType, ExcValue

try:
    from prometheus_client import CollectorRegistry, generate_latest, start_http_server
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
        Metric,
    )
    from prometheus_client.registry import REGISTRY, Collector
except ModuleNotFoundError as exc:  # pragma: no cover - the test environment has the extra
    raise ConfigError(
        "hicache.metrics.prometheus needs prometheus-client, which is not installed: "
        "pip install 'hicache[metrics]'"
    ) from exc

from hicache.engine.histogram import HistogramSnapshot
from hicache.metrics.families import Family, HiCacheMetrics


def _check_metrics(arg: str, metrics: object) -> HiCacheMetrics:
    if not isinstance(metrics, HiCacheMetrics):
        raise ConfigError(f"{arg} must be a HiCacheMetrics, got {type(metrics).__name__}")
    return metrics


def _metric(fam: Family) -> Metric:
    labels = list(fam.labels)
    if fam.kind == "counter":
        counter = CounterMetricFamily(fam.name, fam.help, labels=labels)
        for values, v in fam.samples.items():
            counter.add_metric(list(values), _number(fam, v))
        return counter
    if fam.kind == "gauge":
        gauge = GaugeMetricFamily(fam.name, fam.help, labels=labels)
        for values, v in fam.samples.items():
            gauge.add_metric(list(values), _number(fam, v))
        return gauge
    hist = HistogramMetricFamily(fam.name, fam.help, labels=labels)
    for values, v in fam.samples.items():
        if not isinstance(v, HistogramSnapshot):
            raise ConfigError(f"histogram {fam.name!r}: sample {values!r} is {v!r}")
        buckets = [
            ("+Inf" if math.isinf(le) else repr(float(le)), float(n)) for le, n in v.cumulative()
        ]
        hist.add_metric(list(values), buckets, v.sum)
    return hist


def _number(fam: Family, v: object) -> float:
    if isinstance(v, HistogramSnapshot) or not isinstance(v, int | float):
        raise ConfigError(f"{fam.kind} {fam.name!r}: a sample is {v!r}, expected a number")
    return float(v)


class PrometheusCollector(Collector):
    """Reads a HiCacheMetrics at every scrape (custom collector: nothing counted twice)."""

    def __init__(self, metrics: HiCacheMetrics) -> None:
        self.metrics = _check_metrics("metrics", metrics)

    def collect(self) -> Iterator[Metric]:
        for fam in self.metrics.families():
            yield _metric(fam)


# The HiCacheMetrics each registry holds (a second register of the same ones would serve every
# sample twice: a plain CollectorRegistry does not check a collector without describe()).
_registered: weakref.WeakKeyDictionary[CollectorRegistry, list[HiCacheMetrics]] = (
    weakref.WeakKeyDictionary()
)
_lock = threading.Lock()


def _registry(registry: object) -> CollectorRegistry:
    target = REGISTRY if registry is None else registry
    if not isinstance(target, CollectorRegistry):
        raise ConfigError(f"registry must be a CollectorRegistry, got {type(target).__name__}")
    return target


def _holds(registry: CollectorRegistry, metrics: HiCacheMetrics) -> bool:
    with _lock:
        return any(m is metrics for m in _registered.get(registry, ()))


def register(metrics: HiCacheMetrics, registry: CollectorRegistry | None = None) -> Collector:
    """Add ``metrics`` to ``registry`` (default: prometheus_client's global REGISTRY); returns
    the collector (``registry.unregister(it)`` removes it). The same HiCacheMetrics twice in
    one registry, or metric names the registry already has, is a ConfigError."""
    collector = PrometheusCollector(metrics)
    target = _registry(registry)
    if _holds(target, metrics):
        raise ConfigError("register: these HiCacheMetrics are already in this registry")
    try:
        target.register(collector)
    except ValueError as exc:  # the registry found metric names it already has
        raise ConfigError(
            f"register: the registry refused hicache's metrics ({exc}); put every cache in one "
            f"HiCacheMetrics (add_cache with different names)"
        ) from exc
    with _lock:
        _registered.setdefault(target, []).append(metrics)
    return collector


def unregister(collector: Collector, registry: CollectorRegistry | None = None) -> None:
    """Undo ``register``: take ``collector`` (what it returned) out of ``registry`` (default the
    global REGISTRY); a collector the registry does not hold is a ConfigError."""
    target = _registry(registry)
    try:
        target.unregister(collector)
    except KeyError as exc:
        raise ConfigError("unregister: the registry does not hold this collector") from exc
    metrics = getattr(collector, "metrics", None)
    with _lock:
        held = _registered.get(target, [])
        for i, m in enumerate(held):
            if m is metrics:
                del held[i]
                break


class MetricsServer:
    """An HTTP endpoint serving one registry's scrape at ``url``; ``close()`` stops it."""

    def __init__(self, port: int, addr: str, registry: CollectorRegistry) -> None:
        self.registry = registry
        try:
            self._httpd, self._thread = start_http_server(port, addr=addr, registry=registry)
        except OSError as exc:
            raise ConfigError(
                f"serve: cannot listen on {addr}:{port} ({exc.strerror or exc}); pick another "
                f"port, or 0 for a free one"
            ) from exc
        self.addr = addr
        self.port = int(self._httpd.server_port)

    @property
    def url(self) -> str:
        host = f"[{self.addr}]" if ":" in self.addr else self.addr
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, exc_type: ExcType, exc: ExcValue, tb: ExcTraceback) -> None:
        self.close()


def serve(
    metrics: HiCacheMetrics,
    port: int,
    *,
    addr: str = "127.0.0.1",
    registry: CollectorRegistry | None = None,
) -> MetricsServer:
    """Serve ``metrics`` on ``addr:port`` (loopback by default; ``0.0.0.0`` exposes it to the
    network) from a daemon thread. ``registry``: serve this registry (hicache's collector is
    added to it unless ``register`` put it there already); default a new registry holding only
    hicache's metrics."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ConfigError(
            f"serve: port must be an integer in 0..65535 (0: a free one), got {port!r}"
        )
    if not isinstance(addr, str) or not addr:
        raise ConfigError(f"serve: addr must be an address to listen on, got {addr!r}")
    target = CollectorRegistry() if registry is None else _registry(registry)
    if not _holds(target, metrics):
        register(metrics, target)
    return MetricsServer(port, addr, target)


def exposition(metrics: HiCacheMetrics) -> str:
    """One scrape of ``metrics`` in Prometheus's text format."""
    registry = CollectorRegistry()
    register(metrics, registry)
    return generate_latest(registry).decode()


__all__ = [
    "MetricsServer",
    "PrometheusCollector",
    "exposition",
    "register",
    "serve",
    "unregister",
]
