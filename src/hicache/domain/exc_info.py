"""The three values a context manager's ``__exit__`` / ``__aexit__`` receives, as type aliases.

- ExcType, ExcValue, ExcTraceback: ``type[BaseException] | None``, ``BaseException | None``,
  ``TracebackType | None``.
"""

from __future__ import annotations

from types import TracebackType
from typing import Optional

ExcType = Optional[type[BaseException]]
ExcValue = Optional[BaseException]
ExcTraceback = Optional[TracebackType]
