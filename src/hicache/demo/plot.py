"""The ``--plot`` timeline of ``hicache demo``: per layer, its load, the wait for it, its compute.

- write_timeline: one PNG, one panel per host-hit request; time 0 is the request's match. Per
  layer: the load's copy up to the moment the layer was complete (green: from the previous
  layer's completion, as the copy stream runs layer after layer), the forward pass's wait for it
  (red) and the layer's compute (blue).

Needs matplotlib (the ``plot`` extra; imported here only, when a plot is asked for).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def write_timeline(timelines: Sequence[dict[str, Any]], path: str) -> None:
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    fig, axes = plt.subplots(len(timelines), 1, figsize=(9, 1.6 + 1.5 * len(timelines)))
    axes = list(axes) if len(timelines) > 1 else [axes]
    for ax, tl in zip(axes, timelines, strict=True):
        start = min((w0 for _, w0, _, _ in tl["layers"]), default=0.0)
        previous = 0.0
        for layer, done in sorted(tl["loaded"], key=lambda x: x[1]):
            ax.broken_barh(
                [(previous * 1e3, max(done - previous, 1e-6) * 1e3)],
                (layer - 0.45, 0.3),
                color="C2",
            )
            previous = done
        for layer, w0, w1, c1 in tl["layers"]:
            ax.broken_barh([(w0 * 1e3, max(w1 - w0, 1e-6) * 1e3)], (layer - 0.1, 0.5), color="C3")
            ax.broken_barh([(w1 * 1e3, (c1 - w1) * 1e3)], (layer - 0.1, 0.5), color="C0")
        ax.axvline(start * 1e3, color="0.6", linewidth=0.8, linestyle=":")
        ax.set_title(
            f"{tl['name']}: layer load (green), wait for it (red), layer compute (blue)",
            fontsize=9,
        )
        ax.set_ylabel("layer")
    axes[-1].set_xlabel("ms since the request's match (the load is submitted right after it)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
