"""Reading settings from the outside world (files, bundled fixtures) into domain values.

- load_extra_config: a JSON string, a mapping, or "@path" to a .json, .toml or .yaml file.
- storage_settings: StorageSettings from a backend name and an extra config in any of those forms.
- bundled_models: the names of the HuggingFace configs shipped with hicache.
- load_model_config: a config.json path or a bundled name into a dict.
- load_model_spec: the same, into a ModelSpec.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from hicache.domain import ConfigError, ModelSpec, StorageSettings, parse_extra_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _reason(e: OSError | UnicodeDecodeError) -> str:
    """Why a file could not be read, in a few words (a binary file is not UTF-8 text)."""
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text (byte {e.start})"
    return e.strerror or str(e)


def _read_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read extra config file {str(path)!r}: {_reason(e)}") from None
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            import yaml  # only needed for YAML files

            data = yaml.safe_load(text)
        else:
            raise ConfigError(
                f"extra config file {str(path)!r} has suffix {suffix!r}: expected .json, .toml, "
                f".yaml or .yml"
            )
    except ConfigError:
        raise
    except Exception as e:  # json, toml and yaml each raise their own parse errors
        raise ConfigError(f"cannot parse extra config file {str(path)!r}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"extra config file {str(path)!r} must hold a mapping, got {type(data).__name__}"
        )
    return data


def load_extra_config(value: str | Mapping[str, Any] | None) -> dict[str, Any]:
    """Extra config from a JSON string, a mapping, or "@path" (.json, .toml, .yaml)."""
    if isinstance(value, str) and value.strip().startswith("@"):
        return _read_file(Path(value.strip()[1:]).expanduser())
    return parse_extra_config(value)


def storage_settings(
    backend: str | None, extra_config: str | Mapping[str, Any] | None = None
) -> StorageSettings:
    """StorageSettings from a backend name and an extra config in any supported form."""
    return StorageSettings(backend=backend or None, extra_config=load_extra_config(extra_config))


def bundled_models() -> list[str]:
    root = resources.files("hicache") / "fixtures" / "models"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


def load_model_config(model: str) -> dict[str, Any]:
    """A HuggingFace config dict from a path to config.json (or its folder) or a bundled name."""
    path = Path(model).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        source = str(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read model config {source!r}: {_reason(e)}") from None
    else:
        name = model.removesuffix(".json")
        if name not in bundled_models():
            raise ConfigError(
                f"model {model!r} is neither a readable config.json nor a bundled model "
                f"({', '.join(bundled_models())})"
            )
        source = f"bundled:{name}"
        root = resources.files("hicache") / "fixtures" / "models"
        text = (root / f"{name}.json").read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"model config {source!r} is not valid JSON: {e.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"model config {source!r} must be a JSON object")
    return data


def load_model_spec(model: str) -> ModelSpec:
    return ModelSpec.from_hf_config(load_model_config(model))
