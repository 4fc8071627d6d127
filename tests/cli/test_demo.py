"""`hicache demo`: a tiny run's JSON document and summary (storage none, directory), --plot's
PNG, exit 1 when a cached run differs, and bad flags as one-line errors."""

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
    assert main(["demo", "--json", "--storage", "none", *TINY]) == 0
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
    assert 0.0 <= doc["exposed_fraction"] <= 1.0
    assert doc["storage"] == "none"
    assert "turn 1" in err


def test_the_default_directory_store_gives_a_storage_hit_and_removes_its_folder(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import tempfile

    made: list[str] = []
    real = tempfile.TemporaryDirectory

    def tracking(*args: object, **kw: object) -> tempfile.TemporaryDirectory[str]:
        t = real(*args, **kw)  # type: ignore[call-overload]
        made.append(t.name)
        return t  # type: ignore[no-any-return]

    monkeypatch.setattr(tempfile, "TemporaryDirectory", tracking)
    assert main(["demo", "--json", *TINY]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["storage"] == "directory"
    assert doc["ttft_ms"]["storage_hit"] > 0
    assert doc["tokens_identical"] is True
    assert doc["max_abs_diff"] <= 1e-5
    assert all(r["ttft_ms"]["storage_hit"] is not None for r in doc["runs"])
    assert 0.0 <= doc["exposed_fraction"] <= 1.0
    demo_dirs = [d for d in made if "hicache-demo-" in d]
    assert len(demo_dirs) == 1
    assert not Path(demo_dirs[0]).exists()


def test_plot_writes_a_png_timeline(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "timeline.png"
    assert main(["demo", "--storage", "none", "--plot", str(out), *TINY]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert data[12:16] == b"IHDR"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 600
    assert height >= 300
    assert "timeline written to" in capsys.readouterr().err


def test_summary_table_by_default(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--storage", "none", *TINY]) == 0
    out, _ = capsys.readouterr()
    assert "recompute ms" in out
    assert "storage hit ms" in out
    assert "branch" in out
    assert "greedy tokens identical" in out
    assert "storage hit n/a (--storage none)" in out
    assert "exposed fraction: share of the copy time the model sat waiting" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
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


def test_plot_without_matplotlib_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    real = importlib.util.find_spec

    def without_matplotlib(name: str, *args: object) -> object:
        return None if name == "matplotlib" else real(name, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(importlib.util, "find_spec", without_matplotlib)
    assert main(["demo", "--plot", "out.png", *TINY]) == 2
    _, err = capsys.readouterr()
    assert "needs matplotlib" in err
    assert len(err.strip().splitlines()) == 1


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


def test_a_restore_the_model_ignores_exits_1_with_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hicache.demo.framework import DemoServer, Sequence

    real = DemoServer.prefill

    def forgetful(self: DemoServer, seq: Sequence, *args: object, **kw: object) -> object:
        seq.state_from = None  # a broken framework: the restored state checkpoint is not read
        return real(self, seq, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(DemoServer, "prefill", forgetful)
    assert main(["demo", "--storage", "none", *TINY]) == 1
    out, err = capsys.readouterr()
    assert "DIFFER" in out
    assert len(err.strip().splitlines()[-1:]) == 1
    assert (
        err.strip()
        .splitlines()[-1]
        .startswith("hicache: error: a cached run differed from its recompute")
    )


def test_a_cached_run_that_differs_exits_1(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import hicache.demo.workload as workload

    async def differing(
        settings: object, *, progress: object, metrics: object = None
    ) -> dict[str, object]:
        run = {
            "name": "turn 1",
            "prompt_tokens": 200,
            "hit_tokens": 128,
            "ttft_ms": {"recompute": 10.0, "host_hit": 2.0, "storage_hit": None},
            "max_abs_diff": 0.25,
            "tokens_identical": False,
        }
        return {
            "device": "cpu",
            "model": "m",
            "turns": 1,
            "storage": "none",
            "ttft_ms": {"recompute": 10.0, "host_hit": 2.0, "storage_hit": None},
            "hit_tokens": 128,
            "served_tokens": {"device": 0, "host": 128, "storage": 0},
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


def test_the_table_footer_is_the_one_docs_demo_md_shows() -> None:
    from hicache.cli.demo import FOOTER

    doc = (SRC.parent / "docs" / "demo.md").read_text(encoding="utf-8")
    assert "\n".join(FOOTER) in doc
    assert "exposed fraction" in FOOTER[-3] + FOOTER[-2]
