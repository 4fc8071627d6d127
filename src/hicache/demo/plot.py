"""The ``--plot`` timeline of ``hicache demo``: per layer, the wait for its load and its compute.

- write_timeline: one PNG, one panel per host-hit request; time 0 is the load's submission.

Needs matplotlib (imported here only, when a plot is asked for).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def write_timeline(timelines: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 1.6 + 1.2 * len(timelines)))
    axes = list(axes) if len(timelines) > 1 else [axes]
    for ax, tl in zip(axes, timelines, strict=True):
        for layer, w0, w1, c1 in tl["layers"]:
            ax.broken_barh([(w0 * 1e3, max(w1 - w0, 1e-6) * 1e3)], (layer - 0.4, 0.8), color="C3")
            ax.broken_barh([(w1 * 1e3, (c1 - w1) * 1e3)], (layer - 0.4, 0.8), color="C0")
        ax.set_title(f"{tl['name']}: wait for layer load (red), layer compute (blue)", fontsize=9)
        ax.set_ylabel("layer")
    axes[-1].set_xlabel("ms since the load was submitted")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
