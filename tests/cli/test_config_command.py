"""`hicache config --show`: every key with its value and source; bad input exits 2 naming the
key and its source; the command does not load torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.bootstrap.config_keys import KEYS
from hicache.cli import main


def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.startswith("HICACHE_"):
            monkeypatch.delenv(var)


def test_show_prints_every_key_with_default_file_and_env_sources(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch)
    path = tmp_path / "hicache.yaml"
    path.write_text("plan:\n  page_size: 32\n  device_tokens: 4096\n")
    monkeypatch.setenv("HICACHE_COPY_BACKEND", "torch")
    assert main(["config", "--show", "--file", str(path)]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line}
    assert all(k.name in lines for k in KEYS)
    assert lines["plan.page_size"].split()[1:] == ["32", "file", str(path)]
    assert lines["copy.backend"].split()[1:] == ["torch", "env", "HICACHE_COPY_BACKEND"]
    assert lines["plan.layout"].split()[1:] == ["page_first_direct", "default"]


def test_json_names_the_source_and_variable_of_each_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _clean_env(monkeypatch)
    path = tmp_path / "hicache.toml"
    path.write_text('[storage]\nbackend = "directory"\n')
    monkeypatch.setenv("HICACHE_CONFIG", str(path))
    monkeypatch.setenv("HICACHE_PLAN_TP_SIZE", "2")
    assert main(["config", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["file"] == str(path)
    assert doc["keys"]["storage.backend"] == {
        "value": "directory",
        "source": "file",
        "from": f"file {path}",
        "env": "HICACHE_STORAGE_BACKEND",
    }
    assert doc["keys"]["plan.tp_size"]["value"] == 2
    assert doc["keys"]["plan.tp_size"]["source"] == "env"
    assert doc["keys"]["plan.pp_size"]["source"] == "default"


@pytest.mark.parametrize(
    ("env", "text", "expected"),
    [
        ({"HICACHE_PLAN_TP_SIZE": "0"}, None, "plan.tp_size = 0 from env HICACHE_PLAN_TP_SIZE"),
        ({"HICACHE_PLAN_TPSIZE": "2"}, None, "HICACHE_PLAN_TPSIZE: not a hicache configuration"),
        ({}, "[plan]\nlayot = 'page_first'\n", "'plan.layot' (from file"),
        ({}, "[plan\n", "cannot parse hicache config file"),
    ],
)
def test_bad_configuration_exits_2_with_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    env: dict[str, str],
    text: str | None,
    expected: str,
) -> None:
    _clean_env(monkeypatch)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    args = ["config", "--show"]
    if text is not None:
        path = tmp_path / "bad.toml"
        path.write_text(text)
        args += ["--file", str(path)]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert expected in err


def test_config_does_not_import_torch() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}
    code = (
        "import sys; from hicache.cli import main; rc = main(['config', '--json']); "
        "assert 'torch' not in sys.modules, 'torch loaded'; sys.exit(rc)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
