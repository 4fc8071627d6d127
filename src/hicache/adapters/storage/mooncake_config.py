"""Mooncake Store settings, read the way the reference engine (SGLang) reads them.

- MooncakeConfig: the frozen settings of one Mooncake client (master, protocol, device, segment
  sizes, metadata server, deadlines).
- load_mooncake_config: the one entry point; from the extra config when it names a master,
  else from the JSON file named by MOONCAKE_CONFIG_PATH (or SGLANG_HICACHE_MOONCAKE_CONFIG_PATH),
  else from the MOONCAKE_* environment variables; one ConfigError naming every bad value.
- names_master: whether any of those sources names a master (a bench starts one otherwise).
- parse_size: a byte size as an int or a string such as "4gb", "16 MB", "512MiB" (binary units).

Defaults follow SGLang's python/sglang/srt/environ.py and
python/sglang/srt/mem_cache/storage/mooncake_store/mooncake_store.py: metadata server
"P2PHANDSHAKE", protocol "tcp", global segment 4 GiB, local buffer 16 MiB, hostname "localhost".
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Mapping
from typing import Any

import attrs

from hicache.domain import ConfigError
from hicache.domain.errors import shown
from hicache.domain.limits import is_finite_number

PROTOCOLS = ("tcp", "rdma")
DEFAULT_METADATA_SERVER = "P2PHANDSHAKE"
DEFAULT_GLOBAL_SEGMENT = 4 << 30
DEFAULT_LOCAL_BUFFER = 16 << 20
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_SETUP_TIMEOUT_S = 10.0
CONFIG_PATH_VARS = ("MOONCAKE_CONFIG_PATH", "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH")
MAX_CONFIG_FILE_BYTES = 1 << 20

# The keys this adapter reads (the extra config may hold other stores' and hicache's keys too).
KEYS = (
    "master_server_address",
    "metadata_server",
    "protocol",
    "device_name",
    "local_hostname",
    "global_segment_size",
    "local_buffer_size",
    "timeout_s",
    "setup_timeout_s",
)
# Environment variable -> key (SGLang's names; LOCAL_HOSTNAME is its legacy fallback).
ENV_VARS = {
    "MOONCAKE_MASTER": "master_server_address",
    "MOONCAKE_TE_META_DATA_SERVER": "metadata_server",
    "MOONCAKE_PROTOCOL": "protocol",
    "MOONCAKE_DEVICE": "device_name",
    "MOONCAKE_LOCAL_HOSTNAME": "local_hostname",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "global_segment_size",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "local_buffer_size",
    "MOONCAKE_TIMEOUT_S": "timeout_s",
    "MOONCAKE_SETUP_TIMEOUT_S": "setup_timeout_s",
}

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tb": 1 << 40,
    "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*([0-9]{1,15})\s*([a-zA-Z]{0,3})\s*$")
_MAX_SIZE = 1 << 50  # 1 PiB: far above any segment, far below overflow in the C++ client
_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]{1,253}):([0-9]{1,5})$")


@attrs.frozen
class MooncakeConfig:
    """One Mooncake client's settings; build it with load_mooncake_config (it validates)."""

    master_server_address: str
    metadata_server: str = DEFAULT_METADATA_SERVER
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "localhost"
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER
    timeout_s: float = DEFAULT_TIMEOUT_S  # a batch call's deadline when the caller gives none
    setup_timeout_s: float = DEFAULT_SETUP_TIMEOUT_S  # reaching the master and setting up
    source: str = "extra config"  # where the settings came from, for messages

    @property
    def master_host_port(self) -> tuple[str, int]:
        host, _, port = self.master_server_address.rpartition(":")
        return host.strip("[]"), int(port)


def parse_size(name: str, value: object) -> int:
    """``value`` (an int, or a string like "4gb", "16 MB", "512MiB") as a byte count.

    Units are binary (k = 1024), as in SGLang and Mooncake ("4 GB" is 4 GiB).
    """
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(
            f"{name} {shown(value)}: expected a byte count (an integer, or a string such as "
            "'4gb' or '512 MiB')"
        )
    if isinstance(value, int):
        n = value
    else:
        m = _SIZE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ConfigError(
                f"{name} {shown(value)}: expected a byte count such as '4gb', '16 MB' or '512MiB' "
                "(units b, kb, mb, gb, tb, binary)"
            )
        n = int(m.group(1)) * _UNITS[unit]
    if not 0 <= n <= _MAX_SIZE:
        raise ConfigError(f"{name} {shown(value)}: expected 0 to {_MAX_SIZE} bytes")
    return n


def _seconds(name: str, value: object) -> float:
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{name} {shown(value)}: expected a number of seconds") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{name} {shown(value)}: expected a number of seconds")
    if not (is_finite_number(value) and 0 < value <= 3600):
        raise ConfigError(f"{name} {shown(value)}: expected more than 0 and at most 3600 seconds")
    return float(value)


def _text(name: str, value: object, *, empty_ok: bool = False) -> str:
    if not isinstance(value, str) or (not empty_ok and not value.strip()):
        what = "a string" if empty_ok else "a non-empty string"
        raise ConfigError(f"{name} {value!r}: expected {what}")
    if len(value) > 4096 or "\x00" in value:
        raise ConfigError(f"{name}: expected at most 4096 characters and no NUL byte")
    return value.strip()


