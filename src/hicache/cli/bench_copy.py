"""Placeholder: the command is being written; it registers nothing yet."""

from __future__ import annotations

from typing import Any


def register(sub: Any) -> None:
    return None
