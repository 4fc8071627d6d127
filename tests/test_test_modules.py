"""No test module imports another test module: shared helpers, fakes and constants live in
support modules (tests/**/helpers.py, fakes.py, ...), so that running, moving or deleting one
test module never runs or breaks another's tests.

A test module is a file named test_*.py under tests/. The check parses every one with ``ast``
and reads its imports (module level, inside functions, and ``from tests.x import test_y``);
imports written in strings for a child process are not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

KNOWN: frozenset[str] = frozenset()  # exceptions: none (the list may only shrink)


def _is_test_module(dotted: str) -> bool:
    return dotted.startswith("tests.") and dotted.rsplit(".", 1)[-1].startswith("test_")


def imported_test_modules(path: Path, root: Path = ROOT) -> set[str]:
    """The test modules (dotted names) that the file at ``path`` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if _is_test_module(a.name))
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                package = path.relative_to(root).parent.parts
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{node.module}" if node.module else base
            else:
                module = node.module or ""
            if _is_test_module(module):
                found.add(module)
            found.update(
                f"{module}.{a.name}" for a in node.names if _is_test_module(f"{module}.{a.name}")
            )
    return found


def offenders(tests: Path = TESTS, root: Path = ROOT) -> dict[str, set[str]]:
    """Each test module under ``tests`` that imports a test module, with what it imports."""
    out: dict[str, set[str]] = {}
    for path in sorted(tests.rglob("test_*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        if imported := imported_test_modules(path, root):
            out[name] = imported
    return out


def test_no_test_module_imports_another() -> None:
    found = offenders()
    unexpected = {m: sorted(i) for m, i in found.items() if m not in KNOWN}
    assert not unexpected, (
        f"test modules import other test modules: {unexpected}; move what they share into a "
        "support module beside them (helpers.py, fakes.py, ...)"
    )
    fixed = KNOWN - set(found)
    assert not fixed, f"{sorted(fixed)} no longer import a test module: take them off KNOWN"


def test_a_test_module_that_imports_another_is_named(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "cache").mkdir(parents=True)
    (tests / "cache" / "helpers.py").write_text("from tests.cache.test_a import X\n")
    (tests / "cache" / "test_a.py").write_text("X = 1\nfrom tests.cache.helpers import Y\n")
    (tests / "cache" / "test_b.py").write_text(
        "def test_x():\n    from tests.cache.test_a import X\n"
    )
    (tests / "cache" / "test_c.py").write_text("from tests.cache import test_a\n")
    (tests / "cache" / "test_d.py").write_text("from .test_a import X\nimport tests.cache.test_b\n")
    (tests / "test_e.py").write_text("CHILD = 'from tests.cache.test_a import X'\n")
    assert offenders(tests, tmp_path) == {
        "tests.cache.test_b": {"tests.cache.test_a"},
        "tests.cache.test_c": {"tests.cache.test_a"},
        "tests.cache.test_d": {"tests.cache.test_a", "tests.cache.test_b"},
    }
