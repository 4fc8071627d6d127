"""hicache's loggers: structlog where the application configured it, silent otherwise.

- get_logger: a logger for ``name`` ("hicache.engine", ...) with debug / info / warning / error.

structlog's default configuration prints every event on stdout, which would corrupt the output
of an application that embeds hicache and never configured structlog (a `--json` command, a
server speaking a protocol on stdout). So each event goes, at the time it is emitted:

- to ``structlog.get_logger(name)`` when the application configured structlog
  (``structlog.is_configured()``), with the event name and key-value pairs as given;
- else to the standard library logger ``name``, as "event key=value ...". The "hicache" logger
  carries a NullHandler, so nothing is printed unless the application configured logging
  (``logging.basicConfig`` or its own handlers), and then it goes where those handlers send it.
"""

from __future__ import annotations

import logging
from typing import Any

import structlog

logging.getLogger("hicache").addHandler(logging.NullHandler())


class HiCacheLogger:
    """Emits to structlog if the application configured it, else to stdlib logging."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._structlog = structlog.get_logger(name)
        self._stdlib = logging.getLogger(name)

    def _emit(self, level: int, method: str, event: str, fields: dict[str, Any]) -> None:
        if structlog.is_configured():
            getattr(self._structlog, method)(event, **fields)
            return
        if self._stdlib.isEnabledFor(level):
            pairs = " ".join(f"{k}={v!r}" for k, v in fields.items())
            # stacklevel 3: the record names the module that called info()/warning(), not this
            self._stdlib.log(level, "%s %s", event, pairs, stacklevel=3)

    def debug(self, event: str, **fields: Any) -> None:
        self._emit(logging.DEBUG, "debug", event, fields)

    def info(self, event: str, **fields: Any) -> None:
        self._emit(logging.INFO, "info", event, fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._emit(logging.WARNING, "warning", event, fields)

    def error(self, event: str, **fields: Any) -> None:
        self._emit(logging.ERROR, "error", event, fields)


def get_logger(name: str) -> HiCacheLogger:
    return HiCacheLogger(name)
