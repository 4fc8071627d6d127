"""Config files are read bounded, as regular files only (hicache.bootstrap.config)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hicache.bootstrap import load_extra_config, load_model_config
from hicache.bootstrap.config import MAX_CONFIG_BYTES, read_config_text
from hicache.bootstrap.machine import available_memory_bytes, check_fits
from hicache.domain import ConfigError, SizingError

pytestmark = pytest.mark.timeout(30)


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "extra.json"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):
        load_extra_config(f"@{fifo}")
    with pytest.raises(ConfigError, match="not a regular file"):
        load_model_config(str(fifo))


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null"])
def test_devices_are_refused(path: str) -> None:
    with pytest.raises(ConfigError, match="not a regular file"):
        read_config_text(Path(path), "model config")


def test_a_file_over_the_cap_is_refused_by_its_size(tmp_path: Path) -> None:
    big = tmp_path / "big.json"
    with big.open("wb") as f:
        f.truncate(MAX_CONFIG_BYTES + 1)
    with pytest.raises(ConfigError, match=f"{MAX_CONFIG_BYTES + 1} B, more than the"):
        load_extra_config(big)


def test_over_long_paths_and_nul_bytes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="File name too long"):
        load_model_config("/" + "a" * 5000)
    with pytest.raises(ConfigError, match="embedded null byte"):
        load_model_config("a\x00b")


def test_yaml_errors_are_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "x.yaml"
    broken.write_text("a: [1, 2\nb: {c\n")
    with pytest.raises(ConfigError) as info:
        load_extra_config(broken)
    assert "\n" not in str(info.value)
    assert str(info.value).startswith(f"cannot parse extra config file '{broken}'")


def test_check_fits_names_the_bytes_and_the_machine_limit() -> None:
    available = available_memory_bytes()
    assert available is not None
    assert available > 0
    check_fits(1 << 20, "a small thing")
    with pytest.raises(SizingError, match=f"needs {available * 2} B of host memory"):
        check_fits(available * 2, "a big thing")
