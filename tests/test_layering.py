"""Layering that import-linter cannot see: importing the torch-free layers must not load torch.

import-linter checks static imports only; a lazy or indirect import (a plug-in, a helper that
imports torch inside a function run at import time) shows up only in a fresh interpreter.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tests.fresh_imports import modules_after_import

SRC = Path(__file__).resolve().parents[1] / "src"


def test_the_package_domain_engine_and_cache_face_load_without_torch() -> None:
    loaded = modules_after_import("hicache", "hicache.domain", "hicache.engine", "hicache.cache")
    assert {"hicache.engine", "hicache.cache.face", "hicache.cache.sync"} <= loaded
    assert "torch" not in loaded


def test_the_engine_loads_without_the_cache_face_above_it() -> None:
    loaded = modules_after_import("hicache.engine")
    assert "hicache.engine.storage_tier" in loaded
    assert not {m for m in loaded if m == "hicache.cache" or m.startswith("hicache.cache.")}


@pytest.mark.parametrize(
    "module", ["hicache.bootstrap.config", "hicache.cli.plan", "hicache.cli", "hicache.cli.demo"]
)
def test_planning_loads_without_torch(module: str) -> None:
    loaded = modules_after_import(module)
    assert module in loaded
    assert "torch" not in loaded


@pytest.mark.parametrize(
    "module", ["hicache.integrations.vllm.bench", "hicache.integrations.vllm.bench_load_policy"]
)
def test_the_vllm_bench_loads_neither_torch_nor_vllm_until_it_runs(module: str) -> None:
    # bench vllm imports vLLM (and transformers, torch) only inside the functions that run it,
    # so the command line can list it without vLLM installed.
    loaded = modules_after_import(module)
    assert module in loaded
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "vllm", "transformers")}


def test_every_command_line_parser_and_its_bench_fronts_load_without_torch() -> None:
    # Building the parser imports every `hicache bench` front and, through them, the bench
    # modules that are torch-free at import (overlap, cache, scale); the others (copy,
    # storage, vllm_worker) are imported only when their command runs.
    loaded = modules_after_import("hicache.cli", "hicache.bench", call="hicache.cli:build_parser")
    assert {"hicache.cli.bench_overlap", "hicache.bench.overlap", "hicache.bench.scale"} <= loaded
    assert "torch" not in loaded


def test_the_domain_loads_only_stdlib_and_attrs() -> None:
    baseline = modules_after_import()  # what the interpreter loads at start-up (site hooks)
    added = modules_after_import("hicache.domain") - baseline
    third_party = {m.split(".")[0] for m in added} - set(sys.stdlib_module_names)
    assert third_party == {"hicache", "attrs", "attr"}


# ---- no import circles -------------------------------------------------------------------------
def import_cycles(package: str) -> list[list[str]]:
    """The strongly connected sets of >1 module of ``package`` (each an import circle), sorted.

    grimp reads every import statement, including those under ``if TYPE_CHECKING:`` and inside
    functions, so a circle hidden from the interpreter at start-up is still a circle here.
    """
    graph = grimp.build_graph(package, cache_dir=None)
    edges = {
        m: sorted(graph.find_modules_directly_imported_by(m) & graph.modules)
        for m in sorted(graph.modules)
    }
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in edges:
        if root in index:
            continue
        # Tarjan's algorithm, iterative: (module, position in its edge list)
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                part: list[str] = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    part.append(w)
                    if w == v:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return sorted(found)


def test_no_module_of_hicache_imports_itself_through_others() -> None:
    assert import_cycles("hicache") == []


def test_a_circle_through_type_checking_and_lazy_imports_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "circled"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    # face -> helper at import time; helper -> face only for type checking (the shape the
    # cache face had); low -> mid -> top -> low, the last edge inside a function.
    (pkg / "face.py").write_text("from circled.helper import run\n")
    (pkg / "helper.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from circled.face import X\n"
        "def run() -> None: ...\n"
    )
    (pkg / "low.py").write_text("import circled.mid\n")
    (pkg / "mid.py").write_text("import circled.top\n")
    (pkg / "top.py").write_text("def f() -> None:\n    import circled.low\n")
    (pkg / "alone.py").write_text("import circled.face\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("circled") == [
        ["circled.face", "circled.helper"],
        ["circled.low", "circled.mid", "circled.top"],
    ]


def test_model_spec_reads_a_hf_config_when_only_the_models_module_is_imported() -> None:
    # models.py no longer imports readers.py (readers installs its reader on import through
    # hicache.domain's __init__): a fresh interpreter importing only models must still read.
    code = (
        "from hicache.domain.models import ModelSpec\n"
        "spec = ModelSpec.from_hf_config({'model_type': 'llama', 'num_hidden_layers': 2,"
        " 'num_attention_heads': 4, 'num_key_value_heads': 2, 'hidden_size': 64,"
        " 'torch_dtype': 'bfloat16'})\n"
        "print(spec.num_layers)\n"
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
    assert proc.stdout.strip() == "2"
