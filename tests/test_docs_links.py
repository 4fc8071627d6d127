"""The documentation's index and links hold together.

- docs/README.md lists every page in docs/ exactly once, and nothing that is not there;
- every relative link in README.md and docs/*.md names a file that exists (anchors aside).
  docs/cache-face.md lands with the cache face; until then links to it are the only ones
  allowed to dangle.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PENDING = {DOCS / "cache-face.md"}
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _index_entries() -> list[str]:
    text = (DOCS / "README.md").read_text(encoding="utf-8")
    return re.findall(r"^\| \[([^\]]+)\]\(", text, flags=re.M)


def test_the_index_lists_every_page_once() -> None:
    entries = _index_entries()
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "README.md")
    assert len(entries) == len(set(entries)), "a page is listed twice in docs/README.md"
    assert sorted(entries) == pages


def _dangling(path: Path) -> list[str]:
    bad = []
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if "://" in target or target.startswith("#"):
            continue
        file = (path.parent / target.split("#", 1)[0]).resolve()
        if not file.exists() and file not in PENDING:
            bad.append(target)
    return bad


def test_every_relative_link_names_an_existing_file() -> None:
    bad = {
        str(p.relative_to(ROOT)): _dangling(p)
        for p in [ROOT / "README.md", *DOCS.glob("*.md")]
        if _dangling(p)
    }
    assert not bad


def test_a_dangling_link_is_caught(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("see [there](nowhere.md#x) and [ok](page.md)", encoding="utf-8")
    assert _dangling(page) == ["nowhere.md#x"]
