"""What a "dynamic" storage backend's extra config names, parsed without importing anything.

- StorePlugin: the module and class (or the entry point name) a "dynamic" extra config names.
- names_store_plugin: whether an extra config names a store plug-in at all.
- STORE_ENTRY_POINT_GROUP: the entry-point group third-party stores register under.

The keys are the reference engine's (SGLang ``StorageBackendFactory._create_dynamic_backend``:
"backend_name", "module_path", "class_name"). "module_path" and "class_name" name exactly the
class to load; "backend_name" alone names an entry point of the group ``hicache.stores``.
Loading happens in hicache.bootstrap.storage; this module only checks the text.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.domain.errors import ConfigError

STORE_ENTRY_POINT_GROUP = "hicache.stores"

_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


def names_store_plugin(extra: Mapping[str, Any]) -> bool:
    """Whether ``extra`` names a store plug-in (module_path and class_name, or backend_name)."""
    return ("module_path" in extra and "class_name" in extra) or "backend_name" in extra


def _text(extra: Mapping[str, Any], key: str, pattern: re.Pattern[str], expected: str) -> str:
    value = extra[key]
    if not isinstance(value, str) or not pattern.match(value):
        raise ConfigError(f"extra config {key!r} {value!r}: expected {expected}")
    return value


@attrs.frozen
class StorePlugin:
    """A store named by a "dynamic" extra config: a module and class, or an entry point name."""

    backend_name: str | None
    module_path: str | None
    class_name: str | None

    @property
    def label(self) -> str:
        if self.module_path is not None:
            return f"{self.module_path}.{self.class_name}"
        return f"entry point {self.backend_name!r} of group {STORE_ENTRY_POINT_GROUP!r}"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any]) -> StorePlugin:
        """Parse the plug-in keys of a "dynamic" extra config; ConfigError names what is wrong."""
        has_module, has_class = "module_path" in extra, "class_name" in extra
        if has_module != has_class:
            missing = "class_name" if has_module else "module_path"
            raise ConfigError(
                f"storage backend 'dynamic': the extra config gives "
                f"{'module_path' if has_module else 'class_name'} but no {missing!r}; a store "
                "plug-in needs both"
            )
        if not names_store_plugin(extra):
            raise ConfigError(
                "storage backend 'dynamic' names no store: give 'module_path' and 'class_name' "
                f"(a class to load) or 'backend_name' (an entry point of group "
                f"{STORE_ENTRY_POINT_GROUP!r}) in its extra config; got keys {sorted(extra)}"
            )
        name = (
            _text(extra, "backend_name", _NAME, "1-64 letters, digits, '_', '.' or '-'")
            if "backend_name" in extra
            else None
        )
        if not has_module:
            return cls(backend_name=name, module_path=None, class_name=None)
        module = _text(extra, "module_path", _MODULE, "a dotted Python module path")
        klass = _text(extra, "class_name", _IDENT, "a Python identifier")
        return cls(backend_name=name, module_path=module, class_name=klass)
