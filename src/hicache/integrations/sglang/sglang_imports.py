"""Importing SGLang's host-pool modules where torchvision is absent (a CPU test machine).

SGLang imports ``torchvision`` at module level on paths that its host pools pull in
(``sglang.srt.mem_cache.memory_pool`` -> ``sglang.srt.configs`` -> a vision config), although no
host pool or storage call uses it. PyPI's torchvision is a CUDA build that does not import beside
a CPU torch, so a CPU machine has none. ``allow_sglang_without_torchvision()`` registers, ONLY when
no ``torchvision`` can be found, a stand-in module whose attributes are placeholders: importing
and naming them works, calling one raises ``ImportError`` saying torchvision is absent. Where a
real torchvision is installed this does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

STAND_IN = "hicache torchvision stand-in"


class _Placeholder:
    """Any attribute of the stand-in: nameable, indexable, subclassable; calling it raises."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> _Placeholder:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __getitem__(self, _item: object) -> _Placeholder:
        return self

    def __mro_entries__(self, _bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)

    def __call__(self, *_args: object, **_kwargs: object) -> Any:
        raise ImportError(f"{self._name}: torchvision is not installed ({STAND_IN})")

    def __repr__(self) -> str:
        return f"<{STAND_IN}: {self._name}>"


class _StandInModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != "torchvision" and not fullname.startswith("torchvision."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandInModule(spec.name, STAND_IN)
        module.__path__ = []
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__version__ = "0.0.0+standin"  # type: ignore[attr-defined]


_FINDER = _Finder()


def withdraw_stand_in() -> None:
    """Unregister the stand-in and forget its modules: a later ``import torchvision`` fails as
    it would have (modules imported meanwhile keep the placeholders they named). Tests call it
    once SGLang's modules are imported, so that other code in the same process is unaffected."""
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
        if isinstance(sys.modules[name], _StandInModule):
            del sys.modules[name]


def allow_sglang_without_torchvision() -> bool:
    """Register the stand-in when no torchvision can be found; True when it is in use."""
    if _FINDER in sys.meta_path:
        return True
    if "torchvision" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return False
    sys.meta_path.append(_FINDER)
    return True
