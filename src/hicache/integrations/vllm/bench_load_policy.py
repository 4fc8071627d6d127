"""`hicache bench vllm --slow-store`: time to first token with load_policy measured, always and
never, over the fast host tier and over a slow store.

The tiny Llama of ``hicache bench vllm`` (hicache.integrations.vllm.bench), one vLLM per policy,
each in its own child process (vLLM's single-process mode, eager) over its own store: a
ThrottledStore (hicache.adapters.storage.throttled: the directory store with reads slowed to
``read_mib_s``; writes at full speed; store calls bounded at 120 s so a slow read is not cut).
Each child first warms up: another prompt, 8 greedy tokens (first-call costs; the load policy
times these steps), that prompt again after vLLM's prefix cache was reset (a host hit: the load
path's first-call costs), then the prompt once (it fills the host tier and, write-through, the
store). Then the timed runs, one child at a time (the others wait, idle), the policies
interleaved in a rotating order so that a shared machine's load changes hit all three alike;
each run is a one-token generate of the prompt (TTFT) after:

- fast host: vLLM's prefix cache reset: the host tier holds the prompt's pages;
- slow store: vLLM's prefix cache and the host tier reset
  (``reset_prefix_cache(reset_connector=True)``): only the store holds them.

Before each timed run a short prompt runs twice, 0.3 s apart, so that the previous run's store
writes end and are reported (a page being written stays pinned, and would survive the host
tier's reset). Figures are medians of the timed runs (every run is reported too: with
``measured`` the first slow-store run loads, measuring the store, and the later ones decline
it). ``measured_vs_best`` is measured / min(always, never); ``measured_vs_faster_paired`` is
the median over repeats of measured / the faster baseline in the same repeat (the three runs of
a repeat are seconds apart: slower load swings cancel); ``measured_loads_like_faster_baseline``
says whether, after its first run, measured loaded exactly the tokens the faster of always and
never loaded (the choice, free of timing noise). The targets: within 5% of the better of the
two in both cases, and better than always on the slow store.
"""

from __future__ import annotations

import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from hicache.integrations.vllm.bench import DESCRIPTIONS, KINDS, _llm

POLICIES = ("measured", "always", "never")
CASES = ("fast_host", "slow_store")
WARM_TOKENS = 8
# Store calls bounded far above a throttled read of the whole prompt (default 2 s + 1 s).
DEADLINE_S = 120.0
TARGET = 1.05
SETTLE_S = 0.3
SETTLE_TOKENS = 40
RESULT = "HICACHE-RESULT "
START_TIMEOUT_S = 900.0


def _prompts(prompt_tokens: int) -> tuple[list[int], list[int], list[int]]:
    """The timed prompt, the warm-up prompt and the short settling prompt."""
    rng = random.Random(11)
    prompt = [rng.randrange(1, 1000) for _ in range(prompt_tokens)]
    warm = [rng.randrange(1, 1000) for _ in range(prompt_tokens)]
    short = [rng.randrange(1, 1000) for _ in range(SETTLE_TOKENS)]
    return prompt, warm, short


