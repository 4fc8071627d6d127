"""Load or recompute in vLLM's real Scheduler (the scheduler harness): with the figures of a
fast host tier and a slow store, the host part of a hit is loaded and the store tail is
declined (vLLM computes it); with load_policy always the same hit is loaded whole."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from hicache.domain.load_choice import attention_work  # noqa: E402
from hicache.integrations.vllm.load_policy import LoadPolicy  # noqa: E402
from tests.integrations.vllm.sched_harness import BLOCK, Harness  # noqa: E402
from tests.integrations.vllm.sched_helpers import (  # noqa: E402
    Harnesses,
    connector_stat,
    hit_tokens,
    prompts,
)

pytestmark = pytest.mark.vllm

HOST_BLOCKS = 4
BLOCKS = 12


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Harnesses]:
    harnesses = Harnesses(tmp_path)
    yield harnesses
    harnesses.close()


def host_part_store_all(h: Harness, prompt: list[int]) -> None:
    """The prompt's blocks all in the store, its first HOST_BLOCKS blocks also on host."""
    h.add(prompt, max_tokens=1)
    h.settle()
    assert h.reset_prefix_cache(connector=True)  # host tier emptied: the store holds them
    h.add(prompt[: HOST_BLOCKS * BLOCK + 1], max_tokens=1)  # a store hit brings them to host
    h.settle()
    assert h.reset_prefix_cache()  # vLLM forgets; the host tier keeps its pages


def fast_host_slow_store(h: Harness) -> LoadPolicy:
    """The scheduler role's policy with measured figures: steps at 1 ms a token, host copies
    at 0.1 ms a page, store reads at 100 ms a page (a frozen clock: the harness's own steps
    and transfers add no figures)."""
    policy = LoadPolicy("measured", clock=lambda: 0.0)
    for tokens in (64, 1, 256, 1, 512):
        policy.prefill.observe(tokens, attention_work(tokens, 0), 0.001 * tokens)
    policy.host.per_page_s = 0.0001
    policy.store.per_page_s = 0.1
    h.scheduler.connector.scheduler_role.side.policy = policy  # type: ignore[union-attr]
    return policy


def test_slow_store_tail_is_declined_and_the_host_part_loaded(make: Harnesses) -> None:
    h = make(store="directory", host_pages=32)
    prompt = prompts(1, BLOCKS * BLOCK + 1, seed=5)[0]
    host_part_store_all(h, prompt)
    fast_host_slow_store(h)
    gets = h.control.gets
    h.add(prompt, max_tokens=2)
    results = h.settle()
    assert hit_tokens(results) == HOST_BLOCKS * BLOCK
    assert h.control.gets == gets  # the store was not read
    assert connector_stat(results, "declined_tokens") == (BLOCKS - HOST_BLOCKS) * BLOCK


def test_always_loads_the_same_hit_whole(make: Harnesses) -> None:
    h = make(store="directory", host_pages=32, extra={"load_policy": "always"})
    prompt = prompts(1, BLOCKS * BLOCK + 1, seed=5)[0]
    host_part_store_all(h, prompt)
    gets = h.control.gets
    h.add(prompt, max_tokens=2)
    results = h.settle()
    assert hit_tokens(results) == BLOCKS * BLOCK
    assert h.control.gets > gets
    assert connector_stat(results, "declined_tokens") == 0
