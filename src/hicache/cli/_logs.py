"""Logging for the commands (the application side: a library never configures logging).

- QuietLogs: for a command's run, structlog to stderr at warning level; put back afterwards.
"""

from __future__ import annotations

import sys


class QuietLogs:
    """For the command's run: structlog to stderr at warning level; put back afterwards.

    A library never configures logging; a command is the application and may, as long as
    stdout stays one JSON document and the caller's configuration comes back afterwards.
    """

    def __enter__(self) -> None:
        import logging

        import structlog

        self._was_configured = structlog.is_configured()
        self._saved = dict(structlog.get_config())
        self._saved["processors"] = list(self._saved["processors"])
        structlog.configure(
            wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
            logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        )

    def __exit__(self, *exc: object) -> None:
        import structlog

        if self._was_configured:
            structlog.configure(**self._saved)
        else:
            structlog.reset_defaults()