def _child(spec: dict[str, Any]) -> None:
    """One policy's vLLM: warm up, say ready, then one timed run per command on stdin."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import SamplingParams

    prompt, warm, short = _prompts(spec["prompt_tokens"])
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    several = SamplingParams(temperature=0.0, max_tokens=WARM_TOKENS, ignore_eos=True)
    extra = {
        "host_gib": spec["host_gib"],
        "storage_backend": "dynamic",
        "storage_extra_config": {
            "module_path": "hicache.adapters.storage.throttled",
            "class_name": "ThrottledStore",
            "root": spec["store"],
            "read_mib_s": spec["read_mib_s"],
        },
        "load_policy": spec["policy"],
        "deadline_s": DEADLINE_S,
    }
    llm: Any = _llm(Path(spec["model"]), "HiCacheConnector", extra)

    def gen(ids: list[int], params: Any) -> tuple[float, int]:
        t0 = time.perf_counter()
        (out,) = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
        return (time.perf_counter() - t0) * 1000, int(out.num_cached_tokens or 0)

    def say(doc: dict[str, Any]) -> None:
        sys.stdout.write(RESULT + json.dumps(doc) + "\n")
        sys.stdout.flush()

    gen(warm, several)
    llm.reset_prefix_cache()
    gen(warm, one)  # a host hit: the load path's first-call costs
    gen(prompt, one)  # fills the host tier and the store
    say({"ready": True})
    for line in sys.stdin:
        case = line.strip()
        if case not in CASES:
            break
        for _ in range(2):  # the last run's store writes end and are reported
            time.sleep(SETTLE_S)
            gen(short, one)
        llm.reset_prefix_cache(reset_connector=case == "slow_store")
        ms, cached = gen(prompt, one)
        say({"ms": ms, "hit": cached})
    # shut vLLM (and the connector's store thread) down now, not from an exit hook after the
    # interpreter stopped taking new thread-pool work
    llm = None
    gc.collect()


def _read(proc: subprocess.Popen[str], what: str) -> dict[str, Any]:
    out: IO[str] | None = proc.stdout
    assert out is not None
    for line in out:
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])  # type: ignore[no-any-return]
    code = proc.wait()
    raise RuntimeError(f"bench vllm --slow-store: the {what} child exited ({code}) early")


def _ask(proc: subprocess.Popen[str], case: str, what: str) -> dict[str, Any]:
    assert proc.stdin is not None
    proc.stdin.write(case + "\n")
    proc.stdin.flush()
    return _read(proc, what)


def _stop(proc: subprocess.Popen[str]) -> None:
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_load_policy_bench(
    *,
    model: Path | None,
    prompt_tokens: int,
    repeats: int,
    host_gib: float,
    read_mib_s: float,
    kind: str = "llama",
) -> dict[str, Any]:
    import hicache

    runs: dict[str, dict[str, list[float]]] = {c: {p: [] for p in POLICIES} for c in CASES}
    hits: dict[str, dict[str, list[int]]] = {c: {p: [] for p in POLICIES} for c in CASES}
    src = str(Path(hicache.__file__).resolve().parents[1])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(x for x in (src, env.get("PYTHONPATH", "")) if x)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    procs: dict[str, subprocess.Popen[str]] = {}
    with tempfile.TemporaryDirectory(prefix="hicache-bench-load-policy-") as tmp:
        root = Path(tmp)
        folder = model or KINDS[kind](root / "model")
        try:
            for policy in POLICIES:  # one at a time: the start-ups do not share the CPUs
                spec = {
                    "policy": policy,
                    "model": str(folder),
                    "store": str(root / f"store-{policy}"),
                    "prompt_tokens": prompt_tokens,
                    "host_gib": host_gib,
                    "read_mib_s": read_mib_s,
                }
                procs[policy] = subprocess.Popen(
                    [sys.executable, "-m", __name__, json.dumps(spec)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    env=env,
                )
                _read(procs[policy], policy)
            for case in CASES:
                for r in range(repeats):
                    shift = r % len(POLICIES)
                    for policy in POLICIES[shift:] + POLICIES[:shift]:
                        got = _ask(procs[policy], case, policy)
                        runs[case][policy].append(got["ms"])
                        hits[case][policy].append(got["hit"])
        finally:
            for proc in procs.values():
                if proc.stdin is not None:
                    proc.stdin.close()  # the child's loop ends
            for proc in procs.values():
                _stop(proc)

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
        # the choice itself, free of the machine's timing noise: after its first run (which
        # may measure a tier), did measured load what the faster baseline loaded?
        faster = "always" if ttft["always"] <= ttft["never"] else "never"
        out[case]["faster_baseline"] = faster
        # paired: each repeat's runs are seconds apart, so the machine's slower swings cancel
        paired = [m / f for m, f in zip(runs[case]["measured"], runs[case][faster], strict=True)]
        out[case]["measured_vs_faster_paired"] = round(statistics.median(paired), 3)
        out[case]["measured_loads_like_faster_baseline"] = (
            hits[case]["measured"][1:] == hits[case][faster][1:]
        )
        targets[f"{case}_within_5pct_of_best"] = ttft["measured"] <= TARGET * best
    slow = out["slow_store"]["ttft_ms"]
    targets["slow_store_better_than_always"] = slow["measured"] < slow["always"]
    out["targets_met"] = targets
    out["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return out


if __name__ == "__main__":
    _child(json.loads(sys.argv[1]))
