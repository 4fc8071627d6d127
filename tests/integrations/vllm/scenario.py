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
        "llm": {"disable_log_stats": False},  # vLLM's metrics: the "metrics" steps read them
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
                    ["metrics"],  # a9: host hits a2 + a8
                ],
            },
            {"connector": faulty(store, flags), "steps": [["gen", [0, 1]]]},  # b0: written
            {
                "connector": faulty(store, flags),  # a restart: a new vLLM, the same store
                "steps": [
                    ["gen", [0]],  # c0: storage hit
                    ["reset_all"],
                    ["flag", f, "fail_after", 2],
                    ["metrics"],  # c3: before the fault
                    ["gen", [1]],  # c4: a store fault after 2 pages of the load
                    ["metrics"],  # c5: after it
                    ["flag", f, "fail_after", None],
                    ["reset_all"],
                    ["flag", f, "corrupt", 1],
                    ["gen", [0]],  # c9: scrambled KV loaded: the output changes
                    ["flag", f, "corrupt", None],
                    ["reset_all"],
                    ["damage", str(store)],  # c12
                    ["metrics"],  # c13
                    ["gen", [0]],  # c14: damaged objects: checksum -> recompute
                    ["metrics"],  # c15: storage hits c0, c4, c9, c14 and the read errors
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


# Hybrid (tiny Qwen3-Next): vLLM makes its attention block 160 tokens (the state page sets it)
# with the Gated DeltaNet state in bf16. HYBRID_LLM asks for bf16: on a CPU with AVX-512 BF16
# vLLM's default ("auto") becomes float32 (vllm/platforms/cpu.py), whose larger state page makes
# the block 288, and the prompts below are laid out for 160. The float32 phase tests that case.
# The tiny model's output depends on about its last 160 tokens only (a random prefix further
# back changes nothing), so the prompts leave few tokens after the hit for the checks to bite.
# HPROMPT0: 490 tokens; vLLM prefills 480 (3 blocks: the state at 480 is kept), then 10.
# HPROMPT1: HPROMPT0's first 485 tokens and 5 others (a partial hit at 480).
# HPROMPT2: 630 tokens; 24 decode tokens cross the boundary at 640, whose state is saved too
# (save_decode): the next turn (HPROMPT2, its reply and 3 more: 657 tokens) hits 640.
HBLOCK = 160
HPROMPT0 = [_rng.randrange(1, 1000) for _ in range(490)]
HPROMPT1 = HPROMPT0[:485] + [_rng.randrange(1, 1000) for _ in range(5)]
HPROMPT2 = [_rng.randrange(1, 1000) for _ in range(630)]
HYBRID_HIT = 480
HYBRID_FOLLOWUP_HIT = 640
HYBRID_LLM = {"mamba_ssm_cache_dtype": "bfloat16"}


def hybrid_spec(model: Path, tmp: Path) -> dict[str, Any]:
    """Host hit, partial hit, next chat turn over a decode boundary, storage hit after a
    restart, a store fault mid-load, zeroed states, zeroed KV and damaged objects."""
    store, flags = tmp / "store", tmp / "flags"
    flags.mkdir(parents=True, exist_ok=True)
    f = str(flags)
    return {
        "model": str(model),
        "mode": "inproc",
        "llm": {**HYBRID_LLM, "disable_log_stats": False},  # the "metrics" steps read vLLM's
        "prompts": [HPROMPT0, HPROMPT1, HPROMPT2],
        "phases": [
            {
                "connector": {"host_gib": 0.05},
                "steps": [
                    ["gen", [0]],  # a0: recompute of HPROMPT0
                    ["reset"],
                    ["gen", [0]],  # a2: host hit
                    ["reset_all"],
                    ["gen", [1]],  # a4: recompute of HPROMPT1
                    ["reset_all"],
                    ["gen", [0]],  # a6: HPROMPT0 again into the host tier
                    ["reset"],
                    ["gen", [1]],  # a8: partial host hit
                    ["gen", [2]],  # a9: HPROMPT2, its decode crosses 640
                    ["reset"],
                    ["followup", 2, 3],  # a11: the next turn hits the decode boundary
                    ["metrics"],  # a12: host hits a2, a8, a11
                ],
            },
            # vLLM alone: the same next turn with vLLM's own prefix cache (a hit at 480)
            {"connector": None, "steps": [["gen", [2]], ["followup", 2, 3]]},
            # c0, c1: written (HPROMPT2 with the state its decode made at 640)
            {"connector": faulty(store, flags), "steps": [["gen", [0]], ["gen", [2]]]},
            {
                "connector": faulty(store, flags),  # a restart: a new vLLM, the same store
                "steps": [
                    ["gen", [0]],  # d0: storage hit
                    ["followup", 2, 3],  # d1: the next turn of HPROMPT2 from the store
                    ["reset_all"],
                    ["flag", f, "fail_after", 1],
                    ["metrics"],  # d4: before the fault
                    ["gen", [0]],  # d5: a store fault after the first page of the load
                    ["metrics"],  # d6: after it
                    ["flag", f, "fail_after", None],
                    ["reset_all"],
                    ["flag", f, "corrupt", "state"],
                    ["gen", [0]],  # d10: the states loaded are zeroes: the output changes
                    ["reset_all"],
                    ["flag", f, "corrupt", "kv"],
                    ["gen", [0]],  # d13: the KV loaded is zeroes: the output changes
                    ["flag", f, "corrupt", None],
                    ["reset_all"],
                    ["damage", str(store)],  # d16
                    ["metrics"],  # d17
                    ["gen", [0]],  # d18: damaged objects: checksum -> recompute
                    ["metrics"],  # d19
                ],
            },
            {
                # float32 states (larger state pages, so a larger attention block): recompute,
                # then a host hit at the first boundary (HPROMPT0 is prefilled up to it first)
                "llm": {"mamba_ssm_cache_dtype": "float32"},
                "connector": {"host_gib": 0.05},
                "steps": [["gen", [0]], ["reset"], ["gen", [0]]],
            },
        ],
    }


def hybrid_two_process_spec(model: Path, tmp: Path) -> dict[str, Any]:
    """The hybrid model in vLLM's default mode (separate processes): recompute, a host hit
    after vLLM's prefix cache is reset, then a restart that hits the store."""
    connector = {"host_gib": 0.05, "storage_backend": "directory", "storage_path": str(tmp)}
    return {
        "model": str(model),
        "mode": "mp",
        "llm": HYBRID_LLM,
        "prompts": [HPROMPT0],
        "phases": [
            {"connector": connector, "steps": [["gen", [0]], ["reset"], ["gen", [0]]]},
            {"connector": connector, "steps": [["gen", [0]]]},
        ],
    }


# Page keys (tests/integrations/vllm/test_vllm_keys.py): one 640-token prompt under two cache
# salts, none, and two LoRA adapters; 19 full blocks of 32 may hit (608 tokens).
KPROMPT = [_rng.randrange(1, 1000) for _ in range(640)]
KEYS_HIT = (len(KPROMPT) - 1) // BLOCK * BLOCK  # 608
KEYS_LLM = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


def keys_spec(model: Path, loras: dict[str, Path]) -> dict[str, Any]:
    """One vLLM (LoRA enabled), its prefix cache reset before every request, so a cached
    token comes from the connector: salts A and B, no salt, adapters a and b."""
    steps: list[list[Any]] = []
    for i in (0, 1, 0, 2, 2, 3, 4, 3, 4):
        steps += [["reset"], ["gen", [i]]]
    return {
        "model": str(model),
        "mode": "inproc",
        "llm": KEYS_LLM,
        "loras": {name: str(path) for name, path in loras.items()},
        "prompts": [
            {"tokens": KPROMPT, "salt": "tenant-a"},  # 0
            {"tokens": KPROMPT, "salt": "tenant-b"},  # 1
            KPROMPT,  # 2: no salt
            {"tokens": KPROMPT, "lora": "a"},  # 3
            {"tokens": KPROMPT, "lora": "b"},  # 4
        ],
        # step 2k + 1 runs: A, B, A, none, none, adapter a, adapter b, a, b
        "phases": [{"connector": {"host_gib": 0.05}, "steps": steps}],
    }
