"""`hicache demo`: a tiny run's JSON document and summary, and bad flags as one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.cli.demo import KEYS

SRC = Path(__file__).resolve().parents[2] / "src"
TINY = ["--prefix-tokens", "128", "--turns", "1"]


def test_json_document_reports_both_runs_identical(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--json", *TINY]) == 0
    out, err = capsys.readouterr()
    lines = out.strip().splitlines()
    assert len(lines) == 1  # one JSON document, progress went to stderr
    doc = json.loads(lines[0])
    assert tuple(doc)[: len(KEYS)] == KEYS
    assert doc["device"] == "cpu"
    assert doc["turns"] == 1
    assert set(doc["ttft_ms"]) == {"recompute", "host_hit", "storage_hit"}
    assert doc["ttft_ms"]["storage_hit"] is None
    assert doc["ttft_ms"]["recompute"] > 0
    assert doc["ttft_ms"]["host_hit"] > 0
    assert doc["max_abs_diff"] <= 1e-5
    assert doc["tokens_identical"] is True
    # turn 1 and the branch both hit the 128-token system prompt
    assert [r["hit_tokens"] for r in doc["runs"]] == [128, 128]
    assert doc["hit_tokens"] == 256
    assert "turn 1" in err


def test_summary_table_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", *TINY]) == 0
    out, _ = capsys.readouterr()
    assert "recompute ms" in out
    assert "branch" in out
    assert "greedy tokens identical" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--storage", "directory"], "--storage directory: the storage tier is not wired"),
        (["--storage", "mooncake"], "--storage mooncake: the storage tier is not wired"),
        (["--storage", "nfs"], "--storage 'nfs': expected one of none, directory, mooncake"),
        (["--turns", "0"], "--turns must be a positive integer, got 0"),
        (["--prefix-tokens", "100"], "--prefix-tokens 100 must be a whole number of pages"),
        (["--turns", "x"], "argument --turns: invalid int value"),
        (["--device", "tpu", *TINY], "unknown device 'tpu': expected cpu, cuda[:N] or rocm[:N]"),
    ],
)
def test_bad_flags_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    try:
        status = main(["demo", *argv])
    except SystemExit as e:  # argparse's own errors
        status = int(e.code or 0)
    _, err = capsys.readouterr()
    assert status == 2
    assert len(err.strip().splitlines()) == 1
    assert message in err


def test_plot_without_matplotlib_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed: the plot works")
    assert main(["demo", "--plot", "out.png", *TINY]) == 2
    _, err = capsys.readouterr()
    assert "needs matplotlib" in err


def test_the_command_line_loads_without_torch_until_the_demo_runs() -> None:
    code = (
        "import sys\n"
        "from hicache.cli import build_parser\n"
        "build_parser().parse_args(['demo', '--turns', '2'])\n"
        "print('torch' in sys.modules)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin"},
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"


def test_a_cached_run_that_differs_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hicache.demo.workload as workload

    async def differing(settings: object, *, progress: object) -> dict[str, object]:
        run = {
            "name": "turn 1",
            "prompt_tokens": 200,
            "hit_tokens": 128,
            "ttft_ms": {"recompute": 10.0, "host_hit": 2.0},
            "max_abs_diff": 0.25,
            "tokens_identical": False,
        }
        return {
            "device": "cpu",
            "model": "m",
            "turns": 1,
            "ttft_ms": {"recompute": 10.0, "host_hit": 2.0, "storage_hit": None},
            "hit_tokens": 128,
            "max_abs_diff": 0.25,
            "tokens_identical": False,
            "exposed_fraction": 0.0,
            "runs": [run],
            "_timelines": [],
        }

    monkeypatch.setattr(workload, "run_demo", differing)
    assert main(["demo", *TINY]) == 1
    out, err = capsys.readouterr()
    assert "DIFFER" in out
    assert err.strip() == (
        "hicache: error: a cached run differed from its recompute "
        "(max |logit diff| 0.25, greedy tokens different)"
    )
