"""Runtime.aclose leaves the engine's task group too: a runtime opened and closed by hand (no
``async with``) inside a cancel scope keeps that task's scopes in order."""

from __future__ import annotations

import anyio
import pytest

from hicache.bootstrap.runtime import open_runtime
from tests.engine.fakes import dense_plan


@pytest.mark.asyncio
async def test_a_runtime_closed_with_aclose_leaves_the_tasks_cancel_scopes_in_order() -> None:
    first = open_runtime(dense_plan(), backend="torch")
    second = open_runtime(dense_plan(), backend="torch")
    await first.__aenter__()
    with anyio.CancelScope():  # e.g. a move_on_after around a request, or another runtime
        await second.__aenter__()
        await second.aclose()
    # Before: leaving the scope raised "Attempted to exit a cancel scope that isn't the
    # current tasks's current cancel scope" (the engine's task group was still entered).
    await first.aclose()
    assert first.closed
    assert second.closed
    await first.aclose()  # idempotent
