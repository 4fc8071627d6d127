"""The flat public surface: ``from hicache import ...`` gives everything a serving loop needs,
the same objects as the deep paths, without loading the engine or torch until a name is used;
and the serving-loop examples in README.md and docs/ import from ``hicache`` alone."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

import hicache
from tests.fresh_imports import modules_after_import

ROOT = Path(__file__).resolve().parents[1]

# The pages that show how to embed hicache in a serving loop. The layer reference pages
# (domain.md, cache.md, copy.md, pools.md, host-memory.md, storage.md) document their own
# layer's modules on purpose and keep their deep imports.
SERVING_PAGES = (
    "README.md",
    "docs/integration.md",
    "docs/cache-face.md",
    "docs/engine.md",
    "docs/sync.md",
)


def test_every_public_name_resolves_to_the_object_of_its_deep_path() -> None:
    for name in hicache.__all__:
        value = getattr(hicache, name)
        module = hicache._LAZY.get(name)
        if module is not None:
            assert value is getattr(importlib.import_module(module), name), name
    assert set(hicache._LAZY) <= set(hicache.__all__)
    defined_in_hicache = {
        n for n, v in vars(hicache).items() if getattr(v, "__module__", "").startswith("hicache.")
    }
    assert {n for n in defined_in_hicache if not n.startswith("_")} <= set(hicache.__all__)


def test_a_serving_loop_needs_no_other_module() -> None:
    needed = {
        "load_model_spec", "PlanSettings", "plan_stack", "PoolName", "Tier", "WriteSettings",
        "CheckpointPolicy", "open_cache", "CacheSettings", "HiCache", "open_runtime",
        "open_sync", "open_sync_cache", "DirectoryStore", "DirectorySettings", "CpuFence",
        "StorageTierSettings", "HiCacheError", "ConfigError", "TransferError", "OutOfSlotsError",
    }  # fmt: skip
    assert needed <= set(hicache.__all__)
    assert needed <= set(dir(hicache))


def test_an_unknown_name_is_an_attribute_error_naming_it() -> None:
    with pytest.raises(AttributeError, match="'open_cach'"):
        hicache.open_cach  # type: ignore[attr-defined]  # noqa: B018
    with pytest.raises(ImportError):
        exec("from hicache import NoSuchThing", {})


def test_importing_hicache_loads_neither_the_engine_nor_torch() -> None:
    loaded = modules_after_import("hicache")
    assert "hicache.engine" not in loaded
    assert "hicache.cache" not in loaded
    assert "hicache.bootstrap" not in loaded
    assert "anyio" not in loaded
    assert "torch" not in loaded


def test_the_first_use_of_an_engine_name_loads_the_engine_without_torch() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, hicache; hicache.HiCache; hicache.open_sync; "
            "print('hicache.cache' in sys.modules, 'hicache.engine' in sys.modules,"
            " 'torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        timeout=120,
        check=True,
    )
    assert proc.stdout.split() == ["True", "True", "False"]


def _hicache_imports(code: str) -> list[str]:
    """The modules of hicache that ``code`` imports from (``import x`` and ``from x import``).
    Read line by line: some examples are signatures or fragments that do not parse."""
    found: list[str] = []
    for line in code.splitlines():
        m = re.match(r"\s*from\s+(hicache[\w.]*)\s+import\b", line)
        if m:
            found.append(m[1])
        m = re.match(r"\s*import\s+([\w.]+(?:\s*,\s*[\w.]+)*)", line)
        if m:
            found += [n.strip() for n in m[1].split(",") if n.strip().startswith("hicache")]
    return found


@pytest.mark.parametrize("page", SERVING_PAGES)
def test_the_serving_examples_import_from_hicache_alone(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert blocks, f"{page} has no python example"
    deep = {m for code in blocks for m in _hicache_imports(code) if m != "hicache"}
    assert deep == set(), f"{page} imports from {sorted(deep)}: use `from hicache import ...`"


def test_the_import_check_catches_a_deep_import() -> None:
    code = (
        "import anyio\nfrom hicache.cache.values import CacheSettings\nimport hicache\n"
        "    from hicache.bootstrap import (\n        open_cache,\n    )\n...fragment...\n"
        "import os, hicache.domain\nfrom hicache import open_cache\n"
    )
    assert _hicache_imports(code) == [
        "hicache.cache.values",
        "hicache",
        "hicache.bootstrap",
        "hicache.domain",
        "hicache",
    ]
