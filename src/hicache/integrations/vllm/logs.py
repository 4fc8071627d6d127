"""What the connector says in its logs (hicache.engine.logs: structlog where configured).

- log_start(role, shape, settings, **more): one ``vllm.connector_started`` line per role at
  start: the host tier (slots, bytes), state slots, the store and its namespace, the keys
  scheme, the copy backend and the store deadlines.
- follow_vllm_logging(): where the application configured no logging of its own (no handler
  on the root or the ``hicache`` logger), hicache's stdlib records go to the handlers vLLM
  configured for its ``vllm`` logger, at vLLM's level: the connector's lines appear in vLLM's
  log with vLLM's format, and vLLM's settings (``VLLM_LOGGING_LEVEL``,
  ``VLLM_CONFIGURE_LOGGING=0``, ``VLLM_LOGGING_CONFIG_PATH``) apply to them. The connector
  calls it when vLLM builds it, in every process that has a role.
- RateLimitedWarnings: ``warn(kind, **fields)`` logs ``vllm.<kind>`` at most once per kind
  every ``interval_s`` seconds; the next line of that kind carries ``suppressed`` (how many
  were not logged since). ``warning_kind(operation, status)`` names the kind of a counted
  error (hicache.integrations.vllm.stats.ConnectorStats.error), or None for what is normal
  (a plain store miss, a full host tier).

vLLM- and torch-free.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from hicache.engine.logs import HiCacheLogger, get_logger

if TYPE_CHECKING:
    from hicache.integrations.vllm.layout import Shape
    from hicache.integrations.vllm.settings import ConnectorSettings

log = get_logger("hicache.vllm")
WARN_INTERVAL_S = 60.0
# How a page's store key is made (hicache.integrations.vllm.plan.store_key).
KEYS_SCHEME = (
    "namespace/kv-r<rank>of<tp>/<chain hash of block tokens and extras> (state-r<rank> for states)"
)


class _ToVllm(logging.Handler):
    """Hands each record to vLLM's ``vllm`` logger's handlers (its level, format, stream)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def follow_vllm_logging() -> bool:
    """Route hicache's stdlib logging to vLLM's (module docstring); True where it does (also
    when an earlier call did), False where the application configured logging itself or vLLM
    configured none (``VLLM_CONFIGURE_LOGGING=0``)."""
    mine = logging.getLogger("hicache")
    if any(isinstance(h, _ToVllm) for h in mine.handlers):
        return True
    own = [h for h in mine.handlers if not isinstance(h, logging.NullHandler)]
    vllm = logging.getLogger("vllm")
    if own or logging.getLogger().handlers or not vllm.handlers:
        return False
    mine.addHandler(_ToVllm())
    if mine.level == logging.NOTSET:  # else the root's WARNING would drop the start line
        mine.setLevel(vllm.getEffectiveLevel())
    return True


def log_start(
    role: str, shape: Shape, settings: ConnectorSettings, logger: HiCacheLogger = log, **more: Any
) -> None:
    logger.info(
        "vllm.connector_started",
        role=role,
        host_slots=shape.host_slots,
        host_bytes=shape.host_slots * shape.page_bytes,
        page_bytes=shape.page_bytes,
        block_size=shape.block_size,
        state_slots=shape.state_slots,
        state_host_bytes=shape.state_host_bytes,
        tp_ranks=shape.ranks,
        # reads of pages stored at other TP sizes: the model's KV heads, or None (this size only)
        tp_reads_heads=shape.heads.total if shape.heads is not None else None,
        store=settings.storage_backend,
        store_path=settings.storage_path,
        write_policy=settings.write_policy,
        save_decode=settings.save_decode,
        namespace=shape.namespace,
        keys=KEYS_SCHEME,
        copy_backend=settings.copy_backend,
        deadline_s=settings.deadline_s,
        grace_s=settings.grace_s,
        metrics=settings.metrics,
        metrics_port=settings.metrics_port,
        **more,
    )


def warning_kind(operation: str, status: str) -> str | None:
    """The warning a counted error is logged as; None for what is not worth a warning."""
    if operation == "get":
        if status == "miss":
            return None
        return "store_object_corrupt" if status == "corrupt" else "store_get_failed"
    if operation == "put":
        return "store_put_failed"
    if operation == "exists":
        return "store_exists_failed"
    if operation == "load":
        return "load_failed"
    if operation == "save":
        return None if status == "host_full" else "save_failed"
    return None


class RateLimitedWarnings:
    """At most one warning line per kind every ``interval_s`` seconds, counting the rest."""

    def __init__(
        self,
        logger: HiCacheLogger = log,
        interval_s: float = WARN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def warn(self, kind: str, times: int = 1, **fields: Any) -> None:
        with self._lock:
            now = self._clock()
            last = self._last.get(kind)
            if last is not None and now - last < self._interval:
                self._suppressed[kind] += times
                return
            self._last[kind] = now
            suppressed = self._suppressed.pop(kind, 0)
        self._log.warning(
            f"vllm.{kind}",
            count=times,
            suppressed=suppressed,
            interval_s=self._interval,
            **fields,
        )
