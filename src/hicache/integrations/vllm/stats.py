"""The connector's counters: a plain dict of numbers, safe to add to from any thread.

- ConnectorStats: ``add(name, amount)``, ``take()`` (the counts since the last take, reset),
  ``snapshot()`` (without reset). Names (see docs/vllm.md): hit_tokens_host,
  hit_tokens_storage, load_bytes, load_s, load_errors, save_bytes, save_s, save_errors,
  store_bytes, store_s, store_errors, read_bytes, read_errors, unkeyable_requests,
  declined_tokens.

- ``lookup`` / ``load`` / ``save`` / ``error``: the same events for hicache's own metrics, an
  IntegrationCounters (source ``vllm``; hicache.metrics.integration) the connector's process
  shares (hicache.integrations.vllm.exporter serves or registers it). ``error`` also logs a
  rate-limited warning for a damaged object, a failed store call or a failed copy.

vLLM-free, so the same dict can feed vLLM's KVConnectorStats and hicache's own metrics.
"""

from __future__ import annotations

import threading

from hicache.integrations.vllm.logs import RateLimitedWarnings, warning_kind
from hicache.metrics.integration import IntegrationCounters

NAMES = (
    "hit_tokens_host",
    "hit_tokens_storage",
    "load_bytes",
    "load_s",
    "load_errors",
    "save_bytes",
    "save_s",
    "save_errors",
    "store_bytes",
    "store_s",
    "store_errors",
    "read_bytes",
    "read_errors",
    "unkeyable_requests",  # requests not cached: extra keys hicache cannot encode
    "declined_tokens",  # hit tokens not offered: faster to recompute (load_policy)
)


class ConnectorStats:
    def __init__(
        self,
        counters: IntegrationCounters | None = None,
        warnings: RateLimitedWarnings | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = dict.fromkeys(NAMES, 0)
        self.counters = IntegrationCounters("vllm") if counters is None else counters
        self.warnings = RateLimitedWarnings() if warnings is None else warnings

    # ---- hicache's metrics (IntegrationCounters) -------------------------------------------

    def lookup(self, *, tokens: int, device: int, host: int, storage: int) -> None:
        """One request's lookup: ``tokens`` of prompt, vLLM's own hit (device) and what
        hicache's host and storage tiers restore beyond it."""
        self.counters.count_lookup(
            tokens=tokens, hit_tokens={"device": device, "host": host, "storage": storage}
        )

    def load(self, *, pages: int, nbytes: int, seconds: float, ok: bool) -> None:
        self.counters.count_load(pages=pages, nbytes=nbytes, seconds=seconds, ok=ok)

    def save(self, *, pages: int, nbytes: int, seconds: float, ok: bool) -> None:
        self.counters.count_save(pages=pages, nbytes=nbytes, seconds=seconds, ok=ok)

    def error(self, operation: str, status: str, times: int = 1) -> None:
        """Count an error; damaged objects, failed store calls and failed copies are also
        logged, at most once per kind a minute (hicache.integrations.vllm.logs)."""
        for _ in range(times):
            self.counters.count_error(operation=operation, status=status)
        kind = warning_kind(operation, status)
        if kind is not None:
            self.warnings.warn(kind, times, operation=operation, status=status)

    # ---- vLLM's KVConnectorStats (a dict of numbers) --------------------------------------

    def add(self, name: str, amount: float) -> None:
        if not amount:
            return
        with self._lock:
            self._data[name] = self._data.get(name, 0) + amount

    def take(self) -> dict[str, float]:
        with self._lock:
            out = self._data
            self._data = dict.fromkeys(NAMES, 0)
        return out

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return dict(self._data)
