"""The cache a SIGKILL test runs in a child process and checks from the parent: a llama plan
(tp 8, 16-token pages, host memory in shm for the child), write-through settings, and the
tokens of request r (PAGES whole pages plus a partial one)."""

from __future__ import annotations

from hicache.bootstrap import load_model_spec
from hicache.cache.values import CacheSettings
from hicache.domain import PlanSettings, plan_stack
from hicache.domain.tiers import WriteSettings

PAGES = 6


PAGE = 16


def request(r: int) -> list[int]:
    return [1_000_000 * (r + 1) + j for j in range(PAGES * PAGE)] + [1, 2]


def plan(shm: bool):  # type: ignore[no-untyped-def]
    from hicache.bootstrap.config import storage_settings

    extra = {"storage": storage_settings("dynamic", '{"allocator": "shm"}')} if shm else {}
    return plan_stack(
        load_model_spec("llama-3.1-8b-instruct"),
        PlanSettings(tp_size=8, page_size=PAGE, device_tokens=12 * PAGE, **extra),
    )


SETTINGS = CacheSettings(writes=WriteSettings(host="write_through", storage="write_through"))
