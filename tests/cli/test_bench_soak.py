"""`hicache bench soak`: the JSON document's shape, the table lines, bad input (never timings)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from hicache.cli import main
from hicache.cli.bench_soak import PATHS, parse_paths
from hicache.domain import ConfigError


def test_json_is_one_document_with_each_paths_counts_and_the_totals(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "soak", "--ops", "40", "--seed", "3", "--paths", "cache", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["paths"]) == {"cache"}
    cache = doc["paths"]["cache"]
    assert {"ops", "faults", "errors", "leaks", "corrupt_pages", "checked_pages", "seconds"} <= set(
        cache
    )
    assert cache["ops"] == 40
    assert (cache["errors"], cache["leaks"], cache["corrupt_pages"]) == (0, 0, 0)
    assert (cache["details"]["leaked_slots"], cache["details"]["leaked_pins"]) == (0, 0)
    assert sum(cache["operations"].values()) >= 40
    assert (doc["errors"], doc["leaks"], doc["corrupt_pages"]) == (0, 0, 0)
    assert doc["checked_pages"] == cache["checked_pages"]


def test_the_table_is_one_line_per_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "soak", "--ops", "10", "--paths", "cache"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 1
    assert out[0].startswith("cache: 10 ops, ")
    assert out[0].endswith("0 errors, 0 leaks, 0 corrupt pages")


@pytest.mark.parametrize(
    ("flag", "value"), [("--ops", "0"), ("--ops", "-3"), ("--concurrency", "0")]
)
def test_a_bad_count_exits_2_with_one_line(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    assert main(["bench", "soak", flag, value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert f"{flag} must be a positive integer" in err[0]


@pytest.mark.parametrize("value", ["", ",", "cache,gpu", "vLLM", "x" * 10_000])
def test_an_unknown_path_exits_2_naming_the_choices(
    capsys: pytest.CaptureFixture[str], value: str
) -> None:
    assert main(["bench", "soak", "--paths", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "cache, vllm, sglang" in err[0]
    assert len(err[0]) < 400


def test_paths_are_read_in_a_fixed_order_each_once() -> None:
    assert parse_paths("sglang, cache,sglang") == ("cache", "sglang")
    assert parse_paths(",".join(PATHS)) == PATHS
    with pytest.raises(ConfigError, match="--paths"):
        parse_paths(None)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.sglang
@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("sglang") is None,
    reason="needs vllm and sglang",
)
def test_the_engine_paths_report_through_the_cli(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "soak", "--ops", "60", "--paths", "vllm,sglang", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc["paths"]) == {"vllm", "sglang"}
    for report in doc["paths"].values():
        assert (report["errors"], report["leaks"], report["corrupt_pages"]) == (0, 0, 0)
        assert report["ops"] == 60
