"""hicache as a vLLM v1 KV connector (see docs/vllm.md).

- HiCacheConnector (hicache.integrations.vllm.connector): name it in ``--kv-transfer-config``
  with ``"kv_connector": "HiCacheConnector"`` and
  ``"kv_connector_module_path": "hicache.integrations.vllm"``. Importing it imports vLLM.
  It dispatches each hook to its role's object: SchedulerConnector (scheduler_role) or
  WorkerConnector (worker_role); Layout and Shape (layout), the metadata the roles exchange
  (metadata) and vLLM's metrics objects (vllm_metrics) import vLLM too.
- ConnectorSettings (settings), SchedulerSide (scheduler; its jobs in scheduler_state,
  scheduler_hits, scheduler_loads, scheduler_saves; its host index is
  hicache.domain.host_pages.HostPages), WorkerTransfers (worker; its jobs in worker_state,
  worker_copies, worker_store, worker_settle), StepPlan and the per-page events (plan),
  ConnectorStats (stats), the process's hicache metrics (exporter): the parts, importable
  without vLLM (docs/vllm.md, "The package's modules", lists every module).

``HiCacheConnector`` is resolved on first access (PEP 562), so the vLLM-free parts import
without vLLM installed.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HiCacheConnector"]


def __getattr__(name: str) -> Any:
    if name == "HiCacheConnector":
        from hicache.integrations.vllm.connector import HiCacheConnector

        return HiCacheConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
