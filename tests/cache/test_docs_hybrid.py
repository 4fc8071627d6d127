"""The state-model and sliding-window serving loops in docs/cache-face.md run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from hicache import PoolName

DOC = Path(__file__).resolve().parents[2] / "docs" / "cache-face.md"


def _example(heading: str) -> dict[str, object]:
    text = DOC.read_text(encoding="utf-8")
    assert heading in text, f"docs/cache-face.md lost its section {heading!r}"
    section = text[text.index(heading) :]
    section = section[: section.index("\n#", 1)]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, f"{heading!r}: expected one python example"
    namespace: dict[str, object] = {"__name__": "docs_cache_face_hybrid_example"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    return namespace


def test_the_state_model_loop_resumes_from_the_restored_checkpoint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ns = _example("### A state model")
    result = ns["result"]
    assert result == {"hit": 10, "resumed_from": 10.0, "again": 12}
    assert "'resumed_from': 10.0" in capsys.readouterr().out


def test_the_sliding_window_loop_restores_only_the_window(
    capsys: pytest.CaptureFixture[str],
) -> None:
    ns = _example("### A sliding-window model")
    result = ns["result"]
    assert isinstance(result, dict)
    assert result["hit"] == 12
    assert result["counts"] == {PoolName.KV: 12, PoolName.SWA: 8}
    assert result["window_pages"] == list(range(4, 12))
    assert result["again"] == 13
    # The example prints one line (log lines may come before it when logging goes to stdout).
    assert capsys.readouterr().out.splitlines()[-1].startswith("12 ")
