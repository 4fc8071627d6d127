"""Whether a task group entered by ``__aenter__`` may be left now (private).

A face that enters a task group in ``__aenter__`` (TransferEngine, HiCache) must leave it from
the same place in the task's stack of cancel scopes. ``aclose()`` may be called from anywhere:
inside a ``move_on_after`` or another cancel scope, leaving the group there would corrupt the
task's scopes (anyio raises "Attempted to exit a cancel scope that isn't the current tasks's
current cancel scope", and the cancellation of the inner scope then escapes it: a later,
unrelated close in the same task gets CancelledError). So ``aclose()`` closes the work and
leaves the group only where ``innermost(scope)`` says it is the task's current scope; otherwise
the group is left at the ``async with`` exit (or a later ``aclose()`` from the right place).

- innermost(scope): True when ``scope`` is the running task's innermost cancel scope. On the
  asyncio backend it reads anyio's per-task state; on another backend (or if that state is not
  where anyio 4 keeps it) it answers True, which is the behaviour before the check existed.
"""

from __future__ import annotations

import anyio


def innermost(scope: anyio.CancelScope) -> bool:
    """Whether ``scope`` is the running task's innermost cancel scope (see the module doc)."""
    try:
        import asyncio

        from anyio._backends._asyncio import _task_states

        task = asyncio.current_task()
    except (ImportError, RuntimeError):  # pragma: no cover - not the asyncio backend
        return True
    state = _task_states.get(task) if task is not None else None
    current = getattr(state, "cancel_scope", scope)
    return current is scope
