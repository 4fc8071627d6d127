"""`hicache bench copy`: the JSON document's shape (never its timings), the table, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hicache.cli import main

TINY = ["--tokens", "32", "--layers", "2", "--page-sizes", "1,16", "--repeats", "1"]
RESULT_KEYS = {
    "layout",
    "page_size",
    "op",
    "method",
    "backend",
    "gbps",
    "limit_gbps",
    "ratio_to_baseline",
    "ratio_to_limit",
}


def test_json_is_one_document_with_every_measurement(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["bench", "copy", "--json", *TINY, "--layouts", "page_first,page_first_direct"])
    assert status == 0
    out = capsys.readouterr().out
    doc = json.loads(out)  # exactly one document
    assert set(doc) == {"device", "baseline_gbps", "limit_gbps", "limit_gbps_by_op", "results"}
    assert doc["device"] == "cpu"
    assert doc["baseline_gbps"] > 0
    assert doc["limit_gbps"] > 0
    assert set(doc["limit_gbps_by_op"]) == {"backup", "load_layer"}
    results = doc["results"]
    assert len(results) == 2 * 2 * 2 * 2  # layouts x page sizes x ops x methods
    seen = set()
    for r in results:
        assert set(r) == RESULT_KEYS
        assert r["limit_gbps"] > 0
        assert r["ratio_to_limit"] == pytest.approx(r["gbps"] / r["limit_gbps"], abs=2e-3)
        assert r["op"] in ("backup", "load_layer")
        assert r["method"] in ("hicache", "naive")
        assert r["backend"] == ("naive" if r["method"] == "naive" else "memcpy")
        assert r["gbps"] > 0
        assert r["ratio_to_baseline"] > 0
        seen.add((r["layout"], r["page_size"], r["op"], r["method"]))
    assert len(seen) == len(results)
    assert {r["layout"] for r in results} == {"page_first", "page_first_direct"}
    assert {r["page_size"] for r in results} == {1, 16}


def test_backend_override_and_shm_host_memory(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "copy", "--json", *TINY, "--layouts", "layer_first", "--backend", "torch"]
    assert main([*args, "--host-memory", "shm"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert {r["backend"] for r in doc["results"] if r["method"] == "hicache"} == {"torch"}


def test_table_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "copy", *TINY, "--layouts", "page_head", "--huge-pages"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("device cpu")
    assert "x baseline" in lines[2]
    assert len(lines) == 3 + 2 * 2 * 2


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--page-sizes", "16,x"], "--page-sizes expects comma-separated integers"),
        (["--page-sizes", "48"], "not a whole number of pages of 48"),
        (["--layouts", "diagonal"], "unknown layout 'diagonal'"),
        (["--backend", "warp"], "unknown copy backend 'warp'"),
        (["--repeats", "0"], "repeats must be a positive integer"),
        (["--host-memory", "shm", "--huge-pages"], "huge pages apply to anonymous host memory"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "copy", "--tokens", "32", "--page-sizes", "16", *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_the_command_module_does_not_import_torch() -> None:
    code = "import sys, hicache.cli.bench_copy; print('torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "False"
