"""The sliding-window scenario test_vllm_sliding.py runs (a spec for runner.py): a tiny Gemma-3
(hicache.integrations.vllm.bench.make_tiny_gemma3: sliding-window and full-attention layers
alternating, window 64) under vLLM's hybrid KV cache manager, float32, blocks of 32 tokens: a
sliding layer reads the 63 tokens before a boundary, so a hit needs the window pages of the 2
blocks before it.

SPROMPT0: 300 tokens (9 full blocks may hit: 288 tokens);
SPROMPT1: SPROMPT0's first 200 tokens, then 100 others (a partial hit of 6 blocks: 192).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from hicache.domain.keys import chain_keys, page_hex
from tests.integrations.vllm.scenario import faulty

SBLOCK = 32
WINDOW = 64
_rng = random.Random(5)
SPROMPT0 = [_rng.randrange(1, 1000) for _ in range(300)]
SPROMPT1 = SPROMPT0[:200] + [_rng.randrange(1, 1000) for _ in range(100)]
SLIDING_HIT = (len(SPROMPT0) - 1) // SBLOCK * SBLOCK  # 288
SLIDING_PARTIAL_HIT = 200 // SBLOCK * SBLOCK  # 192
SLIDING_SHORT_HIT = SLIDING_HIT - SBLOCK  # window page 8 lost: boundary 8 (256)
SLIDING_LLM = {"dtype": "float32", "disable_log_stats": False}


def lost_window(*pages: int) -> str:
    """The ``lose`` flag's text: the window page objects of SPROMPT0's blocks ``pages``."""
    keys = chain_keys(SPROMPT0, SBLOCK)
    return "\n".join(f"swa-r0:{page_hex(keys[p])}" for p in pages)


def sliding_spec(model: Path, tmp: Path) -> dict[str, Any]:
    """Host hit, partial host hit, storage hit after a restart, a lost window page outside the
    hit's window (no change) and inside it (a shorter hit), zeroed window pages (the output
    changes: they are used), and the same model with vLLM's hybrid KV cache manager off (one
    page of all four layers) for the bytes a hit loads."""
    store, flags = tmp / "store", tmp / "flags"
    flags.mkdir(parents=True, exist_ok=True)
    f = str(flags)
    return {
        "model": str(model),
        "mode": "inproc",
        "llm": SLIDING_LLM,
        "prompts": [SPROMPT0, SPROMPT1],
        "phases": [
            {
                "connector": {"host_gib": 0.05},
                "steps": [
                    ["gen", [0]],  # a0: recompute of SPROMPT0
                    ["reset"],
                    ["metrics"],  # a2
                    ["gen", [0]],  # a3: host hit
                    ["metrics"],  # a4: what the host hit loaded
                    ["reset_all"],
                    ["gen", [1]],  # a6: recompute of SPROMPT1
                    ["reset_all"],
                    ["gen", [0]],  # a8: SPROMPT0 again into the host tier
                    ["reset"],
                    ["gen", [1]],  # a10: partial host hit
                ],
            },
            {"connector": faulty(store, flags), "steps": [["gen", [0]]]},  # b0: written
            {
                "connector": faulty(store, flags),  # a restart: a new vLLM, the same store
                "steps": [
                    ["metrics"],  # c0
                    ["gen", [0]],  # c1: storage hit
                    ["metrics"],  # c2: what it read
                    ["reset_all"],
                    ["flag", f, "lose", lost_window(4)],
                    ["gen", [0]],  # c5: page 4 is outside boundary 9's window: a full hit
                    ["reset_all"],
                    ["flag", f, "lose", lost_window(4, 8)],
                    ["gen", [0]],  # c8: page 8 is in it: the hit ends at boundary 8
                    ["reset_all"],
                    ["flag", f, "lose", None],
                    ["flag", f, "corrupt", "swa"],
                    ["gen", [0]],  # c12: the window pages loaded are zeroes
                    ["flag", f, "corrupt", None],
                ],
            },
            {
                # vLLM's hybrid KV cache manager off: one attention group of all four layers
                "llm": {"disable_hybrid_kv_cache_manager": True},
                "connector": {"host_gib": 0.05},
                "steps": [["gen", [0]], ["reset"], ["metrics"], ["gen", [0]], ["metrics"]],
            },
        ],
    }


def sliding_two_process_spec(model: Path, tmp: Path) -> dict[str, Any]:
    """The sliding-window model in vLLM's default mode (scheduler and worker in separate
    processes): recompute, a host hit after vLLM's prefix cache is reset, then a restart that
    hits the store."""
    connector = {"host_gib": 0.05, "storage_backend": "directory", "storage_path": str(tmp)}
    return {
        "model": str(model),
        "mode": "mp",
        "llm": {"dtype": "float32"},
        "prompts": [SPROMPT0],
        "phases": [
            {"connector": connector, "steps": [["gen", [0]], ["reset"], ["gen", [0]]]},
            {"connector": connector, "steps": [["gen", [0]]]},
        ],
    }
