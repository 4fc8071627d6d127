"""docs/metrics.md's example runs as written: a cache registered in a framework's registry and
served on its own loopback port."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_the_export_example_in_docs_metrics_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = DOC.read_text(encoding="utf-8")
    section = text[text.index("## Export a cache") :]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert blocks, "docs/metrics.md lost its example"
    namespace: dict[str, object] = {"__name__": "docs_metrics_example"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    out, _ = capsys.readouterr()
    first, misses = out.strip().splitlines()[-2:]  # log lines may precede them on stdout
    assert first.startswith("# HELP hicache_")  # the endpoint served hicache's metrics
    assert misses == "3"  # one miss sample per tier, in the framework's registry
