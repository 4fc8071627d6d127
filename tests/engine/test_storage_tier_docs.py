"""The storage tier example in docs/storage.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "storage.md"


def test_the_documented_storage_tier_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## The storage tier in the engine") :]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/storage.md lost its storage tier example"
    exec(compile(blocks[-1], str(DOC), "exec"), {"__name__": "docs_storage_tier_example"})
    assert capsys.readouterr().out.strip() == "{'hit': 2, 'bytes_read': 8192}"
