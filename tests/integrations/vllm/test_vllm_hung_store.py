"""A store whose every call hangs, under a real vLLM: each request is a miss within
``deadline_s + grace_s``, vLLM keeps serving with the tokens it gives without the connector,
and shutting the connector down does not wait for the store.

The store is tests/integrations/vllm/faulty_store.py loaded through the connector's "dynamic"
backend; its ``hang`` flag file makes every exists / get / put wait (up to 600 s, ignoring its
deadline) while the file exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from tests.integrations.vllm.real_vllm import run_spec  # noqa: E402
from tests.integrations.vllm.scenario import PROMPT0, PROMPT1, faulty  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
BOUND = {"deadline_s": 0.5, "grace_s": 0.5}
# A request that waited for the hung store would take at least HANG_MAX_S (600 s); one that
# waited for one bound and then for nothing takes about a second on a CPU.
WAITED_FOR_THE_STORE_MS = 60_000


def hung_spec(model: Path, tmp: Path) -> dict[str, Any]:
    flags = tmp / "flags"
    flags.mkdir(parents=True, exist_ok=True)
    f = str(flags)
    connector = {**faulty(tmp / "store", flags), **BOUND}
    return {
        "model": str(model),
        "mode": "inproc",
        "prompts": [PROMPT0, PROMPT1],
        "phases": [
            {"connector": None, "steps": [["gen", [0]], ["gen", [1]]]},  # a: vLLM alone
            {"connector": connector, "steps": [["gen", [0]]]},  # b: PROMPT0 stored
            {
                "connector": connector,  # a restart: PROMPT0 is in the store only
                "steps": [
                    ["flag", f, "hang", "all"],
                    ["gen", [1]],  # c1: exists (of a stored prefix) hangs: a miss
                    ["gen", [0]],  # c2: store calls refused while the first ones hang
                    ["flag", f, "hang", "get"],  # the hung exists and put return
                    ["sleep", 0.5],
                    ["reset_all"],
                    ["gen", [0]],  # c6: a storage hit whose read hangs: recomputed
                    # the hung read still runs when vLLM shuts the connector down
                ],
            },
        ],
    }


@pytest.fixture(scope="module")
def hung(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-hung")
    return run_spec(hung_spec(tiny_llama, tmp), tmp)


def test_a_hung_store_makes_requests_misses_with_vllms_own_tokens(hung: dict[str, Any]) -> None:
    alone = [hung["phases"][0][i][0] for i in (0, 1)]
    assert len(set(alone[0]["tokens"])) > 12  # varied tokens: the equality below means something
    assert hung["phases"][1][0][0]["tokens"] == alone[0]["tokens"]
    exists_hung, refused, read_hung = (hung["phases"][2][i][0] for i in (1, 2, 6))
    assert exists_hung["tokens"] == alone[1]["tokens"]
    assert exists_hung["cached"] == 0  # a miss: nothing came from the store
    assert refused["tokens"] == alone[0]["tokens"]
    assert read_hung["tokens"] == alone[0]["tokens"]  # the failed load was recomputed
    for got in (read_hung, exists_hung, refused):
        assert got["ms"] < WAITED_FOR_THE_STORE_MS
