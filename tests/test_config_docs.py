"""docs/configuration.md names every setting with the default the code really has.

Each table row is ``| `name` | default | ...``; a field added to the code without a row, or a
default changed in one place only, fails here.
"""

from __future__ import annotations

import enum
import re
from pathlib import Path

import attrs
import pytest

from hicache import PlanSettings, StorageSettings
from hicache.domain.sizing import RatioSizing

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def _section(title: str) -> str:
    text = DOC.read_text(encoding="utf-8")
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end > 0 else None]


def _rows(section: str) -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([a-z_]+)`", cells[0]) if cells else None
        if m:
            rows[m.group(1)] = cells[1:]
    return rows


def _shown(value: object) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, RatioSizing):
        return f"RatioSizing(ratio={value.ratio})"
    if isinstance(value, StorageSettings):
        return "StorageSettings()"
    if isinstance(value, dict):
        return "{}"
    return str(value)


def _default(field: attrs.Attribute[object]) -> object:
    d = field.default
    return d.factory() if isinstance(d, attrs.Factory) else d  # type: ignore[misc]


def test_every_plan_setting_has_a_row_with_its_real_default() -> None:
    rows = _rows(_section("`PlanSettings`"))
    for field in attrs.fields(PlanSettings):
        assert field.name in rows, f"PlanSettings.{field.name} is missing from configuration.md"
        shown = _shown(_default(field))
        assert shown in rows[field.name][0], (field.name, shown, rows[field.name][0])


def test_the_default_row_check_catches_a_wrong_default() -> None:
    rows = _rows("| `page_size` | 32 | `--page-size` | tokens per page |")
    field = attrs.fields_dict(PlanSettings)["page_size"]
    assert _shown(_default(field)) not in rows["page_size"][0]


def test_directory_settings_rows_match_the_code() -> None:
    from hicache.adapters.storage import DirectorySettings

    rows = _rows(_section("`DirectorySettings`"))
    expected = {
        "root": "temporary",
        "capacity_bytes": "None",
        "fsync": "false",
        "checksum": "xxh3",
        "timeout_s": "None",
        "stale_tmp_s": "600",
        "read_threads": "2",
        "write_threads": "1",
    }
    fields = attrs.fields_dict(DirectorySettings)
    assert set(fields) == set(expected)
    assert fields["checksum"].default.name.lower() == "xxh3"
    assert fields["fsync"].default is False
    assert fields["stale_tmp_s"].default == 600
    assert (fields["read_threads"].default, fields["write_threads"].default) == (2, 1)
    for name, shown in expected.items():
        assert shown in rows[name][0], (name, rows[name])


def test_every_mooncake_key_and_variable_is_documented_with_its_default() -> None:
    from hicache.adapters.storage.mooncake_config import (
        CONFIG_PATH_VARS,
        ENV_VARS,
        KEYS,
        MooncakeConfig,
        parse_size,
    )

    section = _section("Mooncake")
    rows = _rows(section)
    assert set(KEYS) <= set(rows)
    for var in (*ENV_VARS, *CONFIG_PATH_VARS):
        assert f"`{var}`" in section, var
    for field in attrs.fields(MooncakeConfig):
        if field.name not in KEYS or field.default is attrs.NOTHING:
            continue
        cell = rows[field.name][1].strip("`")
        if field.name.endswith("_size"):
            assert parse_size(field.name, cell) == field.default
        elif isinstance(field.default, float):
            assert float(cell) == field.default
        else:
            assert cell == ('""' if field.default == "" else field.default), field.name


@pytest.mark.parametrize("name", ["device", "backend", "event_sets", "name", "device_ownership"])
def test_open_runtime_options_show_their_signature_defaults(name: str) -> None:
    import inspect

    from hicache.bootstrap.runtime import open_runtime

    rows = _rows(_section("Runtime and engine options"))
    default = inspect.signature(open_runtime).parameters[name].default
    assert repr(default).replace("'", '"') in rows[name][0] or str(default) in rows[name][0]


def _key_rows() -> dict[str, list[str]]:
    rows: dict[str, list[str]] = {}
    for line in _section("One configuration").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`([a-z_.]+)`", cells[0]) if cells else None
        if m and "." in m.group(1):
            rows[m.group(1)] = cells[1:]
    return rows


def _config_shown(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return "{}" if value == {} else str(value)


def test_every_config_key_is_documented_with_its_variable_and_default() -> None:
    from hicache.bootstrap.config_keys import KEYS

    rows = _key_rows()
    assert set(rows) == {k.name for k in KEYS}
    for key in KEYS:
        variable, default = rows[key.name][0], rows[key.name][1]
        assert variable == f"`{key.env}`", key.name
        assert default == _config_shown(key.default), (key.name, default)


def test_the_documented_config_file_loads(tmp_path: Path) -> None:
    from hicache.bootstrap import HiCacheConfig

    text = _section("One configuration")
    toml = text.split("```toml\n", 1)[1].split("```", 1)[0]
    (tmp_path / "hicache.toml").write_text(toml)
    (tmp_path / "store.yaml").write_text("root: /tmp/hicache-docs-example\n")
    config = HiCacheConfig.load(tmp_path / "hicache.toml", env={})
    assert config.plan_settings().sizing.bytes_per_rank == 64 << 30  # type: ignore[union-attr]
    assert config.storage_settings().extra_config == {"root": "/tmp/hicache-docs-example"}
    assert config.cache_settings().writes.storage is not None
