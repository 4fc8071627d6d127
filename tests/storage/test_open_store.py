"""open_store: built-in stores, "dynamic" plug-ins (only what the config names), entry points."""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from hicache.adapters.storage import DirectoryStore
from hicache.bootstrap import storage as boot
from hicache.bootstrap.storage import (
    open_named_store,
    open_store,
    register_store_factory,
    store_names,
)
from hicache.domain import ConfigError, StorageSettings, StoreError, resolve_host_memory
from hicache.domain.storage import Store, StoreStatus
from hicache.domain.store_plugins import STORE_ENTRY_POINT_GROUP, StorePlugin
from tests.storage.conftest import empty, key, page
from tests.storage.fakes import FakeStore

PLUGIN = """
from tests.storage.fakes import FakeStore

class PluginStore(FakeStore):
    def __init__(self, config):
        super().__init__(name="plugin")
        self.config = config

class Broken:
    def __init__(self, config):
        raise RuntimeError("cannot reach the server at " + config.get("host", "?"))

class NotAStore:
    def __init__(self, config):
        pass

class Exits:
    def __init__(self, config):
        raise SystemExit(4)

not_a_class = 3
"""


@pytest.fixture
def plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package ``hc_plugins`` with the module ``stores`` and a sibling that must not load."""
    pkg = tmp_path / "hc_plugins"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "stores.py").write_text(textwrap.dedent(PLUGIN))
    (pkg / "other.py").write_text("raise RuntimeError('other was imported')\n")
    (pkg / "raises.py").write_text("raise RuntimeError('boom at import')\n")
    (pkg / "exits.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "hc_plugins"
    for name in [m for m in sys.modules if m.startswith("hc_plugins")]:
        del sys.modules[name]


def dynamic(**extra: object) -> StorageSettings:
    return StorageSettings("dynamic", extra)


def test_directory_opens_at_the_configured_root(tmp_path: Path) -> None:
    store = open_store(StorageSettings("directory", {"root": str(tmp_path / "s")}))
    assert isinstance(store, DirectoryStore)
    assert store.root == tmp_path / "s"
    assert store.put([key(1)], [page(64)]) == [StoreStatus.OK]
    store.close()


def test_directory_without_a_root_uses_a_temporary_one() -> None:
    store = open_store(StorageSettings("directory"))
    assert isinstance(store, DirectoryStore)
    root = store.root
    store.close()
    assert not root.exists()


def test_directory_resolves_to_anonymous_host_memory() -> None:
    assert resolve_host_memory(StorageSettings("directory")).kind.name == "anonymous"


def test_dynamic_loads_exactly_the_named_class(plugins: str) -> None:
    store = open_store(
        dynamic(backend_name="mine", module_path=f"{plugins}.stores", class_name="PluginStore")
    )
    assert isinstance(store, Store)
    assert store.name == "plugin"
    assert store.config["module_path"] == f"{plugins}.stores"  # type: ignore[attr-defined]
    assert f"{plugins}.stores" in sys.modules
    assert f"{plugins}.other" not in sys.modules


def test_dynamic_without_an_allocator_takes_anonymous_host_memory(plugins: str) -> None:
    settings = dynamic(module_path=f"{plugins}.stores", class_name="PluginStore")
    assert resolve_host_memory(settings).kind.name == "anonymous"
    assert open_store(settings).name == "plugin"


def test_the_allocator_still_goes_through_the_one_resolution_point(plugins: str) -> None:
    settings = dynamic(allocator="shm", module_path=f"{plugins}.stores", class_name="PluginStore")
    assert resolve_host_memory(settings).kind.name == "shm"
    store = open_store(settings)
    assert store.config["allocator"] == "shm"  # type: ignore[attr-defined]  # passed, not read


@pytest.mark.parametrize(
    ("extra", "error", "match"),
    [
        ({"module_path": "hc_plugins.nope", "class_name": "X"}, ConfigError, "'hc_plugins.nope'"),
        ({"module_path": "hc_plugins.stores", "class_name": "Gone"}, ConfigError, "'Gone'"),
        ({"module_path": "hc_plugins.stores", "class_name": "not_a_class"}, ConfigError, "int"),
        ({"module_path": "hc_plugins.stores", "class_name": "NotAStore"}, ConfigError, "no Store"),
        (
            {"module_path": "hc_plugins.stores", "class_name": "Broken", "host": "h1"},
            StoreError,
            "h1",
        ),
        ({"module_path": "hc_plugins.stores"}, ConfigError, "no 'class_name'"),
        ({"module_path": "../evil", "class_name": "X"}, ConfigError, "'../evil'"),
        # The plug-in's own code failing at import, or ending the process, is its failure:
        (
            {"module_path": "hc_plugins.raises", "class_name": "X"},
            ConfigError,
            "RuntimeError: boom at import",
        ),
        ({"module_path": "hc_plugins.exits", "class_name": "X"}, ConfigError, "SystemExit: 3"),
        ({"module_path": "hc_plugins.stores", "class_name": "Exits"}, StoreError, "SystemExit: 4"),
        ({"module_path": "hc_plugins\x00x", "class_name": "X"}, ConfigError, "module_path"),
        ({"allocator": "shm"}, ConfigError, "names no store"),
    ],
)
def test_dynamic_errors_are_typed_and_name_the_value(
    plugins: str, extra: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        open_store(StorageSettings("dynamic", extra))
    assert f"{plugins}.other" not in sys.modules


class FakeEntryPoints:
    """Entry points for the test: named ones load a target; a loaded "trap" fails the test."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, **targets: str) -> None:
        self.eps = [
            importlib.metadata.EntryPoint(name=n, value=v, group=STORE_ENTRY_POINT_GROUP)
            for n, v in targets.items()
        ]
        monkeypatch.setattr(boot, "entry_points", lambda: list(self.eps))


