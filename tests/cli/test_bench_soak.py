"""`hicache bench soak`: the JSON document's shape, the table line, bad input (never timings)."""

from __future__ import annotations

import json

import pytest

from hicache.cli import main


def test_json_is_one_document_with_the_leak_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "soak", "--ops", "40", "--seed", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {"ops", "faults", "leaked_slots", "leaked_pins", "corrupt_pages", "seconds"} <= set(doc)
    assert doc["ops"] == 40
    assert (doc["leaked_slots"], doc["leaked_pins"], doc["corrupt_pages"]) == (0, 0, 0)
    assert sum(doc["operations"].values()) >= 40


def test_the_table_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "soak", "--ops", "10"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("10 ops, ")
    assert "0 leaked slots, 0 leaked pins, 0 corrupt pages, 0 errors" in out


@pytest.mark.parametrize(("flag", "value"), [("--ops", "0"), ("--ops", "-3"), ("--concurrency", "0")])
def test_a_bad_count_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    assert main(["bench", "soak", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"{flag} must be a positive integer" in err[0]
