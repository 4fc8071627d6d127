"""The connector's counters: a plain dict of numbers, safe to add to from any thread.

- ConnectorStats: ``add(name, amount)``, ``take()`` (the counts since the last take, reset),
  ``snapshot()`` (without reset). Names (see docs/vllm.md): hit_tokens_host,
  hit_tokens_storage, load_bytes, load_s, load_errors, save_bytes, save_s, save_errors,
  store_bytes, store_s, store_errors, read_bytes, read_errors.

vLLM-free, so the same dict can feed vLLM's KVConnectorStats and hicache's own metrics.
"""

from __future__ import annotations

import threading

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
)


class ConnectorStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = dict.fromkeys(NAMES, 0)

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
