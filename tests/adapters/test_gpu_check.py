"""scripts/gpu-check and the driver probe it runs first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache.adapters.copy.cuda_batch import probe_batch
from hicache.domain import TransferError

ROOT = Path(__file__).resolve().parents[2]
NO_CUDA = not torch.cuda.is_available() or torch.version.hip is not None


@pytest.mark.skipif(not NO_CUDA, reason="checks the behaviour without a CUDA GPU")
def test_the_probe_says_why_it_cannot_run_without_a_cuda_gpu() -> None:
    with pytest.raises(TransferError, match="cuMemcpyBatchAsync cannot run here: no CUDA GPU"):
        probe_batch()


@pytest.mark.skipif(not NO_CUDA, reason="checks the behaviour without a CUDA GPU")
def test_gpu_check_exits_2_without_a_cuda_gpu(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA GPU" in proc.stderr


@pytest.mark.gpu
def test_the_probe_moves_three_copies_byte_exact_through_the_driver() -> None:
    assert "3 copies exact" in probe_batch(0)
