"""The serving loop in docs/engine.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "engine.md"


def _serving_loop() -> str:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## A serving loop") :]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/engine.md lost its serving loop example"
    return blocks[0]


def test_the_documented_serving_loop_runs(capsys: pytest.CaptureFixture[str]) -> None:
    code = _serving_loop()
    namespace: dict[str, object] = {"__name__": "docs_engine_example"}
    exec(compile(code, str(DOC), "exec"), namespace)
    stats = namespace["stats"]
    assert isinstance(stats, dict)
    assert stats["loads_joined"] == 1
    assert stats["backups"] == 1
    assert stats["loads"] + stats["loads_cancelled"] >= 2
    assert stats["bytes_loaded"] > 0
    out, _ = capsys.readouterr()
    assert out.strip()
