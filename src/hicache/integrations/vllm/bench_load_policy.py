"""`hicache bench vllm --slow-store`: time to first token with load_policy measured, always and
never, over the fast host tier and over a slow store.

One process, vLLM's single-process mode (eager), the tiny Llama of ``hicache bench vllm``
(hicache.integrations.vllm.bench), one LLM instance per policy, each over its own store: a
ThrottledStore (hicache.adapters.storage.throttled: the directory store with reads slowed to
``read_mib_s``; writes at full speed; store calls bounded at 120 s so a slow read is not cut).
Per instance:

1. warm-up: another prompt, 8 greedy tokens (first-call costs; the load policy times these
   steps), that prompt again after vLLM's prefix cache was reset (a host hit: the load path's
   first-call costs), then the prompt once (it fills the host tier and, write-through, the
   store);
2. fast host: ``repeats`` times, vLLM's prefix cache reset, then a one-token generate of the
   prompt (TTFT): the host tier holds the prompt's pages;
3. slow store: ``repeats`` times, vLLM's prefix cache and the host tier reset
   (``reset_prefix_cache(reset_connector=True)``), then the same: only the store holds them.

Before each timed run a short prompt runs twice, 0.3 s apart, so that the previous run's store
writes end and are reported (a page being written stays pinned, and would survive the host
tier's reset). Figures are medians of the timed runs (every run is reported too: with ``measured`` the first
slow-store run loads, measuring the store, and the later ones decline it). ``vs_best`` is
measured / min(always, never); the targets: within 5% of the better of the two in both cases,
and better than always on the slow store.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from hicache.integrations.vllm.bench import DESCRIPTIONS, KINDS, _llm

POLICIES = ("measured", "always", "never")
CASES = ("fast_host", "slow_store")
WARM_TOKENS = 8
# Store calls bounded far above a throttled read of the whole prompt (default 2 s + 1 s).
DEADLINE_S = 120.0
TARGET = 1.05
SETTLE_S = 0.3
SETTLE_TOKENS = 40


def run_load_policy_bench(
    *,
    model: Path | None,
    prompt_tokens: int,
    repeats: int,
    host_gib: float,
    read_mib_s: float,
    kind: str = "llama",
) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import SamplingParams

    rng = random.Random(11)
    prompt = [rng.randrange(1, 1000) for _ in range(prompt_tokens)]
    warm = [rng.randrange(1, 1000) for _ in range(prompt_tokens)]
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    several = SamplingParams(temperature=0.0, max_tokens=WARM_TOKENS, ignore_eos=True)

    def gen(llm: Any, ids: list[int], params: Any) -> tuple[float, int]:
        t0 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return (time.perf_counter() - t0) * 1000, int(out.num_cached_tokens or 0)

    short = [rng.randrange(1, 1000) for _ in range(SETTLE_TOKENS)]

    def settle(llm: Any) -> None:
        """Let the last run's store writes end and be reported (engine steps report them),
        so that reset_connector empties the host tier (a page being written stays pinned)."""
        for _ in range(2):
            time.sleep(SETTLE_S)
            gen(llm, short, one)

    runs: dict[str, dict[str, list[float]]] = {c: {} for c in CASES}
    hits: dict[str, dict[str, list[int]]] = {c: {} for c in CASES}
    with tempfile.TemporaryDirectory(prefix="hicache-bench-load-policy-") as tmp:
        root = Path(tmp)
        folder = model or KINDS[kind](root / "model")
        for policy in POLICIES:
            store = root / f"store-{policy}"
            extra = {
                "host_gib": host_gib,
                "storage_backend": "dynamic",
                "storage_extra_config": {
                    "module_path": "hicache.adapters.storage.throttled",
                    "class_name": "ThrottledStore",
                    "root": str(store),
                    "read_mib_s": read_mib_s,
                },
                "load_policy": policy,
                "deadline_s": DEADLINE_S,
            }
            llm = _llm(folder, "HiCacheConnector", extra)
            gen(llm, warm, several)
            llm.reset_prefix_cache()
            gen(llm, warm, one)  # a host hit: the load path's first-call costs
            gen(llm, prompt, one)  # fills the host tier and the store
            for case, reset_connector in (("fast_host", False), ("slow_store", True)):
                times, cached = [], []
                for _ in range(repeats):
                    settle(llm)
                    llm.reset_prefix_cache(reset_connector=reset_connector)
                    ms, n = gen(llm, prompt, one)
                    times.append(ms)
                    cached.append(n)
                runs[case][policy] = times
                hits[case][policy] = cached
            del llm

    out: dict[str, Any] = {
        "model": str(model) if model else DESCRIPTIONS[kind],
        "prompt_tokens": prompt_tokens,
        "read_mib_s": read_mib_s,
        "repeats": repeats,
    }
    targets: dict[str, bool] = {}
    for case in CASES:
        ttft = {p: statistics.median(runs[case][p]) for p in POLICIES}
        best = min(ttft["always"], ttft["never"])
        out[case] = {
            "ttft_ms": {p: round(v, 1) for p, v in ttft.items()},
            "runs_ms": {p: [round(v, 1) for v in runs[case][p]] for p in POLICIES},
            "hit_tokens": hits[case],
            "measured_vs_best": round(ttft["measured"] / best, 3),
            "measured_vs_always": round(ttft["measured"] / ttft["always"], 3),
            "measured_vs_never": round(ttft["measured"] / ttft["never"], 3),
        }
        targets[f"{case}_within_5pct_of_best"] = ttft["measured"] <= TARGET * best
    slow = out["slow_store"]["ttft_ms"]
    targets["slow_store_better_than_always"] = slow["measured"] < slow["always"]
    out["targets_met"] = targets
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return out