def _address(name: str, value: object) -> str:
    text = _text(name, value)
    m = _ADDRESS.match(text)
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise ConfigError(
            f"{name} {value!r}: expected host:port of the mooncake_master, e.g. '10.0.0.5:50051'"
        )
    return text


def _protocol(name: str, value: object) -> str:
    text = _text(name, value).lower()
    if text not in PROTOCOLS:
        raise ConfigError(f"{name} {value!r}: expected one of {', '.join(PROTOCOLS)}")
    return text


_CHECKS: dict[str, Any] = {
    "master_server_address": _address,
    "metadata_server": _text,
    "protocol": _protocol,
    "device_name": lambda n, v: _text(n, v, empty_ok=True),
    "local_hostname": _text,
    "global_segment_size": parse_size,
    "local_buffer_size": parse_size,
    "timeout_s": _seconds,
    "setup_timeout_s": _seconds,
}


def _build(values: Mapping[str, object], source: str) -> MooncakeConfig:
    """Check every value; one ConfigError naming each bad or missing one."""
    problems: list[str] = []
    checked: dict[str, Any] = {}
    for key in KEYS:
        if key not in values:
            continue
        try:
            checked[key] = _CHECKS[key](key, values[key])
        except ConfigError as e:
            problems.append(str(e))
    if "master_server_address" not in values:
        problems.append("master_server_address is missing (host:port of the mooncake_master)")
    if problems:
        raise ConfigError(f"mooncake settings from {source}: " + "; ".join(problems))
    return MooncakeConfig(source=source, **checked)


def _read_file(var: str, path: str) -> dict[str, object]:
    where = f"the file {path!r} named by {var}"
    try:
        st = os.stat(path)
    except OSError as e:
        raise ConfigError(f"mooncake settings: cannot read {where}: {e.strerror}") from e
    if not stat.S_ISREG(st.st_mode):
        raise ConfigError(f"mooncake settings: {where} is not a regular file")
    if st.st_size > MAX_CONFIG_FILE_BYTES:
        raise ConfigError(
            f"mooncake settings: {where} holds {st.st_size} B, more than {MAX_CONFIG_FILE_BYTES} B"
        )
    try:
        # Non-blocking, and checked again on the open file: a path swapped for a FIFO after
        # the stat above must not block the reader.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ConfigError(f"mooncake settings: {where} is not a regular file")
            raw = f.read(MAX_CONFIG_FILE_BYTES + 1)
        data = json.loads(raw)
    except OSError as e:
        raise ConfigError(f"mooncake settings: cannot read {where}: {e.strerror}") from e
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"mooncake settings: {where} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"mooncake settings: {where} must hold a JSON object")
    unknown = sorted(str(k) for k in data if k not in KEYS)
    if unknown:
        raise ConfigError(
            f"mooncake settings: {where} has unknown keys {', '.join(unknown)} "
            f"(known: {', '.join(KEYS)})"
        )
    return data


def names_master(
    extra_config: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> bool:
    """Whether any source load_mooncake_config reads names a master (else one may be started)."""
    env = os.environ if environ is None else environ
    return (
        "master_server_address" in (extra_config or {})
        or any(env.get(var) for var in CONFIG_PATH_VARS)
        or bool(env.get("MOONCAKE_MASTER"))
    )


def load_mooncake_config(
    extra_config: Mapping[str, object] | None = None,
    environ: Mapping[str, str] | None = None,
) -> MooncakeConfig:
    """The Mooncake settings, from the first source that names a master.

    1. ``extra_config`` (the storage backend's extra config) when it has
       ``master_server_address``; its other Mooncake keys are read too, the rest ignored.
    2. The JSON file named by MOONCAKE_CONFIG_PATH or SGLANG_HICACHE_MOONCAKE_CONFIG_PATH.
    3. The environment: MOONCAKE_MASTER, MOONCAKE_PROTOCOL, MOONCAKE_DEVICE,
       MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_LOCAL_HOSTNAME (or LOCAL_HOSTNAME),
       MOONCAKE_GLOBAL_SEGMENT_SIZE, MOONCAKE_LOCAL_BUFFER_SIZE, MOONCAKE_TIMEOUT_S,
       MOONCAKE_SETUP_TIMEOUT_S.
    """
    env = os.environ if environ is None else environ
    extra = dict(extra_config or {})
    if "master_server_address" in extra:
        return _build({k: v for k, v in extra.items() if k in KEYS}, "the extra config")
    for var in CONFIG_PATH_VARS:
        path = env.get(var)
        if path:
            return _build(_read_file(var, path), f"{var}={path}")
    if env.get("MOONCAKE_MASTER"):
        values: dict[str, object] = {}
        if env.get("LOCAL_HOSTNAME"):
            values["local_hostname"] = env["LOCAL_HOSTNAME"]
        for var, key in ENV_VARS.items():
            if env.get(var):
                values[key] = env[var]
        return _build(values, "the MOONCAKE_* environment variables")
    raise ConfigError(
        "mooncake settings: no master named: set master_server_address in the extra config "
        '(e.g. \'{"master_server_address": "10.0.0.5:50051"}\'), or name a JSON file with '
        "MOONCAKE_CONFIG_PATH, or set MOONCAKE_MASTER"
    )
