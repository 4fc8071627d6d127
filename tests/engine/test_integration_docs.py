"""The examples in docs/integration.md and the README's quick start run as written."""

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
    assert len(blocks) == 2, "docs/integration.md lost its async or sync example"
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


def test_the_readme_quick_start_runs() -> None:
    readme = ROOT / "README.md"
    blocks = _python_blocks(readme)
    assert blocks, "README.md lost its quick start"
    ns = _run(readme, blocks[0])
    assert ns["restored"] is True
