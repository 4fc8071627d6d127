"""Small formatting helpers shared by the command-line modules.

- human_bytes: 1536 -> "1.5 KiB"; below 1 KiB the exact count, "512 B".
"""

from __future__ import annotations


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"
