"""Logging for the commands (the application side: a library never configures logging).

- QuietLogs: for a command's run, structlog to stderr at warning level; put back afterwards.
- NativeStderrToFile: for a command's run, what native libraries write to file descriptor 2
  (Mooncake's glog lines: "I1203 ... client_service.cpp:423] ...", "E1203 ... Local segment
  descriptor not found") goes to a log file; Python's sys.stderr (progress, hicache's own
  warnings, errors) stays on the terminal.

Mooncake's Python client never calls InitGoogleLogging, so glog writes every line to stderr
("Logging before InitGoogleLogging() is written to STDERR"). Its GLOG_* variables do not change
that in-process (with mooncake-transfer-engine-non-cuda 0.3.13.post1, GLOG_minloglevel=3 and
GLOG_log_dir with GLOG_logtostderr=0 each still left all 16 lines of a client's start and close
on stderr; the standalone mooncake_client process honours them). Redirecting the descriptor
keeps every line, out of the progress output.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TextIO

from hicache.domain import ConfigError


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


class NativeStderrToFile:
    """For the command's run: descriptor 2 to ``path`` (appended), sys.stderr kept on the terminal.

    ``lines_written()`` after the run: whether anything went to the file (the caller says where
    it is, or removes an empty one).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._saved_fd: int | None = None
        self._saved_stderr: TextIO | None = None
        self._stream: TextIO | None = None
        self._start = 0

    def __enter__(self) -> NativeStderrToFile:
        sys.stderr.flush()
        try:
            log_fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        except OSError as e:
            raise ConfigError(
                f"cannot write the log file {str(self.path)!r}: {e.strerror or e}"
            ) from None
        try:
            self._start = os.fstat(log_fd).st_size
            self._saved_fd = os.dup(2)
            os.dup2(log_fd, 2)
        finally:
            os.close(log_fd)
        # Python's own stderr, if it is descriptor 2, follows the terminal, not the log.
        with contextlib.suppress(AttributeError, OSError, ValueError):
            if sys.stderr.fileno() == 2:
                self._saved_stderr = sys.stderr
                self._stream = open(  # closed in __exit__
                    os.dup(self._saved_fd),
                    "w",
                    buffering=1,
                    encoding=sys.stderr.encoding or "utf-8",
                    errors="backslashreplace",
                )
                sys.stderr = self._stream
        return self

    def __exit__(self, *exc: object) -> None:
        if self._saved_fd is None:
            return
        try:
            if self._stream is not None and self._saved_stderr is not None:
                self._stream.flush()
                sys.stderr = self._saved_stderr
                self._stream.close()
        finally:
            os.dup2(self._saved_fd, 2)
            os.close(self._saved_fd)
            self._saved_fd = None

    def lines_written(self) -> bool:
        try:
            return self.path.stat().st_size > self._start
        except OSError:
            return False
