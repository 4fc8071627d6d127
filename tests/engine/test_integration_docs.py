"""The examples in docs/integration.md, docs/operations.md and README.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)


def _run(path: Path, code: str) -> dict[str, object]:
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}_example"}
    exec(compile(code, str(path), "exec"), namespace)
    return namespace


def test_the_async_integration_example_round_trips_framework_owned_pages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = ROOT / "docs" / "integration.md"
    blocks = _python_blocks(doc)
    assert len(blocks) == 3, "docs/integration.md lost its async, sync or cache-face example"
    ns = _run(doc, blocks[0])
    stats = ns["stats"]
    assert isinstance(stats, dict)
    assert stats["loads"] == 1
    assert stats["backups"] == 2
    assert stats["bytes_loaded"] > 0
    assert capsys.readouterr().out.strip()


def test_the_sync_integration_example_merges_and_closes_the_runtime() -> None:
    doc = ROOT / "docs" / "integration.md"
    ns = _run(doc, _python_blocks(doc)[1])
    assert ns["rt"].closed is True  # type: ignore[attr-defined]
    assert ns["result"] == [[True, True, True]]


def test_the_cache_face_integration_example_restores_into_framework_pages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    doc = ROOT / "docs" / "integration.md"
    ns = _run(doc, _python_blocks(doc)[2])
    assert ns["result"] == {"restored": True, "evicted": 6, "free": 58}
    assert "'restored': True" in capsys.readouterr().out


def test_the_readme_quick_start_runs() -> None:
    readme = ROOT / "README.md"
    blocks = _python_blocks(readme)
    assert blocks, "README.md lost its quick start"
    ns = _run(readme, blocks[0])
    assert ns["restored"] is True


def test_the_logging_set_up_in_operations_prints_json_lines_at_info() -> None:
    import json
    import subprocess
    import sys

    doc = ROOT / "docs" / "operations.md"
    blocks = _python_blocks(doc)
    assert len(blocks) == 1, "docs/operations.md lost its logging example"
    code = (
        blocks[0]
        + "structlog.get_logger('hicache.engine').debug('hidden', engine='e')\n"
        + "structlog.get_logger('hicache.engine').info('engine_opened', engine='e')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    lines = [json.loads(line) for line in out.splitlines()]
    assert [(e["event"], e["level"]) for e in lines] == [("engine_opened", "info")]
