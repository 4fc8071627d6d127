"""`hicache bench vllm`: bad options are refused before vLLM is imported (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hicache.cli import main


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--prompt-tokens", "0"], "--prompt-tokens"),
        (["--prompt-tokens", "10"], "--prompt-tokens"),
        (["--repeats", "0"], "--repeats"),
        (["--tokens", "-1"], "--tokens"),
        (["--host-gib", "0"], "--host-gib"),
        (["--model-kind", "mamba"], "--model-kind"),
        (["--slow-store", "--read-mib-s", "0"], "--read-mib-s"),
        (["--slow-store", "--read-mib-s", "nan"], "--read-mib-s"),
        (["--device", "tpu"], "--device"),
        (["--device", "cuda", "--slow-store"], "--slow-store"),
    ],
)
def test_bad_option_exits_2_with_one_line_naming_it(
    capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    assert main(["bench", "vllm", *args]) == 2
    _, err = capsys.readouterr()
    assert err.count("\n") == 1
    assert named in err


def test_model_folder_without_config_is_refused(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["bench", "vllm", "--model", str(tmp_path)]) == 2
    assert "--model" in capsys.readouterr().err


def test_the_cli_does_not_import_vllm() -> None:
    code = (
        "import sys; from hicache.cli import main; "
        "main(['bench', 'vllm', '--repeats', '0']); print('vllm' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "False"


@pytest.mark.vllm
def test_a_device_the_installed_vllm_does_not_run_on_exits_2_naming_its_platform() -> None:
    """vLLM takes its platform from the build installed: asking this CPU build for cuda is
    refused with one line before any model is made (the subprocess keeps vLLM out of the test
    process)."""
    pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        pytest.skip("this vLLM is a CUDA build")
    out = subprocess.run(
        [sys.executable, "-m", "hicache", "bench", "vllm", "--device", "cuda", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2
    assert out.stdout == ""
    last = out.stderr.strip().splitlines()[-1]
    assert "--device cuda" in last
    assert "runs on 'cpu'" in last
