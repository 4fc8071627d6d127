"""The ``--plot`` timeline of ``hicache demo``: per request and cached run, per layer, the
layer's load, the forward pass's wait for it and the layer's compute.

- draw_timeline / write_timeline: the figure / one PNG. One row of panels per request (turns, branch), one column per cached
  run (host hit, storage hit). Every panel has the same x axis: ms since the request began (a
  host hit: its match; a storage hit: its first match, before the prefetch). The top lane
  ("request") shows the prefetch (storage -> host, storage hits only) and the match with the
  load call (device pages allocated, the load submitted); below it one lane per model layer,
  labelled with its index and kind (full / sliding / state). In a layer's lane: its load (the
  copy host -> device, from the previous layer's completion: the copy stream copies layer after
  layer; the first layer's from the match), the forward pass's wait before the layer read its
  cache, and the layer's compute. Waits are far shorter than compute: each is drawn at least a
  few pixels wide, and its length in ms is written at the right of its lane. A dashed line marks
  the first token. A caption under the panels says what to read.

The input is what ``hicache.demo.workload`` records per request (``_timelines``): ``name``,
``kinds`` (per model layer), ``runs``: ``label``, ``prefetch_s``, ``begun_s``, ``ttft_s``,
``layers`` (layer, wait start, wait end, compute end) and ``loaded`` (layer, its load complete),
in seconds since the run's match. Needs matplotlib (the ``plot`` extra; imported here only,
when a plot is asked for).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

COLOURS = {
    "prefetch": "#8e44ad",  # purple: storage -> host
    "begin": "#9e9e9e",  # grey: match, device pages, load submitted
    "load": "#2e9b4f",  # green: a layer's copy host -> device
    "wait": "#d62728",  # red: the forward pass waits for that layer
    "compute": "#1f77b4",  # blue: the layer's compute
}
LEGEND = {
    "prefetch": "prefetch: storage -> host (storage hit only)",
    "begin": "match + load call (pages allocated, copy submitted)",
    "load": "layer's load: host -> device copy, until complete",
    "wait": "forward pass waits for the layer's load (ms at right)",
    "compute": "layer's compute (suffix prefill)",
}
MIN_WIDTH = 0.004  # of the x range: the narrowest bar drawn, so a 0.01 ms wait still shows


def write_timeline(timelines: Sequence[dict[str, Any]], path: str) -> None:
    """Write the PNG of ``timelines`` (one entry per request) to ``path``."""
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]

    fig = draw_timeline(timelines)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)


def draw_timeline(timelines: Sequence[dict[str, Any]]) -> Any:
    """The matplotlib Figure of ``timelines`` (the caller closes it)."""
    import matplotlib  # type: ignore[import-not-found,unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found,unused-ignore]
    from matplotlib.lines import Line2D  # type: ignore[import-not-found,unused-ignore]
    from matplotlib.patches import Patch  # type: ignore[import-not-found,unused-ignore]

    labels: list[str] = []
    for tl in timelines:
        labels += [r["label"] for r in tl["runs"] if r["label"] not in labels]
    layers = max((len(tl["kinds"]) for tl in timelines), default=1)
    xmax = max((_end_ms(r) for tl in timelines for r in tl["runs"]), default=1.0) * 1.1
    rows, cols = max(len(timelines), 1), max(len(labels), 1)
    fig, axes = plt.subplots(
        rows,
        cols,
        sharex=True,
        squeeze=False,
        figsize=(6.4 * cols + 0.6, 0.28 * (layers + 1) * rows + 0.75 * rows + 1.5),
    )
    for row, tl in enumerate(timelines):
        runs = {r["label"]: r for r in tl["runs"]}
        for col, label in enumerate(labels):
            ax = axes[row][col]
            if label not in runs:
                ax.set_axis_off()
                continue
            _panel(ax, tl["name"], tl["kinds"], runs[label], xmax)
    for ax in axes[-1]:
        ax.set_xlabel("ms since the request began (its first match)", fontsize=8)
    handles: list[Any] = [Patch(color=COLOURS[k], label=text) for k, text in LEGEND.items()]
    handles.append(Line2D([], [], color="black", linestyle="--", label="first token"))
    fig.legend(handles=handles, loc="upper center", ncol=3, fontsize=8, frameon=False)
    fig.text(0.01, 0.005, _caption(timelines), fontsize=8, va="bottom", ha="left", wrap=True)
    top = 1 - 0.6 / fig.get_figheight()
    bottom = 0.75 / fig.get_figheight()
    fig.tight_layout(rect=(0, bottom, 1, top), h_pad=0.8, w_pad=1.2)
    return fig


def _end_ms(run: dict[str, Any]) -> float:
    ends = [c for _, _, _, c in run["layers"]] + [d for _, d in run["loaded"]] + [run["begun_s"]]
    return float(max(run["ttft_s"], run["prefetch_s"] + max(ends, default=0.0))) * 1e3


def _bar(ax: Any, start: float, end: float, y: float, height: float, key: str, xmax: float) -> None:
    width = max(end - start, MIN_WIDTH * xmax)
    ax.broken_barh([(start, width)], (y, height), color=COLOURS[key], linewidth=0, label=key)


def _panel(ax: Any, name: str, kinds: Sequence[str], run: dict[str, Any], xmax: float) -> None:
    """One cached run: the request lane at y = 0, model layer i at y = i + 1 (top to bottom)."""
    offset = run["prefetch_s"] * 1e3  # the run's times count from its match
    if offset > 0:
        _bar(ax, 0.0, offset, -0.35, 0.7, "prefetch", xmax)
    _bar(ax, offset, offset + run["begun_s"] * 1e3, -0.35, 0.7, "begin", xmax)
    previous = offset
    for layer, done in sorted(run["loaded"], key=lambda x: (x[1], x[0])):
        done_ms = offset + done * 1e3
        _bar(ax, previous, done_ms, layer + 1 - 0.42, 0.38, "load", xmax)
        previous = done_ms
    waited = 0.0
    for layer, w0, w1, c1 in run["layers"]:
        w0, w1, c1 = (offset + t * 1e3 for t in (w0, w1, c1))
        _bar(ax, w1, c1, layer + 1, 0.4, "compute", xmax)
        _bar(ax, w0, w1, layer + 1, 0.4, "wait", xmax)
        waited += w1 - w0
        ax.text(
            1.005, layer + 1.1, f"{w1 - w0:.2f}", transform=ax.get_yaxis_transform(),
            fontsize=6.5, color=COLOURS["wait"], va="center", ha="left",
        )  # fmt: skip
    ax.text(
        1.005, 0, "wait ms", transform=ax.get_yaxis_transform(),
        fontsize=6.5, color=COLOURS["wait"], va="center", ha="left",
    )  # fmt: skip
    ttft = run["ttft_s"] * 1e3
    ax.axvline(ttft, color="black", linestyle="--", linewidth=0.9)
    ax.set_ylim(len(kinds) + 0.7, -0.7)
    ax.set_yticks(range(len(kinds) + 1))
    ax.set_yticklabels(["request", *(f"{i} {k}" for i, k in enumerate(kinds))], fontsize=7)
    ax.set_xlim(0, xmax)
    ax.tick_params(axis="x", labelsize=7, labelbottom=True)
    ax.grid(axis="x", color="0.9", linewidth=0.6)
    ax.set_axisbelow(True)
    ax.set_title(
        f"{name}, {run['label']}: first token at {ttft:.0f} ms, waits {waited:.2f} ms in all",
        fontsize=8.5, loc="left",
    )  # fmt: skip


def _caption(timelines: Sequence[dict[str, Any]]) -> str:
    runs = [r for tl in timelines for r in tl["runs"]]
    waited = sum(w1 - w0 for r in runs for _, w0, w1, _ in r["layers"]) * 1e3
    compute = sum(c1 - w1 for r in runs for _, _, w1, c1 in r["layers"]) * 1e3
    share = waited / (waited + compute) if waited + compute > 0 else 0.0
    return (
        "What to see: each cached request restores its prefix layer by layer while the model "
        "computes. A green load bar that ends before its layer's blue compute starts means that "
        "layer never had to wait for its copy (a red wait after the green bar ended is the wait "
        "call itself, slowed by a busy CPU, not copy time). Over these "
        f"{len(runs)} runs the forward passes waited {waited:.1f} ms against {compute:.0f} ms "
        f"of layer compute ({share:.2%}): the copies hide behind compute. A storage hit first "
        "reads the prefix from the store (purple), then loads it like a host hit. The first "
        "layer's load bar starts at the match: its copy is submitted within the grey span. "
        "Times on a shared CPU vary from run to run."
    )


__all__ = ["draw_timeline", "write_timeline"]
