"""`hicache bench scale --json`: the document's shape on a small run; bad flags exit 2.

Speeds are not asserted (measurements, not tests); the ratios are checked to be the ratios of
the points the document reports.
"""

from __future__ import annotations

import json

import pytest

from hicache.adapters.copy import native_status
from hicache.bench.scale import LAYERS, copy_sizes
from hicache.cli import main

pytestmark = pytest.mark.timeout(120)


@pytest.mark.skipif(not native_status()[0], reason="the native memcpy helper cannot be built here")
def test_scale_json_reports_both_ratios_from_its_own_points(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--max-bytes", "64MiB", "--max-pages", "10000", "--repeats", "1"]
    assert main(["bench", "scale", "--json", *argv]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {"copy", "planner", "cache", "seconds"}
    cache = doc["cache"]
    assert [p["pages"] for p in cache["points"]] == [1000, 10000]
    small, large = cache["points"][0], cache["points"][-1]
    assert cache["ratio_match_per_page"] == pytest.approx(
        large["match_us_per_page"] / small["match_us_per_page"], rel=0.05
    )
    assert cache["ok"] is (cache["ratio_match_per_page"] <= cache["target"] == 2.0)
    copy, planner = doc["copy"], doc["planner"]
    assert [p["bytes"] for p in copy["points"]] == [16 << 20, 64 << 20]
    first, last = copy["points"][0], copy["points"][-1]
    per_byte = (last["ms"] / last["bytes"]) / (first["ms"] / first["bytes"])
    assert copy["ratio_per_byte"] == pytest.approx(per_byte, rel=0.02)
    assert copy["ok"] is (copy["ratio_per_byte"] <= copy["target"] == 1.2)
    assert [p["layers"] for p in planner["points"]] == list(LAYERS)
    lo, hi = planner["points"][0], planner["points"][-1]
    assert planner["ratio_per_layer"] == pytest.approx(
        hi["us_per_layer"] / lo["us_per_layer"], rel=0.02
    )
    assert planner["target"] == 2.0


def test_copy_sizes_go_from_16_mib_by_fours_up_to_the_maximum() -> None:
    assert copy_sizes(1 << 30) == [16 << 20, 64 << 20, 256 << 20, 1 << 30]
    assert copy_sizes(100 << 20) == [16 << 20, 64 << 20]


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--max-bytes", "1MiB"], "--max-bytes must be at least"),
        (["--max-bytes", "1e308"], "cannot read size"),
        (["--max-bytes", "1000TiB"], "needs"),
        (["--repeats", "0"], "--repeats must be a positive integer"),
        (["--max-pages", "999"], "--max-pages must be an integer of at least 1000"),
        (["--max-pages", "100000000"], "--max-pages must be at most"),
        (["--repeats", "1000000"], "--repeats must be at most 100"),
    ],
)
def test_bad_scale_flags_exit_2_in_one_line(
    argv: list[str], words: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "scale", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert words in err
