"""Fixtures of the vLLM connector's tests: the tiny Llama that real-vLLM runs load."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.integrations.vllm.real_vllm import ROOT, child_env


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-llama") / "model"
    subprocess.run(
        [
            sys.executable,
            "-c",
            f"from tests.integrations.vllm.runner import make_model; "
            f"from pathlib import Path; make_model(Path({str(folder)!r}))",
        ],
        cwd=ROOT,
        env=child_env(),
        check=True,
        timeout=300,
    )
    return folder
