"""The vLLM scenario the tests run, as a spec for runner.py (one child process per mode).

PROMPT0: 300 tokens (9 full blocks of 32 may hit: the last token is always computed);
PROMPT1: PROMPT0's first 200 tokens, then 100 others (6 shared full blocks: a partial hit).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

BLOCK = 32
_rng = random.Random(1)
PROMPT0 = [_rng.randrange(1, 1000) for _ in range(300)]
PROMPT1 = PROMPT0[:200] + [_rng.randrange(1, 1000) for _ in range(100)]
FULL_HIT = (len(PROMPT0) - 1) // BLOCK * BLOCK  # 288
PARTIAL_HIT = 200 // BLOCK * BLOCK  # 192


def faulty(root: Path, flags: Path) -> dict[str, Any]:
    return {
        "host_gib": 0.05,
        "storage_backend": "dynamic",
        "storage_extra_config": {
            "module_path": "tests.integrations.vllm.faulty_store",
            "class_name": "FaultyStore",
            "root": str(root),
            "flags_dir": str(flags),
        },
    }


def full_spec(model: Path, tmp: Path, mode: str) -> dict[str, Any]:
    """Host hit, partial hit, restart storage hit, fault mid-load, scrambled and damaged bytes."""
    store, flags = tmp / "store", tmp / "flags"
    flags.mkdir(parents=True, exist_ok=True)
    f = str(flags)
    return {
        "model": str(model),
        "mode": mode,
        "prompts": [PROMPT0, PROMPT1],
        "phases": [
            {
                "connector": {"host_gib": 0.05},
                "steps": [
                    ["gen", [0]],  # a0: recompute of PROMPT0
                    ["reset"],
                    ["gen", [0]],  # a2: host hit
                    ["reset_all"],
                    ["gen", [1]],  # a4: recompute of PROMPT1
                    ["reset_all"],
                    ["gen", [0]],  # a6: PROMPT0 again into the host tier
                    ["reset"],
                    ["gen", [1]],  # a8: partial host hit
                ],
            },
            {"connector": faulty(store, flags), "steps": [["gen", [0, 1]]]},  # b0: written
            {
                "connector": faulty(store, flags),  # a restart: a new vLLM, the same store
                "steps": [
                    ["gen", [0]],  # c0: storage hit
                    ["reset_all"],
                    ["flag", f, "fail_after", 2],
                    ["gen", [1]],  # c3: a store fault after 2 pages of the load
                    ["flag", f, "fail_after", None],
                    ["reset_all"],
                    ["flag", f, "corrupt", 1],
                    ["gen", [0]],  # c7: scrambled KV loaded: the output changes
                    ["flag", f, "corrupt", None],
                    ["reset_all"],
                    ["damage", str(store)],
                    ["gen", [0]],  # c11: damaged objects: checksum -> recompute
                ],
            },
        ],
    }


def two_process_spec(model: Path, tmp: Path) -> dict[str, Any]:
    """vLLM's default mode (scheduler and worker in separate processes), fewer instances:
    recompute, a host hit after a reset, then a restart that hits the store."""
    store = tmp / "store"
    connector = {"host_gib": 0.05, "storage_backend": "directory", "storage_path": str(store)}
    return {
        "model": str(model),
        "mode": "mp",
        "prompts": [PROMPT0, PROMPT1],
        "phases": [
            {
                "connector": connector,
                "steps": [
                    ["gen", [0]],  # a0: recompute
                    ["reset"],
                    ["gen", [0]],  # a2: host hit
                    ["reset"],
                    ["gen", [1]],  # a4: partial host hit
                ],
            },
            {"connector": connector, "steps": [["gen", [0]]]},  # b0: storage hit (restart)
        ],
    }
