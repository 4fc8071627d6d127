"""Shared test configuration: the gpu marker skips cleanly where no GPU is present; shm_dir."""

from __future__ import annotations

import importlib.util
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

FIXTURES = Path(__file__).resolve().parents[1] / "src" / "hicache" / "fixtures" / "models"


def _has_gpu() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(item.get_closest_marker("gpu") for item in items) and not _has_gpu():
        skip = pytest.mark.skip(reason="needs a CUDA or ROCm GPU")
        for item in items:
            if item.get_closest_marker("gpu"):
                item.add_marker(skip)


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture
def shm_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private segment directory (HICACHE_SHM_DIR) for a test and the subprocesses it starts."""
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    path = Path(tempfile.mkdtemp(prefix="hicache-test-dir-", dir=root))
    monkeypatch.setenv("HICACHE_SHM_DIR", str(path))
    yield path
    shutil.rmtree(path, ignore_errors=True)
