"""`hicache demo --plot`: the timeline figure drawn from recorded runs (no model run): a lane
per layer labelled by kind, each layer's load its own bar, waits visible however short, one x
scale for every panel, storage hits with their prefetch, a legend and a caption."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("matplotlib")

from hicache.demo.plot import MIN_WIDTH, draw_timeline, write_timeline

KINDS = ["sliding", "full", "state"]


def _run(label: str, prefetch_s: float, loaded: list[float], waits: list[float]) -> dict[str, Any]:
    layers, t = [], 0.010
    for i, w in enumerate(waits):
        layers.append((i, t, t + w, t + w + 0.020))
        t += w + 0.020
    return {
        "label": label,
        "prefetch_s": prefetch_s,
        "begun_s": 0.002,
        "ttft_s": prefetch_s + t + 0.001,
        "layers": layers,
        "loaded": list(enumerate(loaded)),
    }


TIMELINES = [
    {
        "name": "turn 1",
        "kinds": KINDS,
        "runs": [
            _run("host hit", 0.0, [0.004, 0.004, 0.004], [0.00001, 0.003, 0.0]),
            _run("storage hit", 0.030, [0.005, 0.030, 0.031], [0.0, 0.001, 0.0]),
        ],
    },
    {"name": "branch", "kinds": KINDS, "runs": [_run("host hit", 0.0, [0.003] * 3, [0.0] * 3)]},
]


def _bars(ax: Any, key: str) -> list[tuple[float, float, float, float]]:
    """(x0, x1, y0, y1) of each bar of one kind in a panel."""
    out = []
    for c in ax.collections:
        if c.get_label() == key:
            for path in c.get_paths():
                v = path.vertices
                out.append((v[:, 0].min(), v[:, 0].max(), v[:, 1].min(), v[:, 1].max()))
    return out


@pytest.fixture
def figure() -> Any:
    import matplotlib.pyplot as plt

    fig = draw_timeline(TIMELINES)
    yield fig
    plt.close(fig)


def test_one_panel_per_request_and_run_on_one_x_scale_in_ms(figure: Any) -> None:
    panels = [ax for ax in figure.axes if ax.axison]
    assert len(panels) == 3  # the branch has no storage hit: its panel is left empty
    assert len({ax.get_xlim() for ax in panels}) == 1
    assert all("ms" in ax.get_xlabel() for ax in figure.axes[-2:])
    titles = [ax.get_title(loc="left") for ax in panels]
    assert titles[0].startswith("turn 1, host hit")
    assert titles[1].startswith("turn 1, storage hit")


def test_layer_ticks_are_integers_labelled_with_their_kind(figure: Any) -> None:
    ax = figure.axes[0]
    assert list(ax.get_yticks()) == [0, 1, 2, 3]
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert labels == ["request", "0 sliding", "1 full", "2 state"]


def test_each_layer_load_is_its_own_bar_in_its_own_lane(figure: Any) -> None:
    host = figure.axes[0]
    loads = _bars(host, "load")
    assert len(loads) == 3
    lanes = sorted(round((y0 + y1) / 2) for _, _, y0, y1 in loads)
    assert lanes == [1, 2, 3]  # layer i's lane is y = i + 1, under the request lane


def test_a_short_wait_is_still_drawn_and_its_length_written(figure: Any) -> None:
    host = figure.axes[0]
    xmax = host.get_xlim()[1]
    waits = _bars(host, "wait")
    assert len(waits) == 3
    assert min(x1 - x0 for x0, x1, _, _ in waits) >= MIN_WIDTH * xmax * 0.999
    texts = [t.get_text() for t in host.texts]
    assert "3.00" in texts
    assert "0.01" in texts
    assert "wait ms" in texts


def test_a_storage_hit_draws_its_prefetch_before_the_load(figure: Any) -> None:
    storage = figure.axes[1]
    (prefetch,) = _bars(storage, "prefetch")
    assert prefetch[0] == 0
    assert prefetch[1] == pytest.approx(30.0)
    first_load = min(x0 for x0, _, _, _ in _bars(storage, "load"))
    assert first_load == pytest.approx(30.0)  # the load counts from the match after it
    assert not _bars(figure.axes[0], "prefetch")


def test_a_legend_and_a_caption_tell_what_to_read(figure: Any) -> None:
    (legend,) = figure.legends
    entries = [t.get_text() for t in legend.get_texts()]
    assert len(entries) == 6
    assert "first token" in entries
    caption = " ".join(t.get_text() for t in figure.texts)
    assert "What to see" in caption
    assert "waited 4.0 ms" in caption  # 0.01 + 3 + 1 ms over the three runs


def test_write_timeline_writes_a_png(tmp_path: Any) -> None:
    out = tmp_path / "t.png"
    write_timeline(TIMELINES, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_demo_records_a_timeline_for_every_host_and_storage_hit() -> None:
    import anyio

    from hicache.demo.workload import DemoSettings, run_demo

    settings = DemoSettings(device="cpu", turns=1, prefix_tokens=128, storage="directory")
    result = anyio.run(lambda: run_demo(settings, progress=lambda _: None))
    timelines = result["_timelines"]
    assert [t["name"] for t in timelines] == ["turn 1", "branch"]
    for tl in timelines:
        assert tl["kinds"] == [
            "sliding",
            "full",
            "state",
            "sliding",
            "full",
            "sliding",
            "state",
            "full",
        ]
        assert [r["label"] for r in tl["runs"]] == ["host hit", "storage hit"]
        host, storage = tl["runs"]
        assert host["prefetch_s"] == 0.0
        assert storage["prefetch_s"] > 0.0
        for run in tl["runs"]:
            assert [layer for layer, *_ in run["layers"]] == list(range(8))
            assert sorted(layer for layer, _ in run["loaded"]) == list(range(8))
            assert 0.0 < run["begun_s"] < run["ttft_s"]
            assert all(w0 <= w1 <= c1 for _, w0, w1, c1 in run["layers"])
