"""`hicache bench vllm-worker`: the JSON document's shape (never its timings), the GPU part's
skip without a GPU, bad input."""

from __future__ import annotations

import json

import pytest
import torch

from hicache.cli import main

TINY = ["--layers", "2", "--blocks", "8", "--repeats", "1", "--layer-ms", "0.2"]
NO_CUDA = not torch.cuda.is_available() or torch.version.hip is not None


def test_json_has_the_cpu_copies_and_compute_against_their_baselines(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "vllm-worker", "--json", *TINY]) == 0
    doc = json.loads(capsys.readouterr().out)
    cpu = doc["cpu"]
    assert cpu["copy_backend"] == "memcpy"  # hicache's native copy on the CPU
    for op in ("save", "load"):
        assert set(cpu["copy"][op]) == {"worker_gbps", "baseline_gbps", "ratio"}
        assert cpu["copy"][op]["ratio"] > 0
    assert cpu["copy"]["bytes"] == 8 * cpu["page_bytes"]
    assert {"step_ms_without_saves", "step_ms_with_saves", "slowdown"} <= set(cpu["compute"])


@pytest.mark.skipif(not NO_CUDA, reason="checks the behaviour without a CUDA GPU")
def test_the_gpu_part_is_skipped_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "vllm-worker", "--json", *TINY]) == 0
    captured = capsys.readouterr()
    assert "no CUDA GPU" in json.loads(captured.out)["cuda"]["skipped"]
    assert "skipped" in captured.err


def test_bad_counts_are_refused_with_status_2() -> None:
    assert main(["bench", "vllm-worker", "--blocks", "0"]) == 2


@pytest.mark.parametrize("layout", ["LBHNC", "LBNHC", "BLHNC", "BLNHC"])
def test_each_vllm_layout_runs_and_the_block_outermost_ones_copy_whole_pages(
    layout: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "vllm-worker", "--json", "--layout", layout, *TINY]) == 0
    cpu = json.loads(capsys.readouterr().out)["cpu"]
    assert cpu["layout"] == layout
    assert cpu["whole_pages"] == layout.startswith("B")
    assert cpu["page_bytes"] == 2 * 16 * 8 * 256 * 2  # 2 layers of 16 tokens x 8 heads x 256 bf16


def test_an_unknown_layout_is_refused_with_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "vllm-worker", "--layout", "LHBNC"]) == 2
    assert "--layout 'LHBNC'" in capsys.readouterr().err
