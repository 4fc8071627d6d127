"""`hicache bench vllm --slow-store` end to end on a real vLLM (a short run): its JSON document,
and that the baselines did what they say (always loads every hit, never loads none)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.integrations.vllm.bench import make_tiny_llama
from tests.integrations.vllm.real_vllm import bench_vllm_json

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]

POLICIES = {"measured", "always", "never"}


def test_slow_store_bench_reports_every_policy_in_both_cases(tmp_path: Path) -> None:
    model = make_tiny_llama(tmp_path / "model")  # 2 layers, hidden 256; the bench's lengths
    doc = bench_vllm_json(
        *("--slow-store", "--model", str(model), "--prompt-tokens", "256"),
        *("--repeats", "1", "--read-mib-s", "64"),
    )
    assert doc["prompt_tokens"] == 256
    assert doc["read_mib_s"] == 64
    for case in ("fast_host", "slow_store"):
        got = doc[case]
        assert set(got["ttft_ms"]) == POLICIES
        assert all(ms > 0 for ms in got["ttft_ms"].values())
        assert {p: len(r) for p, r in got["runs_ms"].items()} == dict.fromkeys(POLICIES, 1)
        # the block size is 32: the hit is every full block but the one holding the last token
        assert got["hit_tokens"]["always"] == [224]
        assert got["hit_tokens"]["never"] == [0]
        assert got["measured_vs_best"] > 0
        assert got["faster_baseline"] in {"always", "never"}
        assert got["measured_vs_faster_paired"] > 0
        assert isinstance(got["measured_loads_like_faster_baseline"], bool)
    assert set(doc["targets_met"]) == {
        "fast_host_within_5pct_of_best",
        "slow_store_within_5pct_of_best",
        "slow_store_better_than_always",
    }
