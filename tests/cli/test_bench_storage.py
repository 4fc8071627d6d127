"""`hicache bench storage`: a smoke run with tiny sizes (keys and types, never timings)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hicache.bootstrap import storage as boot
from hicache.cli import main
from hicache.cli.bench_storage import KEYS
from tests.storage.fakes import FakeStore

TINY = ["--pages", "4", "--page-size", "16", "--layers", "2", "--repeats", "1"]


def test_json_document_has_exactly_the_documented_keys(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    config = json.dumps({"root": str(tmp_path / "store")})
    assert main(["bench", "storage", "--json", *TINY, "--store-config", config]) == 0
    out, _ = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 1
    doc = json.loads(lines[0])
    assert tuple(doc) == KEYS
    assert doc["store"] == "directory"
    assert doc["pages"] == 4
    assert doc["page_bytes"] == 16 * 2 * 2 * 8 * 64 * 2  # tokens x layers x K,V x heads x dim x 2 B
    for key in ("put_gbps", "get_gbps", "raw_read_gbps", "raw_write_gbps"):
        assert doc[key] > 0, key
    assert doc["exists_per_s"] > 0
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == []  # cleaned up


def test_human_summary_shows_ratios(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "storage", *TINY]) == 0
    out, _ = capsys.readouterr()
    assert out.startswith("store directory: 4 pages of 64.0 KiB")
    assert "raw read" in out


def test_a_registered_store_can_be_benched(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(boot, "_factories", dict(boot._factories))
    boot.register_store_factory("fake", lambda config: FakeStore())
    assert main(["bench", "storage", "--store", "fake", "--json", *TINY]) == 0
    assert json.loads(capsys.readouterr().out)["store"] == "fake"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--store", "nope"], "invalid choice: 'nope'"),
        (["--pages", "0"], "--pages must be a positive integer, got 0"),
        (["--layout", "diagonal"], "unknown layout 'diagonal'"),
        (["--store-config", '{"rot": 1}'], "unknown keys ['rot']"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as info:
        raise SystemExit(main(["bench", "storage", *TINY, *argv]))
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1
