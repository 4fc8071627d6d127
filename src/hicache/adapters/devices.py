"""Device names: the one parser of "cpu", "cuda[:N]" and "rocm[:N]" that every adapter uses.

- parse_device_name: a device string into (kind, index or None); syntax only, no GPU probing.
"""

from __future__ import annotations

import re

from hicache.domain.errors import ConfigError

_DEVICE_RE = re.compile(r"^(cpu|cuda|rocm)(?::(\d+))?$")


def parse_device_name(device: object) -> tuple[str, int | None]:
    """``device`` as (``"cpu"`` | ``"cuda"`` | ``"rocm"``, index or None); ConfigError if malformed."""
    m = _DEVICE_RE.match(device) if isinstance(device, str) else None
    if m is None:
        raise ConfigError(f"unknown device {device!r}: expected cpu, cuda[:N] or rocm[:N]")
    return m.group(1), int(m.group(2)) if m.group(2) is not None else None
