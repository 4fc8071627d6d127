"""What a fresh interpreter loads: modules_after_import(*modules, call=None) imports the modules
(and calls "module:function") in a new Python with only src/ on its path and returns the names in
sys.modules afterwards (the torch-free layering and public-API tests read it)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def modules_after_import(*modules: str, call: str | None = None) -> set[str]:
    """The modules loaded after importing ``modules`` (and calling ``call``, "module:function")."""
    code = (
        "import importlib, json, sys\n"
        f"for m in {list(modules)!r}:\n"
        "    importlib.import_module(m)\n"
    )
    if call is not None:
        module, function = call.split(":")
        code += f"getattr(importlib.import_module({module!r}), {function!r})()\n"
    code += "print(json.dumps(sorted(sys.modules)))\n"
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
