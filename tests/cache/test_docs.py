"""The serving loop in docs/cache-face.md runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "cache-face.md"


def test_the_documented_cache_serving_loop_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## A serving loop") :]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/cache-face.md lost its serving loop"
    namespace: dict[str, object] = {"__name__": "docs_cache_face_example"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    stats = namespace["stats"]
    assert isinstance(stats, dict)
    assert (
        stats["hit_tokens"]["storage"] == 8 * 16
    )  # the second request found the prefix in storage
    assert stats["prefetched_pages"] == 8
    assert stats["loaded_pages"] == 8
    assert stats["stored_pages"] >= 8
    assert stats["index"]["pinned"] == {"device": 0, "host": 0, "storage": 0}
    out, _ = capsys.readouterr()
    assert out.strip()
