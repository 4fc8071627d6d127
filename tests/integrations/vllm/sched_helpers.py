"""Helpers of the scheduler-harness tests (tests/integrations/vllm/sched_harness.py).

- prompts(n, length, shared=0, seed=0): token ids, a shared head; reference(make, prompts,
  max_tokens): what they generate in a fresh engine with no hit.
- hit_tokens(results) / connector_stat(results, name): what vLLM's scheduler reported.
- warm_store_only(h, prompt): the prompt saved, then held by the store only.
- probe_host_tier(h, pages): the leak probe (every host page free or evictable).
- Harnesses(root): builds Harness objects for one test and closes them all.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from tests.integrations.vllm.sched_harness import BLOCK, VOCAB, Harness, StepResult


def prompts(n: int, length: int, *, shared: int = 0, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids; the first ``shared`` tokens are common to all."""
    rng = np.random.default_rng(seed)
    head = [int(t) for t in rng.integers(1, VOCAB, shared)]
    return [head + [int(t) for t in rng.integers(1, VOCAB, length - shared)] for _ in range(n)]


def hit_tokens(results: Iterable[StepResult]) -> int:
    """The tokens vLLM counted as loaded by the connector over ``results``
    (connector_prefix_cache_stats.hits)."""
    return sum(r.hits for r in results)


def connector_stat(results: Iterable[StepResult], name: str) -> float:
    """The sum of one of HiCacheConnector's KVConnectorStats counters over ``results``, as
    vLLM's scheduler reported them (SchedulerStats.kv_connector_stats)."""
    total = 0.0
    for r in results:
        if r.stats:
            total += float(r.stats.get(name, 0))
    return total


def probe_host_tier(h: Harness, pages: int, *, seed: int = 99) -> tuple[int, int]:
    """Leak probe: settle, save ``pages`` fresh pages (a prompt of ``pages`` full blocks and
    one token), settle, reset vLLM's prefix cache and ask for the same prompt again. Returns
    (tokens vLLM counted as loaded by the connector, store reads the second ask made). With
    ``pages`` = the host tier's size, every page is held on host only if no host page stayed
    pinned by earlier work: a leaked pin shows as fewer tokens hit or a store read."""
    h.settle()
    prompt = prompts(1, pages * BLOCK + 1, seed=seed)[0]
    h.add(prompt, max_tokens=1)
    h.settle()
    if not h.reset_prefix_cache():
        raise AssertionError("vLLM refused reset_prefix_cache after settling")
    gets = h.control.gets
    h.add(prompt, max_tokens=1)
    results = h.settle()
    return hit_tokens(results), h.control.gets - gets


class Harnesses:
    """Builds Harness objects under one folder (a test's tmp_path) and closes them all."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.made: list[Harness] = []

    def __call__(self, **kwargs: Any) -> Harness:
        h = Harness(self.root / f"h{len(self.made)}", **kwargs)
        self.made.append(h)
        return h

    def close(self) -> None:
        for h in self.made:
            h.close()


def reference(make: Harnesses, prompt_list: list[list[int]], max_tokens: int) -> list[list[int]]:
    """What each prompt generates in a fresh engine with no connector hit."""
    h = make()
    ids = [h.add(p, max_tokens) for p in prompt_list]
    h.run()
    return [h.tokens[i] for i in ids]


def warm_store_only(h: Harness, prompt: list[int]) -> None:
    """Save ``prompt`` (host and store), then forget it in vLLM and on host: the next ask is
    a storage hit (an asynchronous load)."""
    h.add(prompt, max_tokens=1)
    h.settle()
    if h.control.pages_written < (len(prompt) - 1) // BLOCK:
        raise AssertionError(
            f"the store holds {h.control.pages_written} pages; the prompt has "
            f"{(len(prompt) - 1) // BLOCK} (is the host tier smaller than the prompt?)"
        )
    if not h.reset_prefix_cache(connector=True):
        raise AssertionError("vLLM refused reset_prefix_cache after settling")
