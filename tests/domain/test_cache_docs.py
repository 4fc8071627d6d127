"""The examples in docs/cache.md run as written, top to bottom in one namespace."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "cache.md"


def test_every_python_example_in_the_cache_page_runs() -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) >= 4, "docs/cache.md lost its examples"
    scope: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), scope)
