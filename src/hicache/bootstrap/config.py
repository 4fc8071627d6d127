"""Reading settings from the outside world (files, bundled fixtures) into domain values.

- read_config_text: a regular file of at most MAX_CONFIG_BYTES as UTF-8 text (never a FIFO,
  device or directory; an unreadable or over-long path is a ConfigError).
- read_mapping_file: the mapping a .json, .toml or .yaml file holds (bounded, a key given twice
  refused, parse errors on one line).
- load_extra_config: a JSON string, a mapping, "@path" or a Path to a .json, .toml or .yaml file.
- storage_settings: StorageSettings from a backend name and an extra config in any of those forms.
- bundled_models: the names of the HuggingFace configs shipped with hicache.
- load_model_config: a config.json path or a bundled name into a dict.
- load_model_spec: the same, into a ModelSpec.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

from hicache.domain import ConfigError, ModelSpec, StorageSettings, parse_extra_config
from hicache.domain.errors import shown
from hicache.domain.limits import check_tree, parse_json

MAX_CONFIG_BYTES = 16 << 20  # a config file larger than 16 MiB is refused, not read

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def _reason(e: OSError | UnicodeDecodeError) -> str:
    """Why a file could not be read, in a few words (a binary file is not UTF-8 text)."""
    if isinstance(e, UnicodeDecodeError):
        return f"not UTF-8 text (byte {e.start})"
    return e.strerror or str(e)


def _shown(path: Path) -> str:
    text = str(path)
    return repr(text if len(text) <= 120 else text[:117] + "...")


def read_config_text(path: Path, what: str) -> str:
    """The UTF-8 text of a regular file of at most MAX_CONFIG_BYTES.

    The file is opened without blocking (a FIFO opens but is then refused) and checked with
    fstat, so a FIFO, /dev/zero, a socket or a directory is a ConfigError, never a hang or an
    unbounded read; so is a path too long for the system or with a NUL byte.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ConfigError(f"cannot read {what} {_shown(path)}: {why}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"cannot read {what} {_shown(path)}: not a regular file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(
                f"cannot read {what} {_shown(path)}: {st.st_size} B, more than the "
                f"{MAX_CONFIG_BYTES} B accepted"
            )
        chunks: list[bytes] = []
        left = MAX_CONFIG_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
    except OSError as e:
        raise ConfigError(f"cannot read {what} {_shown(path)}: {_reason(e)}") from None
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > MAX_CONFIG_BYTES:  # grew while being read
        raise ConfigError(
            f"cannot read {what} {_shown(path)}: more than the {MAX_CONFIG_BYTES} B accepted"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read {what} {_shown(path)}: {_reason(e)}") from None


def _one_line(e: BaseException) -> str:
    """A parser's message on one line (YAML's span several, with a caret under the column)."""
    text = " ".join(part.strip() for part in str(e).splitlines() if part.strip())
    return text if len(text) <= 300 else text[:297] + "..."


def _load_yaml(text: str) -> Any:
    """YAML text with the safe loader, refusing a key given twice in one mapping (PyYAML keeps
    the last one). Merge keys (``<<: *base``) may still be overridden by the mapping's own."""
    import yaml  # only needed for YAML files

    class _Loader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Any:
        seen: set[object] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = loader.construct_object(key_node, deep=True)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: construct_mapping says so
                break
            if duplicate:
                raise ConfigError(
                    f"key {shown(key)} is given twice in one mapping (line "
                    f"{key_node.start_mark.line + 1}; keep one)"
                )
            seen.add(key)
        return loader.construct_mapping(node, deep=True)

    _Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass: no arbitrary objects


def read_mapping_file(path: Path, what: str = "extra config file") -> dict[str, Any]:
    """The mapping a .json, .toml, .yaml or .yml file holds; a ConfigError names ``what``. A key
    given twice in one object or mapping is refused in each format (TOML refuses it itself)."""
    text = read_config_text(path, what)
    suffix = path.suffix.lower()
    if suffix not in (".json", ".toml", ".yaml", ".yml"):
        raise ConfigError(
            f"{what} {_shown(path)} has suffix {suffix!r}: expected .json, .toml, .yaml or .yml"
        )
    try:
        if suffix == ".json":
            data = parse_json(text, "JSON")
        elif suffix == ".toml":
            data = tomllib.loads(text)
        else:
            data = _load_yaml(text)
    except ConfigError as e:
        raise ConfigError(f"cannot parse {what} {_shown(path)}: {e}") from None
    except RecursionError:
        raise ConfigError(f"{what} {_shown(path)} is nested too deeply") from None
    except Exception as e:  # toml and yaml each raise their own parse errors
        raise ConfigError(f"cannot parse {what} {_shown(path)}: {_one_line(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} {_shown(path)} must hold a mapping, got {type(data).__name__}")
    check_tree(data, f"{what} {_shown(path)}")
    return data


def load_extra_config(value: str | os.PathLike[str] | Mapping[str, Any] | None) -> dict[str, Any]:
    """Extra config from a JSON string, a mapping, "@path" or a Path (.json, .toml, .yaml)."""
    if isinstance(value, os.PathLike):
        return read_mapping_file(Path(value).expanduser())
    if isinstance(value, str) and value.strip().startswith("@"):
        return read_mapping_file(Path(value.strip()[1:]).expanduser())
    return parse_extra_config(value)


def storage_settings(
    backend: str | None, extra_config: str | os.PathLike[str] | Mapping[str, Any] | None = None
) -> StorageSettings:
    """StorageSettings from a backend name and an extra config in any supported form."""
    return StorageSettings(backend=backend or None, extra_config=load_extra_config(extra_config))


def bundled_models() -> list[str]:
    root = resources.files("hicache") / "fixtures" / "models"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


def _kind(path: Path) -> str:
    """ "dir", "file" (anything else that exists, FIFOs included) or "" (absent)."""
    try:
        st = os.stat(path)
    except ValueError as e:  # an embedded NUL byte
        raise ConfigError(f"cannot read model config {_shown(path)}: {e}") from None
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return ""
        raise ConfigError(f"cannot read model config {_shown(path)}: {_reason(e)}") from None
    return "dir" if stat.S_ISDIR(st.st_mode) else "file"


def load_model_config(model: str | os.PathLike[str]) -> dict[str, Any]:
    """A HuggingFace config dict from a path to config.json (or its folder) or a bundled name."""
    if not isinstance(model, (str, os.PathLike)):
        raise ConfigError(
            f"model must be a path or a bundled model name, got {type(model).__name__}"
        )
    path = Path(model).expanduser()
    kind = _kind(path)
    if kind == "dir":
        path = path / "config.json"
        kind = _kind(path)
    if kind:
        source = str(path)
        text = read_config_text(path, "model config")
    elif isinstance(model, os.PathLike):
        raise ConfigError(f"model config {_shown(path)} does not exist")
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
    data = parse_json(text, f"model config {_shown(Path(source))}")
    if not isinstance(data, dict):
        raise ConfigError(f"model config {source!r} must be a JSON object")
    return data


def load_model_spec(model: str | os.PathLike[str]) -> ModelSpec:
    return ModelSpec.from_hf_config(load_model_config(model))
