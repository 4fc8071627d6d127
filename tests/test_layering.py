"""Layering that import-linter cannot see: importing the torch-free layers must not load torch.

import-linter checks static imports only; a lazy or indirect import (a plug-in, a helper that
imports torch inside a function run at import time) shows up only in a fresh interpreter.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"


def modules_after_import(*modules: str) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(modules)!r}:\n"
        "    importlib.import_module(m)\n"
        "print(json.dumps(sorted(sys.modules)))\n"
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
    return set(json.loads(proc.stdout))


def test_the_package_domain_and_engine_load_without_torch() -> None:
    loaded = modules_after_import("hicache", "hicache.domain", "hicache.engine")
    assert "hicache.engine" in loaded
    assert "torch" not in loaded


@pytest.mark.parametrize(
    "module", ["hicache.bootstrap.config", "hicache.cli.plan", "hicache.cli", "hicache.cli.demo"]
)
def test_planning_loads_without_torch(module: str) -> None:
    loaded = modules_after_import(module)
    assert module in loaded
    assert "torch" not in loaded


def test_the_domain_loads_only_stdlib_and_attrs() -> None:
    baseline = modules_after_import()  # what the interpreter loads at start-up (site hooks)
    added = modules_after_import("hicache.domain") - baseline
    third_party = {m.split(".")[0] for m in added} - set(sys.stdlib_module_names)
    assert third_party == {"hicache", "attrs", "attr"}