def test_an_entry_point_store_opens_by_name_and_nothing_else_loads(
    plugins: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeEntryPoints(
        monkeypatch, mine=f"{plugins}.stores:PluginStore", trap=f"{plugins}.other:Nothing"
    )
    assert store_names() == ["directory", "mooncake", "mine", "trap"]
    store = open_named_store("mine", {"x": 1})
    assert store.name == "plugin"
    assert store.config == {"x": 1}  # type: ignore[attr-defined]
    assert f"{plugins}.other" not in sys.modules
    via_dynamic = open_store(dynamic(backend_name="mine"))
    assert via_dynamic.name == "plugin"


def test_a_known_backend_without_a_factory_may_come_from_an_entry_point(
    plugins: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ConfigError, match=r"no store named 'hf3fs'.*directory"):
        open_store(StorageSettings("hf3fs"))
    FakeEntryPoints(monkeypatch, hf3fs=f"{plugins}.stores:PluginStore")
    assert open_store(StorageSettings("hf3fs")).name == "plugin"


def test_a_broken_entry_point_is_a_config_error_naming_it(
    plugins: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    FakeEntryPoints(monkeypatch, trap=f"{plugins}.other:Nothing")
    with pytest.raises(ConfigError, match=r"entry point 'trap'.*other was imported"):
        open_named_store("trap")


def test_two_entry_points_of_one_name_are_ambiguous(
    plugins: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = FakeEntryPoints(monkeypatch)
    fake.eps = [
        importlib.metadata.EntryPoint(name="x", value=v, group=STORE_ENTRY_POINT_GROUP)
        for v in (f"{plugins}.stores:PluginStore", f"{plugins}.stores:Broken")
    ]
    with pytest.raises(ConfigError, match=r"2 installed entry points.*named 'x'"):
        open_named_store("x")


def test_the_composition_root_can_register_a_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(boot, "_factories", dict(boot._factories))
    register_store_factory("mooncake", lambda config: FakeStore(name="mooncake"))
    assert "mooncake" in store_names()
    assert open_store(StorageSettings("mooncake")).name == "mooncake"
    with pytest.raises(ConfigError, match="'dynamic'"):
        register_store_factory("dynamic", lambda config: FakeStore())


def test_no_backend_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="no storage backend is configured"):
        open_store(StorageSettings())


def test_the_store_plugin_parser_reads_the_reference_engines_keys() -> None:
    plugin = StorePlugin.from_extra_config(
        {"backend_name": "b", "module_path": "a.b_c", "class_name": "C"}
    )
    assert (plugin.backend_name, plugin.module_path, plugin.class_name) == ("b", "a.b_c", "C")
    assert plugin.label == "a.b_c.C"
    with pytest.raises(ConfigError, match="'class_name' 'C-1'"):
        StorePlugin.from_extra_config({"module_path": "a", "class_name": "C-1"})
    with pytest.raises(ConfigError, match="'backend_name' 3"):
        StorePlugin.from_extra_config({"backend_name": 3})


def test_a_store_returned_by_a_plugin_works_end_to_end(plugins: str) -> None:
    store = open_store(dynamic(module_path=f"{plugins}.stores", class_name="PluginStore"))
    store.put([key(1)], [page(64, 1)])
    dst = empty(64)
    assert store.get([key(1)], [dst]) == [StoreStatus.OK]
    assert bytes(dst[0]) == bytes(page(64, 1)[0])
