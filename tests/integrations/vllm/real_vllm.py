"""Helpers of the tests that run a real vLLM in a child process (tests.integrations.vllm.runner).

- ROOT: the repository; child_env(): the child's environment (this checkout's sources first);
- run_spec(spec, tmp, env, module): run one JSON spec in a child process (``module``: the
  runner, tests.integrations.vllm.runner by default), its HICACHE-RESULT document;
- counted(result, phase, before, after): what vLLM's connector counters grew by between two
  "metrics" steps.
The tiny model fixture ``tiny_llama`` is in this folder's conftest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def run_spec(
    spec: dict[str, Any],
    tmp: Path,
    env: dict[str, str] | None = None,
    module: str = "tests.integrations.vllm.runner",
) -> dict[str, Any]:
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-m", module, str(path)],
        cwd=ROOT,
        env={**child_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=840,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("HICACHE-RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"vLLM run failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return json.loads(lines[-1].removeprefix("HICACHE-RESULT "))  # type: ignore[no-any-return]


def counted(result: dict[str, Any], phase: int, before: int, after: int) -> dict[str, float]:
    """What vLLM's counters of the connector grew by between two "metrics" steps."""
    old, new = result["phases"][phase][before], result["phases"][phase][after]
    return {k: v - old.get(k, 0) for k, v in new.items() if v != old.get(k, 0)}


def bench_vllm_json(*args: str) -> dict[str, Any]:
    """``hicache bench vllm ARGS --json`` in a child process; its JSON document (the child's
    stderr tail in the failure message)."""
    proc = subprocess.run(
        [sys.executable, "-m", "hicache", "bench", "vllm", *args, "--json"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(proc.stdout)  # type: ignore[no-any-return]
