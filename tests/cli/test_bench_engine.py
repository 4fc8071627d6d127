"""`hicache bench engine`: the document's shape (never its timings) and what it measures."""

from __future__ import annotations

import json

import pytest

from hicache.bench.engine import (
    NullTransfer,
    measure_free_us,
    measure_load_overhead_us,
    measure_rss_released_fraction,
)
from hicache.cli import main
from hicache.domain.ports import Transfer


def test_json_is_one_document_with_every_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--json", "--rounds", "1"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"device", "free_us", "load_overhead_us", "rss_released_fraction"}
    assert doc["device"] == "cpu"
    assert set(doc["free_us"]) == {"32768", "1048576", "8388608"}
    assert set(doc["load_overhead_us"]) == {"1", "16", "256"}
    assert all(v > 0 for v in [*doc["free_us"].values(), *doc["load_overhead_us"].values()])
    assert 0.0 <= doc["rss_released_fraction"] <= 1.5


def test_the_table_names_each_figure(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    assert "free of 16 pages" in out
    assert "engine time per load" in out
    assert "given back at close" in out


def test_bad_rounds_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "engine", "--rounds", "0"]) == 2
    err = capsys.readouterr().err
    assert "--rounds" in err
    assert "Traceback" not in err


def test_the_null_transfer_is_a_transfer_that_moves_nothing() -> None:
    t = NullTransfer(3)
    assert isinstance(t, Transfer)
    assert t.transfer_layers == 3
    assert t.load_layer(0, []) == 0
    assert t.backup([]) == 0


def test_each_measurement_runs_on_its_own() -> None:
    assert measure_free_us(1024, repeats=3) > 0
    assert measure_load_overhead_us(4, rounds=1, layers=2) > 0
    # Closing a shm runtime gives back (nearly) all of its host bytes.
    assert measure_rss_released_fraction(16) >= 0.99
